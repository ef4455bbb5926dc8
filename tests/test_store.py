"""The segment store in one process: round trips, views, exactly-once commits, bad input."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from marsrl_core.store import DROPPED_STALE, RewardRow, SampleRow, SegmentRow, SegmentStore, StoreError

# Each store test on a SQLite and a PostgreSQL catalog, and on Postgres with its data on S3 (conftest).
CATALOGS = ("sqlite", "postgres", "postgres+s3")

RUN = "run-1"


def _group(store, group_id, size=2, agent="solver", turn=0, parent=None):
    rows = [SampleRow(f"{group_id}-{i}", "p1", agent, turn, group_id, size, [7, 8, 9], parent) for i in range(size)]
    store.append(RUN, samples=rows)
    return [r.sample_id for r in rows]


def _finish(store, sample_ids, reward=1.0):
    store.append(
        RUN,
        segments=[SegmentRow(s, 0, [1], [-0.5], 0, "stop") for s in sample_ids],
        rewards=[RewardRow(s, reward, bool(reward)) for s in sample_ids],
    )


def test_segments_reassemble_tokens_logprobs_and_versions(store):
    (sid, _) = _group(store, "g")
    store.append(RUN, segments=[SegmentRow(sid, 0, [4, 5], [-0.1, -0.2], 0, "length")])
    store.append(
        RUN,
        segments=[SegmentRow(sid, 1, np.array([6], np.int64), np.array([-0.3]), 1, "stop")],
        rewards=[RewardRow(sid, 1.0, True, "ok", "42")],
    )
    got = store.load_samples(RUN, [sid])[sid]
    assert got.prompt_tokens.tolist() == [7, 8, 9]
    assert got.token_ids.tolist() == [4, 5, 6]
    assert np.allclose(got.logprobs, [-0.1, -0.2, -0.3])
    assert got.versions.tolist() == [0, 0, 1]
    assert got.finish_reason == "stop" and got.reward == 1.0 and got.parsed == "42"


def test_group_is_trainable_only_when_every_member_is_rewarded(store):
    a, b = _group(store, "g")
    _finish(store, [a])
    assert store.trainable_groups(RUN, "solver") == []
    _finish(store, [b], reward=0.0)
    groups = store.trainable_groups(RUN, "solver")
    assert [(g.group_id, g.sample_ids) for g in groups] == [("g", [a, b])]
    assert store.trainable_groups(RUN, "verifier") == []
    inflight = store.query("SELECT count(*) AS n FROM in_flight_decodes").column("n")[0].as_py()
    assert inflight == 0


def test_exactly_once_commit(store):
    ids = _group(store, "g1") + _group(store, "g2")
    _finish(store, ids)
    store.commit_step(RUN, 1, {"solver": ids[:2]}, "ckpt/1", metrics={"solver": {"loss": 0.5}})
    # The consumed group is never listed again; the other one still is.
    assert [g.group_id for g in store.trainable_groups(RUN, "solver")] == ["g2"]
    assert store.latest_version(RUN) == (1, "ckpt/1")
    # Consuming a committed sample again writes nothing at all (not even the version row).
    with pytest.raises(StoreError, match="already consumed"):
        store.commit_step(RUN, 2, {"solver": ids[1:3]}, "ckpt/2")
    assert store.latest_version(RUN) == (1, "ckpt/1")
    assert store.count("consumptions", RUN) == 2
    # A step that "crashed" before commit_step leaves its samples trainable: nothing records them.
    assert store.trainable_groups(RUN, "solver")[0].sample_ids == ids[2:]
    # Step 1 trained policy version 0 on tokens from version 0: no staleness.
    stale = store.query("SELECT staleness FROM staleness ORDER BY sample_id").column("staleness").to_pylist()
    assert stale == [0, 0]


def test_groups_of_several_agents_in_one_query_match_one_agent_at_a_time(store):
    for k in range(3):
        _finish(store, _group(store, f"s{k}"))
    _finish(store, _group(store, "v0", agent="verifier", turn=1))
    _group(store, "v1", agent="verifier", turn=1)  # not rewarded: not trainable
    store.commit_step(RUN, 1, {"solver": [f"s0-{i}" for i in range(2)]}, "ckpt/1")
    both = store.trainable_groups_by_agent(RUN, ["solver", "verifier", "corrector"], limit=1)
    assert {a: [g.group_id for g in gs] for a, gs in both.items()} == {
        "solver": ["s1"],
        "verifier": ["v0"],
        "corrector": [],
    }
    unlimited = store.trainable_groups_by_agent(RUN, ["solver", "verifier"])
    for agent in ("solver", "verifier"):
        assert [(g.group_id, g.sample_ids) for g in unlimited[agent]] == [
            (g.group_id, g.sample_ids) for g in store.trainable_groups(RUN, agent)
        ]
    assert [g.group_id for g in unlimited["solver"]] == ["s1", "s2"]


def test_a_step_takes_the_group_that_started_under_the_oldest_version_first(store):
    """A group that started under an older policy but finished last comes before the ones that finished
    first: taking groups by completion, it could wait until it ages past the learner's bound."""
    young, old = _group(store, "young"), _group(store, "old")
    store.append(
        RUN,
        segments=[SegmentRow(s, 0, [1], [-0.5], 3, "stop") for s in young],
        rewards=[RewardRow(s, 1.0, True) for s in young],
    )
    store.append(
        RUN,
        segments=[SegmentRow(s, 0, [1], [-0.5], 1, "stop") for s in old],
        rewards=[RewardRow(s, 1.0, True) for s in old],
    )
    assert [g.group_id for g in store.trainable_groups(RUN, "solver")] == ["old", "young"]
    assert [g.group_id for g in store.trainable_groups_by_agent(RUN, ["solver"], limit=1)["solver"]] == ["old"]


def test_stale_groups_are_flagged_outside_the_limit_and_dropped_ones_never_come_back(store):
    old, fresh, newer = _group(store, "old"), _group(store, "fresh"), _group(store, "newer")
    store.append(
        RUN,
        segments=[
            SegmentRow(old[0], 0, [1], [-0.5], 1, "length"),  # oldest token: version 1
            SegmentRow(old[0], 1, [1], [-0.5], 4, "stop"),
            SegmentRow(old[1], 0, [1], [-0.5], 4, "stop"),
        ],
        rewards=[RewardRow(s, 1.0, True) for s in old],
    )
    for ids in (fresh, newer):
        store.append(
            RUN,
            segments=[SegmentRow(s, 0, [1], [-0.5], 3, "stop") for s in ids],
            rewards=[RewardRow(s, 1.0, True) for s in ids],
        )
    listed = store.trainable_groups_by_agent(RUN, ["solver"], limit=1, min_version=2)["solver"]
    # The stale group does not take the one fresh slot; it comes along flagged, with its oldest version.
    assert [(g.group_id, g.stale, g.oldest_version) for g in listed] == [("fresh", False, 3), ("old", True, 1)]
    assert [g.stale for g in store.trainable_groups(RUN, "solver")] == [False] * 3  # no bound: none stale
    store.commit_step(RUN, 5, {"solver": fresh}, "ckpt/5", dropped={"solver": old})
    assert [g.group_id for g in store.trainable_groups(RUN, "solver")] == ["newer"]
    steps = store.query("SELECT sample_id, learner_step FROM consumptions ORDER BY sample_id").to_pylist()
    assert steps == [{"sample_id": s, "learner_step": 5} for s in fresh] + [
        {"sample_id": s, "learner_step": DROPPED_STALE} for s in old
    ]
    # The staleness view describes trained samples only.
    assert store.query("SELECT sample_id FROM staleness ORDER BY 1").column("sample_id").to_pylist() == fresh


def test_the_polls_follow_every_connections_commits_from_one_read_of_the_run(store, store_paths):
    """The learner's poll, the newest version and the group counts come from the run's index: read
    once, then kept by this connection's commits and by what another connection (process) committed."""
    other = SegmentStore(*store_paths)
    try:
        a = _group(store, "g1")
        _finish(store, a)
        first = store.trainable_groups_by_agent(RUN, ["solver"], limit=4)
        assert store.latest_version(RUN) is None and store.group_counts(RUN)["solver"]["started"] == 1
        assert [g.group_id for g in first["solver"]] == ["g1"] and store.indexes.loads == 1

        b = _group(other, "g2")  # another connection's commits
        _finish(other, b)
        other.commit_step(RUN, 1, {"solver": a}, "ckpt-1")
        assert [g.group_id for g in store.trainable_groups_by_agent(RUN, ["solver"], limit=4)["solver"]] == ["g2"]
        assert store.latest_version(RUN) == (1, "ckpt-1")
        assert store.group_counts(RUN)["solver"] == {"started": 2, "consumed": 1}
        assert store.indexes.caught_up == 1
        store.commit_step(RUN, 2, {"solver": b}, "ckpt-2")  # ids the poll returned: known without a read
        assert store.trainable_groups_by_agent(RUN, ["solver"], limit=4) == {"solver": []}
        assert store.latest_version(RUN) == (2, "ckpt-2")
        assert (store.indexes.loads, store.indexes.caught_up) == (1, 1)  # its own commit: no read
    finally:
        other.close()


def test_the_group_limit_can_differ_per_agent(store):
    for i in range(3):
        _finish(store, _group(store, f"s{i}"))
        _finish(store, _group(store, f"v{i}", agent="verifier", turn=1))
    listed = store.trainable_groups_by_agent(RUN, ["solver", "verifier"], limit={"solver": 1, "verifier": 2})
    assert {agent: [g.group_id for g in groups] for agent, groups in listed.items()} == {
        "solver": ["s0"],
        "verifier": ["v0", "v1"],
    }  # oldest first, each agent to its own limit
    assert [len(g) for g in store.trainable_groups_by_agent(RUN, ["solver", "verifier"], limit=2).values()] == [2, 2]


def test_reads_of_a_batch_are_filtered_to_its_problems(store):
    store.add_problems(
        RUN, [type("P", (), dict(problem_id=p, prompt="q", answer="1", source="t"))() for p in ("a", "b")]
    )
    store.append(
        RUN,
        samples=[
            SampleRow("x", "a", "solver", 0, "gx", 1, [1]),
            SampleRow("y", "b", "solver", 0, "gy", 1, [1]),
            SampleRow("z", "b", "verifier", 1, "gz", 1, [1], "y"),
        ],
    )
    _finish(store, ["y"])
    rows = store.samples_of_problems(RUN, ["b"])
    assert [(r["sample_id"], r["turn"], r["parent_sample_id"], r["rewarded"]) for r in rows] == [
        ("y", 0, None, True),
        ("z", 1, "y", False),
    ]
    assert store.samples_of_problems("another-run", ["b"]) == []


def test_views_answer_the_users_questions(store):
    ids = _group(store, "g")
    _finish(store, ids)
    store.commit_step(RUN, 1, {"solver": ids}, "ckpt/1")
    per_agent = store.query("SELECT agent, mean_reward, samples FROM rewards_per_agent").to_pylist()
    assert per_agent == [{"agent": "solver", "mean_reward": 1.0, "samples": 2}]
    latency = store.query("SELECT latency_s FROM pipeline_latency").column("latency_s").to_pylist()
    assert len(latency) == 2 and all(x >= 0 for x in latency)


@pytest.mark.parametrize(
    "segment, message",
    [
        (SegmentRow("g-0", 0, [1, 2], [-0.1], 0, "stop"), "token_ids has 2 entries but logprobs has 1"),
        (SegmentRow("nope", 0, [1], [-0.1], 0, "stop"), "unknown sample id"),
        (SegmentRow("g-0", 0, [1.5], [-0.1], 0, "stop"), "token_ids: expected integer"),
        (SegmentRow("g-0", 0, [1], ["x"], 0, "stop"), "logprobs: expected float"),
        (SegmentRow("g-0", 0, [1], [float("nan")], 0, "stop"), "finite"),
        (SegmentRow("g-0", 0, [1], [-0.1], 0, "maybe"), "finish_reason='maybe'"),
    ],
)
def test_bad_segments_are_rejected_whole(store, segment, message):
    _group(store, "g")
    good = SegmentRow("g-1", 0, [3], [-0.2], 0, "stop")
    with pytest.raises(StoreError, match=message):
        store.append(RUN, segments=[good, segment])
    assert store.count("segments") == 0  # the good row of the batch was not written either


def test_bad_reward_and_unknown_consumption(store):
    _group(store, "g")
    with pytest.raises(StoreError, match=r"rewards\[0\].reward"):
        store.append(RUN, rewards=[RewardRow("g-0", float("inf"))])
    with pytest.raises(StoreError, match="unknown sample id"):
        store.commit_step(RUN, 1, {"solver": ["ghost"]}, "ckpt/1")
    assert store.count("rewards") == 0 and store.latest_version(RUN) is None


def test_unwritable_catalog_path_is_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(StoreError, match="not writable"):
        SegmentStore(f"sqlite:{blocker}/lake.sqlite", str(tmp_path / "data"))
    with pytest.raises(StoreError, match="catalog_url='mysql:x'"):
        SegmentStore("mysql:x", str(tmp_path / "data"))
    with pytest.raises(StoreError, match="no such store"):
        SegmentStore(f"sqlite:{tmp_path}/absent.sqlite", str(tmp_path / "data"), create=False)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads this process's open files from /proc")
def test_a_sqlite_catalog_runs_in_wal_mode_with_no_connection_left_on_a_deleted_wal(tmp_path):
    """Python's sqlite3 and DuckDB's SQLite extension are two SQLite copies in one process: a copy that
    closes the catalog deletes the WAL under the other's open connection, which can later write stale
    pages back. Two stores opened in one process, both writing, leave no handle on a deleted WAL file."""
    catalog = tmp_path / "lake.sqlite"
    first = SegmentStore(f"sqlite:{catalog}", str(tmp_path / "data"))
    first.create_run(RUN, {})
    _finish(first, _group(first, "g1"))
    second = SegmentStore(f"sqlite:{catalog}", str(tmp_path / "data"), create=False)
    _finish(second, _group(second, "g2"))
    assert {g.group_id for g in first.trainable_groups(RUN, "solver")} == {"g1", "g2"}

    assert catalog.read_bytes()[18:20] == b"\x02\x02"  # the header's write and read versions: WAL
    links = []
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            links.append(os.readlink(fd))
    assert [link for link in links if link.startswith(str(catalog)) and link.endswith("(deleted)")] == []
    first.close()
    second.close()
    with contextlib.closing(sqlite3.connect(catalog)) as db:
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]


def test_rows_survive_reopen_and_compaction(store_paths):
    catalog, data = store_paths
    first = SegmentStore(catalog, data)
    for g in range(5):  # batches over the inlining limit make real Parquet files
        rows = [SampleRow(f"g{g}-{i}", "p", "solver", 0, f"g{g}", 20, [1]) for i in range(20)]
        first.append(
            RUN, samples=rows, segments=[SegmentRow(r.sample_id, 0, [1, 2], [-1.0, -1.0], 0, "stop") for r in rows]
        )
    first.close()
    second = SegmentStore(catalog, data, create=False)
    result = second.compact()
    assert result["files_after"] < result["files_before"]
    assert second.count("segments", RUN) == 100
    assert second.load_samples(RUN, ["g3-7"])["g3-7"].token_ids.tolist() == [1, 2]


def _parquet_files(data) -> set[str]:
    """The data path's Parquet files: a folder's, or an S3 prefix's objects."""
    from pathlib import Path

    if data.startswith("s3://"):
        import os

        import boto3

        bucket, _, prefix = data[len("s3://") :].partition("/")
        s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return {
            f"s3://{bucket}/{o['Key']}"
            for page in pages
            for o in page.get("Contents", [])
            if o["Key"].endswith(".parquet")
        }
    return {str(p) for p in Path(data).rglob("*.parquet")}


def test_compaction_keeps_replaced_files_for_the_retention_then_deletes_them(store_paths):
    import time

    catalog, data = store_paths
    store = SegmentStore(catalog, data)

    def append_four(tag):  # batches over the inlining limit make real Parquet files
        for g in range(4):
            store.append(
                RUN, samples=[SampleRow(f"{tag}{g}-{i}", "p", "solver", 0, f"{tag}{g}", 20, [1]) for i in range(20)]
            )

    append_four("a")
    first = _parquet_files(data)
    before = store.query("SELECT max(snapshot_id) AS s FROM ducklake_snapshots('lake')").column("s")[0].as_py()
    result = store.compact(retention_s=3600)
    assert result["files_after"] < result["files_before"] and result["files_deleted"] == 0
    # A query planned before the merge still finds every file it listed, and the old snapshot reads.
    assert first <= _parquet_files(data)
    assert store.query(f"SELECT count(*) AS n FROM samples AT (VERSION => {before})").column("n")[0].as_py() == 80

    time.sleep(1.5)
    append_four("b")
    second = _parquet_files(data) - first
    result = store.compact(retention_s=1.0)  # the first merge's replaced files are old enough, not this one's
    if data.startswith("s3://"):  # remote data: kept until the day before the horizon (store/compaction.py)
        assert result["files_deleted"] == 0 and first <= _parquet_files(data)
    else:
        assert result["files_deleted"] == len(first)
        assert not first & _parquet_files(data) and second <= _parquet_files(data)

    store.compact(retention_s=0)  # nothing else reads: every replaced file goes
    assert not (first | second) & _parquet_files(data)
    assert store.count("samples", RUN) == 160 and len(_parquet_files(data)) == store.data_file_count()


@pytest.mark.parametrize("catalog_kind", ["sqlite", "postgres"])  # it ages files on disk (os.utime)
def test_compaction_deletes_files_no_commit_referenced_once_they_are_old(store_paths):
    """A merge whose commit failed leaves its output behind; compaction deletes such orphans past the
    retention and keeps younger ones (a writer's file is unknown until it commits)."""
    import os
    import shutil
    import time
    from pathlib import Path

    catalog, data = store_paths
    store = SegmentStore(catalog, data)
    for g in range(3):
        store.append(RUN, samples=[SampleRow(f"g{g}-{i}", "p", "solver", 0, f"g{g}", 20, [1]) for i in range(20)])
    live = Path(sorted(_parquet_files(data))[0])
    old, young = live.parent / "ducklake-orphan-old.parquet", live.parent / "ducklake-orphan-young.parquet"
    shutil.copy(live, old)
    shutil.copy(live, young)
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    result = store.compact(retention_s=600)
    assert result["orphans_deleted"] == 1 and not old.exists() and young.exists()
    assert store.count("samples", RUN) == 60  # the live files (merged or not) are untouched
    store.compact(retention_s=0)  # nothing else writes: every unknown file goes
    assert not young.exists() and len(_parquet_files(data)) == store.data_file_count()
    assert store.count("samples", RUN) == 60


def test_sample_ids_are_known_per_run(store):
    ids = _group(store, "g")
    with pytest.raises(StoreError, match="unknown sample id.*'other-run'"):
        store.append("other-run", segments=[SegmentRow(ids[0], 0, [1], [-0.1], 0, "stop")])


def test_an_append_whose_keys_are_stored_writes_nothing_and_says_so(store):
    run = "keyed"
    store.create_run(run, {})
    first = store.append(
        run,
        [SampleRow("s1", "p", "verifier", 1, "g", 2, [1]), SampleRow("s2", "p", "verifier", 1, "g", 2, [1])],
        [SegmentRow("s1", 0, [3, 4], [-0.1, -0.2], 0, "length"), SegmentRow("s2", 0, [5], [-0.3], 0, "stop")],
        [RewardRow("s2", 1.0)],
    )
    assert first.written and first.already_stored == {}
    counts = {table: store.count(table, run) for table in ("samples", "segments", "rewards")}
    again = store.append(run, [], [SegmentRow("s1", 0, [3, 4], [-0.1, -0.2], 1, "length")])
    assert not again.written and again.already_stored == {"segments": ["s1#0"]}
    # A stage mixing new rows with stored ones writes none of them: its state was behind the store.
    mixed = store.append(
        run,
        [SampleRow("s3", "p", "corrector", 2, "g3", 1, [1])],
        [SegmentRow("s1", 1, [6], [-0.4], 1, "stop"), SegmentRow("s2", 0, [5], [-0.3], 1, "stop")],
        [RewardRow("s1", 0.0), RewardRow("s2", 1.0)],
    )
    assert not mixed.written
    assert mixed.already_stored == {"segments": ["s2#0"], "rewards": ["s2"]}
    assert "segments s2#0; rewards s2" == mixed.describe()
    assert {table: store.count(table, run) for table in counts} == counts
    assert not store.append(run, [SampleRow("s1", "p", "verifier", 1, "g", 2, [1])]).written
    with pytest.raises(StoreError, match="segments key.*given twice in one call: s1#1"):
        store.append(run, [], [SegmentRow("s1", 1, [6], [-0.4], 1, "stop")] * 2)
    # The rows that were not stored yet go in once the stage is decoded afresh.
    assert store.append(run, [], [SegmentRow("s1", 1, [6], [-0.4], 1, "stop")], [RewardRow("s1", 0.0)]).written
    assert store.invariants(run) == dict.fromkeys(store.invariants(run), 0)
    assert store.count("segments", run) == 3 and store.count("rewards", run) == 2


def test_an_event_is_recorded_once_per_detail(store):
    """Two tasks that see the same divergence record it once; another detail is another row."""
    store.create_run("ev", {})
    for _ in range(2):
        store.mark("ev", "diverged", "rollout: NaN")
    store.mark("ev", "diverged", "learner step 2: inf")
    assert sorted(store.event_details("ev", "diverged")) == ["learner step 2: inf", "rollout: NaN"]
