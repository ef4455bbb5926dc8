"""The lock between compaction and queries (`marsrl_core/store/maintenance_lock.py`), with real `flock`s:
two holders of one catalog's lock exclude each other as two processes would."""

import threading
import time

import pytest

from marsrl_core.store.maintenance_lock import MaintenanceLock


def _in_thread(body) -> threading.Thread:
    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


def test_a_compaction_waits_for_queries_and_queries_wait_for_it(tmp_path):
    catalog = tmp_path / "catalog.sqlite"
    query, other_query, compaction = MaintenanceLock(catalog), MaintenanceLock(catalog), MaintenanceLock(catalog)
    events = []
    with query.shared():
        with other_query.shared():  # queries share it
            events.append("two queries")

        def compact():
            with compaction.exclusive():
                events.append("compaction")
                time.sleep(0.3)
                events.append("compaction ends")

        compacting = _in_thread(compact)
        time.sleep(0.3)
        assert events == ["two queries"]  # the compaction waits for the query in flight

        def late_query():
            with other_query.shared():
                events.append("late query")

        late = _in_thread(late_query)
        time.sleep(0.3)
        assert events == ["two queries"]  # a query arriving while a compaction waits queues behind it
    compacting.join(5)
    late.join(5)
    assert events == ["two queries", "compaction", "compaction ends", "late query"]


def test_an_inner_shared_hold_does_not_release_the_outer_one(tmp_path):
    catalog = tmp_path / "catalog.sqlite"
    lock, compaction = MaintenanceLock(catalog), MaintenanceLock(catalog)
    events = []

    def compact():
        with compaction.exclusive():
            events.append("compaction")

    with lock.shared():
        with lock.shared():
            pass
        compacting = _in_thread(compact)
        time.sleep(0.3)
        assert events == []  # the outer hold still keeps the compaction out
    compacting.join(5)
    assert events == ["compaction"]


def test_exclusive_inside_shared_is_refused_where_there_is_a_file_to_lock(tmp_path):
    lock = MaintenanceLock(tmp_path / "catalog.sqlite")
    with lock.shared(), pytest.raises(RuntimeError, match="inside shared"):
        with lock.exclusive():
            pass
    unlocked = MaintenanceLock(None)  # a Postgres catalog: no file, nothing to wait for
    with unlocked.shared(), unlocked.exclusive():
        pass
