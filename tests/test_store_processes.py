"""The segment store across OS processes: concurrent writers/readers, and SIGKILL mid-append."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from marsrl_core.store import SampleRow, SegmentStore
from tests.configs import assert_exactly_once

CATALOGS = ("sqlite", "postgres")  # each store test on a SQLite and a PostgreSQL catalog (conftest)

WORKERS = Path(__file__).with_name("store_workers.py")
RUN = "mp"
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WORKERS), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
    )


def test_two_processes_creating_one_new_store_at_once_both_open_it(tmp_path):
    """A split run's rollout and learner processes start together on a new store. Without the attach
    lock one of two such processes failed in 8 of 10 tries ("database is locked" while DuckLake
    initialised the catalog)."""
    for attempt in range(4):
        catalog, data = f"sqlite:{tmp_path}/new{attempt}.sqlite", str(tmp_path / f"data{attempt}")
        at = str(time.time() + 2.0)  # both past their imports, then the same moment
        openers = [_spawn("open", catalog, data, RUN, at) for _ in range(2)]
        for opener in openers:
            out, err = opener.communicate(timeout=120)
            assert opener.returncode == 0 and out.strip() == "0", f"try {attempt}: {err[-2000:]}"


@pytest.mark.parametrize("catalog_kind", ["sqlite"])
def test_two_processes_writing_at_once_take_turns_without_a_retry(store_paths):
    """DuckDB's SQLite fails a write that meets another process's write at once, and the retry runs the
    transaction again after a backoff; with the writer lock the second writer waits for the first's
    commit instead (without it, two such processes retried 2 to 12 times in 60 writes each)."""
    catalog, data = store_paths
    SegmentStore(catalog, data).close()
    at = str(time.time() + 2.0)
    markers = [_spawn("marker", catalog, data, RUN, at, "40") for _ in range(2)]
    for marker in markers:
        out, err = marker.communicate(timeout=180)
        assert marker.returncode == 0, err[-2000:]
        assert json.loads(out.strip().splitlines()[-1]) == {"lock_retries": 0}
    assert len(SegmentStore(catalog, data).events(RUN, "m")) == 80


@pytest.mark.slow
def test_writer_and_reader_processes_for_15s(store_paths):
    catalog, data = store_paths
    SegmentStore(catalog, data).close()
    writer = _spawn("writer", catalog, data, RUN, "16")
    reader = _spawn("reader", catalog, data, RUN, "16")
    w_out, w_err = writer.communicate(timeout=180)
    r_out, r_err = reader.communicate(timeout=180)
    assert writer.returncode == 0, w_err[-2000:]
    assert reader.returncode == 0, r_err[-2000:]
    written = json.loads(w_out.strip().splitlines()[-1])
    read = json.loads(r_out.strip().splitlines()[-1])
    store = SegmentStore(catalog, data)
    # Counts reconcile exactly: every append the writer saw succeed is there, nothing extra.
    assert store.count("segments", RUN) == written["segments"] > 0
    assert store.count("samples", RUN) == written["segments"]
    assert store.count("consumptions", RUN) == read["consumed"] > 0
    assert_exactly_once(store, RUN)
    assert store.latest_version(RUN)[0] == read["steps"]
    print(f"writer lock retries {written['lock_retries']}, reader lock retries {read['lock_retries']}")


@pytest.mark.slow
def test_sigkill_mid_append_leaves_whole_batches(store_paths):
    catalog, data = store_paths
    SegmentStore(catalog, data).close()
    rng = random.Random(5)
    for _ in range(3):
        proc = _spawn("killme", catalog, data, RUN)
        started = 0
        for line in proc.stdout:  # let it finish a batch or two, then kill during one
            if line.startswith("begin"):
                started += 1
                if started >= 2:
                    time.sleep(rng.uniform(0.0, 0.4))
                    break
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    store = SegmentStore(catalog, data)
    per_batch = store.query("""SELECT split_part(sample_id, '-', 1) AS batch, count(*) AS n
                               FROM segments GROUP BY 1""").to_pylist()
    assert per_batch, "no batch ever committed"
    assert all(row["n"] == 200 for row in per_batch), per_batch  # 50 groups x 4: whole or absent
    # The store still opens and accepts writes.
    store.append("after", samples=[SampleRow("x", "p", "solver", 0, "gx", 1, [1])])
    assert store.count("samples", "after") == 1


@pytest.mark.slow
def test_compaction_while_a_writer_and_a_reader_process_run_loses_nothing(store_paths):
    """The learner flow compacts the store while rollouts write and users read: a writer and a reader
    process run while this process compacts again and again (with a retention, as the learner does).
    DuckLake reports some of the conflicts as an aborted transaction, which compaction retries."""
    catalog, data = store_paths
    SegmentStore(catalog, data).close()
    writer = _spawn("writer", catalog, data, RUN, "20")
    reader = _spawn("reader", catalog, data, RUN, "20")
    maintainer = SegmentStore(catalog, data, create=False)
    compactions = []
    while writer.poll() is None or reader.poll() is None or len(compactions) < 3:
        compactions.append(maintainer.compact(retention_s=60))  # raises on any error that is not retried
    w_out, w_err = writer.communicate(timeout=180)
    r_out, r_err = reader.communicate(timeout=180)
    assert writer.returncode == 0, w_err[-2000:]
    assert reader.returncode == 0, r_err[-2000:]
    merges = (
        maintainer.query(
            "SELECT count(*) AS n FROM ducklake_snapshots('lake') "
            "WHERE list_contains(map_keys(changes), 'merge_adjacent')"
        )
        .column("n")[0]
        .as_py()
    )
    assert merges >= 1  # files were merged while the others wrote and read
    written = json.loads(w_out.strip().splitlines()[-1])
    read = json.loads(r_out.strip().splitlines()[-1])
    store = SegmentStore(catalog, data)
    assert store.count("segments", RUN) == store.count("samples", RUN) == written["segments"] > 0
    assert store.count("consumptions", RUN) == read["consumed"] > 0
    assert store.latest_version(RUN)[0] == read["steps"]
    # With the writer and reader gone, compaction leaves only the files the catalog knows: none that a
    # failed (retried) merge wrote and no commit referenced.
    maintainer.compact(retention_s=0)
    assert len(list(Path(data).rglob("*.parquet"))) == maintainer.data_file_count()
    assert store.count("segments", RUN) == written["segments"]


@pytest.mark.slow
def test_a_reader_beside_compaction_never_misses_a_stored_row(store_paths):
    """A rollout stage writes a few rows at a time while the learner process compacts: a reader in a
    third process must see every row it has seen before, always. DuckLake 1.5.5 loses rows to readers
    for a moment while `ducklake_flush_inlined_data` moves rows inlined in the catalog into Parquet;
    a rollout turn that resumed in that moment missed a finished segment and decoded it again (a
    two-rank learner's run stored 8 segments and their rewards twice). The store inlines nothing."""
    catalog, data = store_paths
    SegmentStore(catalog, data).close()
    stager = _spawn("stager", catalog, data, RUN, "15")
    counter = _spawn("counter", catalog, data, RUN, "15")
    maintainer = SegmentStore(catalog, data, create=False)
    compactions = 0
    while stager.poll() is None or counter.poll() is None:
        maintainer.compact(retention_s=60)
        compactions += 1
    s_out, s_err = stager.communicate(timeout=60)
    c_out, c_err = counter.communicate(timeout=60)
    assert stager.returncode == 0 and counter.returncode == 0, s_err[-2000:] + c_err[-2000:]
    stages = json.loads(s_out.strip().splitlines()[-1])["stages"]
    counted = json.loads(c_out.strip().splitlines()[-1])
    assert stages > 20 and counted["reads"] > 100 and compactions > 5, (stages, counted["reads"], compactions)
    assert counted["decreases"] == [], counted["decreases"][:5]
    assert maintainer.count("segments", RUN) == maintainer.count("rewards", RUN) == stages
