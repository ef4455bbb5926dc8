"""The store served by a child process: same results as in-process, errors come back, the child is
replaced when it has grown, a call whose child died is sent again and writes once, an orphaned child
exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import duckdb
import numpy as np
import psutil
import pytest

from marsrl_core.agents.problems import Problem
from marsrl_core.runtime.context import runtime
from marsrl_core.store import Rejection, RewardRow, SampleRow, SegmentRow, SegmentStore, StoreError
from marsrl_core.store.process import StoreProcess
from tests.configs import small_config

RUN = "run-1"


def _write_group(store, group_id: str, size: int = 3) -> list[str]:
    ids = [f"{group_id}-{i}" for i in range(size)]
    store.append(
        RUN,
        samples=[SampleRow(sid, "p1", "solver", 0, group_id, size, [7, 8, 9]) for sid in ids],
        segments=[
            SegmentRow(sid, 0, np.arange(i + 2), -np.linspace(0.1, 0.5, i + 2), 3, "stop") for i, sid in enumerate(ids)
        ],
        rewards=[RewardRow(sid, float(i % 2), bool(i % 2), "ok", str(i)) for i, sid in enumerate(ids)],
    )
    return ids


@pytest.fixture
def served(store_paths):
    store = StoreProcess(*store_paths)
    yield store
    store.close()


def test_a_served_store_reads_and_writes_the_same_lake_as_an_in_process_one(served, store_paths):
    written_here = _write_group(served, "g1")
    local = SegmentStore(*store_paths)
    written_there = _write_group(local, "g2")
    assert served.pid != os.getpid() and psutil.pid_exists(served.pid)
    for reader in (served, local):
        groups = reader.trainable_groups(RUN, "solver")
        assert sorted(g.group_id for g in groups) == ["g1", "g2"]
        samples = reader.load_samples(RUN, written_here + written_there)
        assert samples["g2-2"].token_ids.tolist() == [0, 1, 2, 3]
        assert np.allclose(samples["g1-1"].logprobs, [-0.1, -0.3, -0.5])
        assert samples["g1-1"].versions.tolist() == [3, 3, 3]
        assert samples["g1-1"].reward == 1.0 and samples["g1-1"].parsed == "1"
    served.commit_step(RUN, 1, {"solver": written_there}, "ckpt/1")
    assert local.latest_version(RUN) == (1, "ckpt/1")
    assert [g.group_id for g in local.trainable_groups(RUN, "solver")] == ["g1"]
    assert served.query("SELECT count(*) AS n FROM consumptions").column("n")[0].as_py() == 3
    local.close()


def test_errors_in_the_child_come_back_with_their_message(served, store_paths):
    with pytest.raises(StoreError, match=r"table='nope': unknown table"):
        served.count("nope")
    with pytest.raises(StoreError, match="unknown sample id"):
        served.append(RUN, segments=[SegmentRow("ghost", 0, [1], [-0.1], 0, "stop")])
    with pytest.raises(Exception, match="nonexistent_table"):
        served.query("SELECT * FROM nonexistent_table")
    with pytest.raises(AttributeError, match="_con"):
        _ = served._con
    assert served.count("samples") == 0  # the child still serves after the errors
    with pytest.raises(StoreError, match=r"catalog_url='nowhere': expected 'sqlite:<file>'"):
        StoreProcess("nowhere", store_paths[1])


def test_the_child_is_replaced_once_it_has_grown_past_its_budget_and_nothing_is_lost(store_paths):
    store = StoreProcess(*store_paths, recycle_after_mb=0.001, warmup_calls=5)  # a page of growth after 5 calls
    first = store.pid
    written = []
    for k in range(400):  # DuckDB keeps memory per query (the reason for the child), so this grows (in pages)
        written += _write_group(store, f"g{k}", size=2)
        store.trainable_groups(RUN, "solver")
        assert store.recycled == 0 or k >= 2, "replaced during its warm-up"
        if store.recycled >= 2:
            break
    assert store.recycled >= 2, "the child never grew past a 1 KB budget"
    assert store.pid != first and not psutil.pid_exists(first)
    assert sorted(store.load_samples(RUN, written)) == sorted(written)
    assert store.count("samples", RUN) == len(written)
    store.close()


def test_a_child_that_died_between_calls_is_replaced_before_the_next_call(served):
    _write_group(served, "g1")
    dead = served.pid
    os.kill(dead, signal.SIGKILL)
    psutil.Process(dead).wait(timeout=10)
    _write_group(served, "g2")  # a write, which is never sent twice: it reaches a new child
    assert served.count("samples", RUN) == 6 and served.pid != dead and served.restarted == 1


def _crashing_child(store_paths, monkeypatch, nth: int) -> StoreProcess:
    """A served store whose children each die (SIGKILL) at their `nth` call (the `store.call` point)."""
    monkeypatch.setenv("MARSRL_CRASH_AT", f"store.call:{nth}")
    return StoreProcess(*store_paths)


def test_a_read_or_mark_whose_child_dies_during_it_is_sent_again_to_a_new_child(store_paths, monkeypatch):
    served = _crashing_child(store_paths, monkeypatch, 2)
    try:
        _write_group(served, "g1")  # the first child's first call
        first = served.pid
        assert served.count("samples", RUN) == 3  # its second: it dies, and a new child answers
        assert served.restarted == 1 and served.pid != first
        served.mark(RUN, "e")  # the new child's first call was the replayed count: each call now dies once
        assert served.has_event(RUN, "e") and served.restarted == 3
        assert served.query("SELECT count(*) AS n FROM run_events").column("n")[0].as_py() == 1
    finally:
        served.close()


def test_a_write_whose_child_dies_during_it_is_written_once_by_a_new_child(store_paths, monkeypatch):
    served = _crashing_child(store_paths, monkeypatch, 2)
    try:
        _write_group(served, "g1")
        dead = served.pid
        _write_group(served, "g2")  # the child dies before it runs the append; the new one writes it
        assert served.pid != dead and served.restarted == 1
        served.commit_step(RUN, 1, {"solver": ["g1-0"]}, "ckpt/1")  # the new child's second call: dies, replayed
        assert served.restarted == 2
        assert served.count("samples", RUN) == 6 and served.count("segments", RUN) == 6
        assert served.latest_version(RUN) == (1, "ckpt/1") and served.count("consumptions", RUN) == 1
    finally:
        served.close()


def test_each_keyed_write_replayed_after_it_committed_writes_nothing_twice(store_paths):
    """`replay` is what a new child runs for a write whose child died during it: a write that had
    committed is not written again (and returns what it returns), one that had not is written."""
    store = SegmentStore(*store_paths)
    try:
        problems = [Problem("p1", "1+1?", "2", "t"), Problem("p2", "2+2?", "4", "t")]
        assert store.add_problems(RUN, problems[:1]) == 1
        assert store.add_problems(RUN, problems) == 1  # p1 is stored: only p2 is new
        assert store.add_problems(RUN, problems) == 0 and store.count("problems", RUN) == 2
        rejections = [Rejection("train.jsonl", "line 3", "no answer")]
        for call in (store.reject, lambda *a: store.replay("reject", a, {})):
            call(RUN, rejections)
        ids = _write_group(store, "g1")
        segments = [SegmentRow(ids[0], 1, np.arange(2), -np.ones(2), 3, "stop")]
        store.replay("append", (RUN,), {"segments": segments})  # not committed yet: written
        store.replay("append", (RUN,), {"segments": segments})  # committed: nothing
        store.replay("append", (RUN, [SampleRow(ids[0], "p1", "solver", 0, "g1", 3, [7])]), {})
        store.commit_step(RUN, 1, {"solver": ids[:2]}, "ckpt/1")
        store.replay("commit_step", (RUN, 1, {"solver": ids[:2]}, "ckpt/1"), {})
        with pytest.raises(StoreError, match="version 1 exists"):  # another commit of step 1 is refused
            store.replay("commit_step", (RUN, 1, {"solver": ids[2:]}, "ckpt/other"), {})
        with pytest.raises(StoreError, match="not one of the keyed writes"):
            store.replay("mark", (RUN, "e"), {})
        counts = {
            t: store.count(t, RUN) for t in ("problems", "rejected_inputs", "samples", "segments", "consumptions")
        }
        assert counts == {"problems": 2, "rejected_inputs": 1, "samples": 3, "segments": 4, "consumptions": 2}
        assert store.count("policy_versions", RUN) == 1
    finally:
        store.close()


def test_repeated_run_and_evaluation_records_write_nothing_twice(store_paths):
    store = SegmentStore(*store_paths)
    try:
        for _ in range(2):
            store.create_run(RUN, {"seed": 1})
            store.record_evaluation(RUN, "before", "d", {"acc": 0.5})
        store.record_evaluation(RUN, "before", "d", {"acc": 0.75})  # a different evaluation is recorded
        assert store.count("runs") == 1 and store.count("evaluations") == 2
    finally:
        store.close()


def test_threads_sharing_a_served_store_each_get_their_own_answers(served):
    def work(t: int) -> list[tuple[int, int]]:
        seen = []
        for k in range(5):
            ids = _write_group(served, f"t{t}-g{k}", size=2)
            seen.append((len(served.load_samples(RUN, ids)), served.count("samples", RUN)))
        return seen

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(work, range(4)))
    assert all(loaded == 2 and 2 <= total <= 40 for seen in results for loaded, total in seen)
    assert served.count("samples", RUN) == 40


def test_an_interrupted_call_ends_its_child_so_no_later_call_reads_its_reply(served):
    _write_group(served, "g1")
    interrupted = served.pid

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(KeyboardInterrupt):
            served.query("SELECT sum(i) AS s FROM range(100000000000) t(i)")  # minutes of work
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert not psutil.pid_exists(interrupted) or psutil.Process(interrupted).status() == psutil.STATUS_ZOMBIE
    assert served.latest_version(RUN) is None and served.count("samples", RUN) == 3
    assert served.pid != interrupted


def test_unsendable_arguments_and_calls_after_close_fail_clearly(served):
    pid = served.pid
    with pytest.raises(StoreError, match=r"mark\(\): its arguments cannot be sent"):
        served.mark(RUN, "event", detail=lambda: None)
    assert served.count("samples", RUN) == 0 and served.pid == pid  # the child serves on
    served.close()
    with pytest.raises(StoreError, match=r"count\(\) on a closed store"):
        served.count("samples", RUN)


def test_a_served_sqlite_store_keeps_its_write_ahead_log_between_calls_until_closed(store_paths):
    """DuckLake opens the SQLite catalog for each transaction; the keeper process holds it open, so the
    log is not checkpointed away and made again at every call (an in-process store shows the log gone
    between calls)."""
    catalog, data = store_paths
    wal = Path(catalog.removeprefix("sqlite:") + "-wal")
    plain = SegmentStore(catalog, data)
    plain.mark(RUN, "a")
    assert not wal.exists()
    plain.close()
    served = StoreProcess(catalog, data)
    keeper = psutil.Process(served.keeper_pid)
    for event in ("b", "c"):
        served.mark(RUN, event)
        assert wal.exists()
    assert served.events(RUN) == {"a", "b", "c"}
    served.close()
    keeper.wait(timeout=30)
    assert not wal.exists()  # the last connection closed: SQLite checkpointed and removed it


def test_a_child_and_the_catalog_keeper_whose_parent_is_killed_exit(store_paths, tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        from marsrl_core.store.process import StoreProcess
        store = StoreProcess({store_paths[0]!r}, {store_paths[1]!r})
        store.count("samples")
        print(store.pid, store.keeper_pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    children = [int(pid) for pid in parent.stdout.readline().split()]
    assert len(children) == 2 and all(psutil.pid_exists(pid) for pid in children)
    parent.kill()
    parent.wait()
    for child in children:
        try:
            psutil.Process(child).wait(timeout=30)
        except psutil.NoSuchProcess:
            pass
        assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_training_processes_serve_the_store_from_a_child_unless_configured_not_to(tmp_path):
    runtime().close()
    served = runtime().store(small_config(tmp_path / "a"))
    local = runtime().store(small_config(tmp_path / "b", **{"store.separate_process": False}))
    # each behind the memory of the samples its process stored (`store/recent.py`)
    assert isinstance(served.store, StoreProcess) and isinstance(local.store, SegmentStore)
    child = served.pid
    runtime().close()
    time.sleep(0.1)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_a_training_store_runs_duckdb_on_its_configured_threads_and_the_console_on_every_core(store_paths):
    local = SegmentStore(*store_paths, threads=1)
    served = StoreProcess(*store_paths, threads=1)
    console = SegmentStore(*store_paths, create=False, read_only=True, threads=1)
    try:
        setting = "SELECT current_setting('threads') AS n"
        assert local.query(setting).column("n")[0].as_py() == 1
        assert served.query(setting).column("n")[0].as_py() == 1  # in the child process
        assert console.query(setting).column("n")[0].as_py() == duckdb.connect().execute(setting).fetchone()[0]
    finally:
        for store in (local, served, console):
            store.close()
