"""The polled reads answered from a run's index equal the SQL's answers, whoever committed what.

The SQL below is the specification: what the learner's poll, the admission gate's counts and the
newest version mean, over the store's tables. A seeded sequence of appends and commits, by the store's
own connection and by a second one (another process's view), with rollbacks and compactions between,
is checked after every write against it.
"""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

from marsrl_core.store import CATALOG, RewardRow, SampleRow, SegmentRow, SegmentStore, StoreError
from marsrl_core.store.rows import key_table

CATALOGS = ("sqlite", "postgres")
RUN = "run-1"
AGENTS = ["corrector", "solver", "verifier"]

TRAINABLE_SQL = f"""
    WITH members AS (
        SELECT s.agent, s.group_id, s.sample_id, s.group_size, r.created_at AS done_at
        FROM {CATALOG}.samples s JOIN _agents USING (agent)
        LEFT JOIN (SELECT sample_id, min(created_at) AS created_at FROM {CATALOG}.rewards
                   WHERE run_id = $1 GROUP BY sample_id) r USING (sample_id)
        WHERE s.run_id = $1),
    consumed AS (SELECT DISTINCT sample_id FROM {CATALOG}.consumptions c JOIN _agents USING (agent)
                 WHERE c.run_id = $1),
    complete AS (
        SELECT agent, group_id, list(sample_id ORDER BY sample_id) AS sample_ids, max(done_at) AS completed_at
        FROM members GROUP BY agent, group_id
        HAVING count(done_at) = any_value(group_size)
           AND count(*) FILTER (WHERE sample_id IN (SELECT sample_id FROM consumed)) = 0),
    versions AS (
        SELECT c.agent, c.group_id, min(g.policy_version) AS oldest_version
        FROM (SELECT agent, group_id, unnest(sample_ids) AS sample_id FROM complete) c
        JOIN {CATALOG}.segments g ON g.run_id = $1 AND g.sample_id = c.sample_id
        GROUP BY c.agent, c.group_id),
    flagged AS (
        SELECT complete.*, coalesce(v.oldest_version, 0) AS oldest_version,
               coalesce(v.oldest_version, 0) < $2 AS stale
        FROM complete LEFT JOIN versions v USING (agent, group_id))
    SELECT agent, group_id, sample_ids, oldest_version, stale FROM (
        SELECT *, row_number() OVER (
            PARTITION BY agent, stale ORDER BY oldest_version, completed_at, group_id) AS position
        FROM flagged) JOIN _agents USING (agent)
    WHERE max_groups IS NULL OR stale OR position <= max_groups OR oldest_version = $2
    ORDER BY agent, stale, position"""

COUNTS_SQL = f"""
    SELECT s.agent, count(DISTINCT s.group_id) AS started,
           count(DISTINCT s.group_id) FILTER (WHERE c.sample_id IS NOT NULL) AS consumed
    FROM {CATALOG}.samples s
    LEFT JOIN {CATALOG}.consumptions c ON c.run_id = s.run_id AND c.sample_id = s.sample_id
    WHERE s.run_id = ? GROUP BY s.agent"""

LATEST_SQL = (
    f"SELECT version, checkpoint_uri FROM {CATALOG}.policy_versions WHERE run_id = ? ORDER BY version DESC LIMIT 1"
)


def expected(store, limit, floor):
    agents = key_table("agent", AGENTS).append_column("max_groups", pa.array([limit] * len(AGENTS), pa.int64()))
    rows = store._read(TRAINABLE_SQL, [RUN, floor], {"_agents": agents}).to_pylist()
    trainable = {
        a: [(r["group_id"], r["sample_ids"], r["oldest_version"], r["stale"]) for r in rows if r["agent"] == a]
        for a in AGENTS
    }
    counts = {
        r["agent"]: {"started": r["started"], "consumed": r["consumed"]}
        for r in store._read(COUNTS_SQL, [RUN]).to_pylist()
    }
    latest = store._read(LATEST_SQL, [RUN]).to_pylist()
    return trainable, counts, (latest[0]["version"], latest[0]["checkpoint_uri"]) if latest else None


def answered(store, limit, floor):
    found = store.trainable_groups_by_agent(RUN, AGENTS, limit, None if floor < 0 else floor)
    trainable = {a: [(g.group_id, g.sample_ids, g.oldest_version, g.stale) for g in found[a]] for a in AGENTS}
    return trainable, store.group_counts(RUN), store.latest_version(RUN)


def test_the_polls_match_the_sql_through_every_kind_of_commit(store, store_paths):
    other = SegmentStore(*store_paths)  # another connection: its commits are someone else's to `store`
    rng = random.Random(3)
    groups: list[tuple[str, str, int, list[str]]] = []  # (agent, group id, size, sample ids stored)
    unfinished: dict[str, int] = {}  # sample id -> segments stored
    version = keys_answered = 0
    try:
        other.create_run("other-run", {})
        for step in range(90):
            writer = store if rng.random() < 0.7 else other
            action = rng.random()
            if action < 0.35:  # a new group: some of its samples now, the rest later or never
                agent, group_id = rng.choice(AGENTS), f"g{step}"
                size = rng.choice([1, 2, 3])
                ids = [f"{group_id}-{i}" for i in range(size)]
                shown = ids[: rng.randint(1, size)]
                writer.append(RUN, [SampleRow(s, "p", agent, 0, group_id, size, [1]) for s in shown])
                groups.append((agent, group_id, size, shown))
                unfinished.update({s: 0 for s in shown})
            elif action < 0.65 and unfinished:  # a stage: segments for some, rewards for some of them
                chosen = rng.sample(sorted(unfinished), min(len(unfinished), rng.randint(1, 4)))
                segments = [
                    SegmentRow(s, unfinished[s], [1], [-0.1], rng.randint(max(0, version - 3), version), "length")
                    for s in chosen
                ]
                done = [s for s in chosen if rng.random() < 0.6]
                writer.append(RUN, segments=segments, rewards=[RewardRow(s, 1.0) for s in done])
                for s in chosen:
                    unfinished[s] += 1
                for s in done:
                    del unfinished[s]
            elif action < 0.7:  # the next sample of a group shown in part
                partial = [g for g in groups if len(g[3]) < g[2]]
                if partial:
                    agent, group_id, size, ids = rng.choice(partial)
                    new = f"{group_id}-{len(ids)}"
                    writer.append(RUN, [SampleRow(new, "p", agent, 0, group_id, size, [1])])
                    ids.append(new)
                    unfinished[new] = 0
            elif action < 0.88:  # a learner step takes what the poll offers (or drops it as stale)
                offered = store.trainable_groups_by_agent(RUN, AGENTS, 2, max(0, version - 2))
                version += 1
                consumed = {a: [s for g in gs if not g.stale for s in g.sample_ids] for a, gs in offered.items()}
                dropped = {a: [s for g in gs if g.stale for s in g.sample_ids] for a, gs in offered.items()}
                writer.commit_step(RUN, version, consumed, f"ckpt-{version}", dropped=dropped)
            elif action < 0.93 and version > 1:  # a resume rolls the newest steps back
                version = rng.randint(0, version - 1)
                writer.rollback_to(RUN, version)
            elif action < 0.96:
                writer.compact(retention_s=rng.choice([0, 600]))  # the second keeps every snapshot
            else:  # another run's rows change nothing of this run
                writer.mark("other-run", "started", str(step))
            for limit, floor in ((2, max(0, version - 2)), (1, version), (None, -1)):
                assert answered(store, limit, floor) == expected(store, limit, floor), f"step {step}"
            keys = {  # what an append's check asks: some keys stored, some not
                "samples": [f"g{rng.randrange(step + 1)}-{rng.randrange(3)}" for _ in range(4)],
                "segments": [f"g{rng.randrange(step + 1)}-{rng.randrange(3)}#{rng.randrange(3)}" for _ in range(4)],
                "rewards": [f"g{rng.randrange(step + 1)}-{rng.randrange(3)}" for _ in range(4)],
            }
            keys = {table: sorted(set(values)) for table, values in keys.items()}
            with store._using():  # the index answers, or leaves it to the SQL (a consumed group's keys)
                answer = store._index(RUN).stored_keys(keys)
                assert answer in (None, store._stored_keys(store._con, RUN, keys)), f"step {step}"
                keys_answered += answer is not None
        assert store.indexes.caught_up > 0 and store.indexes.loads > 1  # both ways of following others ran
        assert keys_answered > 10
        assert store.count("consumptions", RUN) > 0
    finally:
        other.close()


def test_a_commit_that_raced_another_connections_is_read_back_not_applied(store, store_paths):
    """Another connection commits between this one's first look at the lake and its own commit: the
    index must not take its own rows alone for the lake's state, and reads both back."""
    other = SegmentStore(*store_paths)
    real_snapshot, raced = store._lake_snapshot, []

    def racing() -> int:
        snapshot = real_snapshot()
        if not raced:  # the look before the commit begins: the other connection commits now
            raced.append(other.append(RUN, [SampleRow("b-0", "p", "solver", 0, "b", 1, [1])]))
        return snapshot

    try:
        store.append(RUN, [SampleRow("a-0", "p", "solver", 0, "a", 1, [1])])
        assert store.group_counts(RUN) == {"solver": {"started": 1, "consumed": 0}}  # the index is loaded
        store._lake_snapshot = racing
        store.append(RUN, [SampleRow("c-0", "p", "verifier", 1, "c", 1, [1])])
        del store._lake_snapshot
        assert raced and store.group_counts(RUN) == {
            "solver": {"started": 2, "consumed": 0},
            "verifier": {"started": 1, "consumed": 0},
        }
    finally:
        other.close()


def test_a_write_checked_against_the_index_refuses_what_is_stored(store, store_paths):
    """An append's stored keys and a step's consumed samples, checked in memory once the index holds the
    transaction's snapshot: what this connection or another one stored is refused, nothing written."""
    other = SegmentStore(*store_paths)
    try:
        rows = [SampleRow("a-0", "p", "solver", 0, "a", 1, [1])]
        store.append(RUN, rows, [SegmentRow("a-0", 0, [1], [-0.1], 0, "length")])
        store.group_counts(RUN)  # the index is loaded
        again = store.append(RUN, rows, [SegmentRow("a-0", 0, [1], [-0.1], 0, "length")])
        assert not again.written and again.already_stored == {"samples": ["a-0"], "segments": ["a-0#0"]}
        other.append(RUN, segments=[SegmentRow("a-0", 1, [1], [-0.1], 0, "stop")], rewards=[RewardRow("a-0", 1.0)])
        again = store.append(RUN, segments=[SegmentRow("a-0", 1, [1], [-0.1], 0, "stop")])
        assert not again.written and again.already_stored == {"segments": ["a-0#1"]}
        other.commit_step(RUN, 1, {"solver": ["a-0"]}, "ckpt-1")
        with pytest.raises(StoreError, match="1 samples already consumed, version 1 exists"):
            store.commit_step(RUN, 1, {"solver": ["a-0"]}, "ckpt-1")
        assert store.count("segments", RUN) == 2 and store.count("consumptions", RUN) == 1
        assert store.indexes.checked == 3 and store.indexes.loads == 1  # every check above asked the index
    finally:
        other.close()


def test_another_connections_rollback_and_merge_reach_the_index(store, store_paths):
    """A rollback by another connection makes its voided step's groups trainable again here (the index
    reloads on a deletion); a merge of files with every snapshot kept is read across, not reloaded."""
    other = SegmentStore(*store_paths)
    try:
        for group in ("a", "b"):
            store.append(
                RUN,
                [SampleRow(f"{group}-0", "p", "solver", 0, group, 1, [1])],
                [SegmentRow(f"{group}-0", 0, [1], [-0.1], 0, "stop")],
                [RewardRow(f"{group}-0", 1.0)],
            )
        other.commit_step(RUN, 1, {"solver": ["a-0"]}, "ckpt-1")
        assert [g.group_id for g in store.trainable_groups(RUN, "solver")] == ["b"]
        loads = store.indexes.loads
        other.rollback_to(RUN, 0)
        assert [g.group_id for g in store.trainable_groups(RUN, "solver")] == ["a", "b"]
        assert store.latest_version(RUN) is None and store.indexes.loads == loads + 1
        other.append(  # rows this index has not read yet, merged into a file of older rows
            RUN,
            [SampleRow("c-0", "p", "solver", 0, "c", 1, [1])],
            [SegmentRow("c-0", 0, [1], [-0.1], 0, "stop")],
            [RewardRow("c-0", 1.0)],
        )
        merged = other.compact(retention_s=600)
        assert merged["files_after"] < merged["files_before"] and not merged["snapshots_expired"]
        other.commit_step(RUN, 1, {"solver": ["b-0"]}, "ckpt-1b")
        assert [g.group_id for g in store.trainable_groups(RUN, "solver")] == ["a", "c"]
        assert store.latest_version(RUN) == (1, "ckpt-1b") and store.indexes.loads == loads + 1
    finally:
        other.close()


def test_a_failed_look_after_a_commit_keeps_the_commit_and_reloads_the_index(store):
    """The commit is done once the lake has it: a failed read of the lake's snapshot after it must not
    fail the write (its retry would find its own rows), and the index, unsure, is read again."""
    import duckdb

    store.append(RUN, [SampleRow("a-0", "p", "solver", 0, "a", 1, [1])])
    assert store.group_counts(RUN)["solver"]["started"] == 1
    real_snapshot, looks = store._lake_snapshot, []

    def failing_after_the_commit() -> int:
        looks.append(1)
        if len(looks) == 3:  # the index's catch-up and the look before the commit succeed, the one after fails
            raise duckdb.IOException("the catalog could not be read")
        return real_snapshot()

    store._lake_snapshot = failing_after_the_commit
    assert store.append(RUN, [SampleRow("b-0", "p", "solver", 0, "b", 1, [1])]).written
    del store._lake_snapshot
    loads = store.indexes.loads
    assert store.group_counts(RUN)["solver"]["started"] == 2 and store.indexes.loads == loads + 1
    assert store.count("samples", RUN) == 2
