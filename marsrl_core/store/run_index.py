"""The store's polled reads answered from memory: a run's groups, consumptions and newest version.

The learner polls `trainable_groups_by_agent` before every step, the admission gate reads
`group_counts`, and the engines and the gate ask `latest_version` at every decode stage. In SQL each
scans the run's samples, rewards, consumptions or segments, and on DuckLake every scan pays for the
catalog's metadata and one Parquet read per file (a file per commit until compaction): tens of
milliseconds a call, in the one store process that also serves the rollouts' writes. A `RunIndex` holds
the few columns these answers need, for one run, as of one lake snapshot:
- read once from the store at one snapshot (a read transaction: `StoreQueries._load_index`);
- a commit of this connection is applied from the rows it inserted, with no read, when its snapshot
  directly follows the index's (nothing else committed in between: `Indexes.committed`);
- anything else that committed since (another process, a user's SQL) is read back as the rows inserted
  after the index's snapshot (`ducklake_table_insertions`; across a merge of files too, which moves
  rows and changes none); a deletion (a rollback) or a snapshot no longer kept (compaction expired it)
  reloads the index instead.
So an answer is the one the SQL would give at the snapshot the index has reached, which is the newest
when the answer is read (`tests/test_run_index.py` checks both against the SQL).

The exactly-once checks inside a write's transaction (an append's stored keys, a step's consumed
samples and version) ask the index when it holds the transaction's own snapshot, which reads what the
SQL there would; otherwise, and for a consumed group's segments and rewards (dropped from memory), they
run the SQL.
"""

from __future__ import annotations

import bisect
import datetime as dt
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from marsrl_core.store.rows import TrainableGroup

# The tables an index reads, and their columns it keeps (besides `created_at`, the commit's time).
COLUMNS = {
    "samples": ("sample_id", "agent", "group_id", "group_size"),
    "segments": ("sample_id", "segment_index", "policy_version"),
    "rewards": ("sample_id",),
    "consumptions": ("sample_id",),
    "policy_versions": ("version", "checkpoint_uri"),
}
# Every column an index reads, with its type: a catch-up reads the tables in one query (a UNION ALL).
UNION_TYPES = {
    "sample_id": "VARCHAR",
    "agent": "VARCHAR",
    "group_id": "VARCHAR",
    "group_size": "INTEGER",
    "segment_index": "INTEGER",
    "policy_version": "INTEGER",
    "version": "INTEGER",
    "checkpoint_uri": "VARCHAR",
}


@dataclass
class _Group:
    agent: str
    size: int
    members: list[str] = field(default_factory=list)
    consumed: bool = False


class RunIndex:
    """One run's groups, rewards, segment versions, consumptions and newest policy version, as of
    lake snapshot `snapshot`. Of a consumed group it keeps the sample ids alone (a long run's index
    grows by its ids, not by its segments)."""

    def __init__(self, run_id: str, snapshot: int):
        self.run_id, self.snapshot = run_id, snapshot
        self.group_of: dict[str, str] = {}  # sample id -> group id
        self.groups: dict[str, _Group] = {}
        self.rewarded_at: dict[str, dt.datetime] = {}  # sample id -> its reward's commit time
        self.oldest_version: dict[str, int] = {}  # sample id -> its oldest segment's policy version
        self.segments: dict[str, set[int]] = {}  # sample id -> its stored segments' indices
        self.consumed: set[str] = set()  # sample ids a learner step took (trained or dropped)
        self.versions: dict[int, str] = {}  # committed policy version -> its checkpoint
        self.latest: tuple[int, str] | None = None
        self.started: Counter[str] = Counter()  # groups with a stored sample, per agent
        self.consumed_groups: Counter[str] = Counter()  # groups with a consumed sample, per agent
        # agent -> its complete (all rewarded), unconsumed groups in the poll's order: (oldest version,
        # completed at, group id), sorted; and each such group's entry
        self.complete: dict[str, list[tuple[int, dt.datetime, str]]] = {}
        self.rank: dict[str, tuple[int, dt.datetime, str]] = {}

    # ------------------------------------------------------------------ what was written
    def add(self, table: str, rows: pa.Table) -> None:
        """Rows inserted into `table` (its `COLUMNS` and `created_at`), any run's: this run's are kept."""
        rows = rows.filter(pc.equal(rows["run_id"], self.run_id)) if "run_id" in rows.column_names else rows
        if not rows.num_rows:
            return
        columns = [rows[c].to_pylist() for c in (*COLUMNS[table], "created_at")]
        add_row = getattr(self, f"_add_{table}")
        for row in zip(*columns):
            add_row(*row)

    def _add_samples(self, sample_id: str, agent: str, group_id: str, size: int, _at: dt.datetime) -> None:
        if sample_id in self.group_of:
            return
        group = self.groups.get(group_id)
        if group is None:
            group = self.groups[group_id] = _Group(agent, size)
            self.started[agent] += 1
        group.members.append(sample_id)
        self.group_of[sample_id] = group_id
        if sample_id in self.consumed:
            self._consume(group_id)
        self._check(group_id)

    def _add_segments(self, sample_id: str, segment_index: int, version: int, _at: dt.datetime) -> None:
        if self._spent(sample_id):
            return
        self.segments.setdefault(sample_id, set()).add(segment_index)
        if version < self.oldest_version.get(sample_id, version + 1):
            self.oldest_version[sample_id] = version
            if self.group_of.get(sample_id) in self.rank:  # complete already: its place in the order moves
                self._check(self.group_of[sample_id])

    def _add_rewards(self, sample_id: str, at: dt.datetime) -> None:
        if self._spent(sample_id):
            return
        if sample_id not in self.rewarded_at or at < self.rewarded_at[sample_id]:
            self.rewarded_at[sample_id] = at
        if sample_id in self.group_of:
            self._check(self.group_of[sample_id])

    def _add_consumptions(self, sample_id: str, _at: dt.datetime) -> None:
        self.consumed.add(sample_id)
        if sample_id in self.group_of:
            self._consume(self.group_of[sample_id])

    def _add_policy_versions(self, version: int, checkpoint_uri: str, _at: dt.datetime) -> None:
        self.versions[version] = checkpoint_uri
        if self.latest is None or version > self.latest[0]:
            self.latest = (version, checkpoint_uri)

    def _consume(self, group_id: str) -> None:
        group = self.groups[group_id]
        if not group.consumed:
            group.consumed = True
            self.consumed_groups[group.agent] += 1
            self._check(group_id)
            for member in group.members:  # no poll asks about it again: only its ids are kept
                for kept in (self.rewarded_at, self.oldest_version, self.segments):
                    kept.pop(member, None)

    def _spent(self, sample_id: str) -> bool:
        """Whether the sample's group was consumed (what the index kept of its members is dropped)."""
        group_id = self.group_of.get(sample_id)
        return group_id is not None and self.groups[group_id].consumed

    def _check(self, group_id: str) -> None:
        """Put the group in its agent's order while it is complete (every member stored and rewarded)
        and unconsumed, at its place by oldest version and completion; take it out otherwise."""
        group = self.groups[group_id]
        ranked = self.complete.setdefault(group.agent, [])
        if (old := self.rank.pop(group_id, None)) is not None:
            del ranked[bisect.bisect_left(ranked, old)]
        done = len(group.members) == group.size and all(m in self.rewarded_at for m in group.members)
        if done and not group.consumed:
            members = group.members
            oldest = min((self.oldest_version[m] for m in members if m in self.oldest_version), default=0)
            entry = self.rank[group_id] = (oldest, max(self.rewarded_at[m] for m in members), group_id)
            bisect.insort(ranked, entry)

    # ------------------------------------------------------------------ the answers
    def stored_keys(self, keys: Mapping[str, Sequence[str]]) -> dict[str, list[str]] | None:
        """`StoreWrites._stored_keys`' answer (table -> those of its keys stored: sample ids, or
        `sample_id#segment_index` for segments), or None when it asks about a table not kept here."""
        stored = {"samples": self.group_of, "rewards": self.rewarded_at}
        found: dict[str, list[str]] = {}
        for table, values in keys.items():
            if table != "samples" and any(self._spent(v.rsplit("#", 1)[0]) for v in values):
                return None  # a consumed group's segments and rewards are not kept
            if table == "segments":
                hits = [v for v in values if int(v.rsplit("#", 1)[1]) in self.segments.get(v.rsplit("#", 1)[0], ())]
            elif table in stored:
                hits = [v for v in values if v in stored[table]]
            else:
                return None
            if hits:
                found[table] = sorted(set(hits))
        return found

    def group_counts(self) -> dict[str, dict[str, int]]:
        return {a: {"started": n, "consumed": self.consumed_groups[a]} for a, n in self.started.items() if n}

    def trainable(
        self, agents: Sequence[str], limits: Mapping[str, int] | None, floor: int
    ) -> dict[str, list[TrainableGroup]]:
        """`StoreQueries.trainable_groups_by_agent`'s answer: per agent, its complete unconsumed groups
        older than `floor` (stale: all of them), then the fresh ones, oldest version first, then the
        earliest completed, at most `limits[agent]` of those besides any whose oldest version is `floor`."""
        found: dict[str, list[TrainableGroup]] = {}
        for agent in agents:
            ranked = self.complete.get(agent, [])
            fresh_from = bisect.bisect_left(ranked, (floor,))  # before it: older than the floor (stale)
            fresh_to = len(ranked)
            if limits is not None:  # at most the limit, besides those whose oldest version is the floor
                at_floor = bisect.bisect_left(ranked, (floor + 1,)) - fresh_from
                fresh_to = min(fresh_to, fresh_from + max(limits[agent], at_floor))
            found[agent] = [
                TrainableGroup(group_id, agent, sorted(self.groups[group_id].members), oldest, oldest < floor)
                for oldest, _, group_id in ranked[fresh_from:fresh_to] + ranked[:fresh_from]
            ]
        return found


class Indexes:
    """The run indexes of one store connection, kept current by its commits (`committed`) and, for
    what others committed, by reading the lake's snapshots (`current`)."""

    def __init__(self, catalog: str) -> None:
        self.catalog = catalog
        self.runs: dict[str, RunIndex] = {}
        self._tables: dict[int, str] = {}  # the lake's table ids -> names
        self.loads = 0  # indexes read in full (the first read of a run, or after a deletion or an expiry)
        self.caught_up = 0  # indexes brought up to date by reading the rows inserted since
        self.checked = 0  # write transactions whose checks asked an index instead of the SQL

    def committed(self, before: int, after: int, inserted: Sequence[tuple[str, pa.Table]], at: dt.datetime) -> None:
        """A commit of this connection took the lake from snapshot `before` (read before it began) to
        `after` (read once it committed), inserting `inserted` ((table, rows) pairs) at time `at`. Only
        when `after` is `before + 1` was it the only commit: an index at `before` then applies its rows."""
        if after != before + 1:
            return
        for index in self.runs.values():
            if index.snapshot == before:
                for table, rows in inserted:
                    if table in COLUMNS:
                        index.add(table, with_time(rows.select(["run_id", *COLUMNS[table]]), at))
                index.snapshot = after

    def current(
        self, run_id: str, snapshot: int, read: Callable[..., pa.Table], load: Callable[[], RunIndex]
    ) -> RunIndex:
        """The run's index at lake snapshot `snapshot` (the newest): brought up to date with `read`
        (SQL, parameters -> rows), or loaded afresh with `load`."""
        index = self.runs.get(run_id)
        if index is not None and index.snapshot != snapshot and not self._caught_up(index, snapshot, read):
            index = None
        if index is None:
            index = self.runs[run_id] = load()
            self.loads += 1
        return index

    def _caught_up(self, index: RunIndex, snapshot: int, read: Callable[..., pa.Table]) -> bool:
        """`_catch_up`, False (reload) where reading the changes failed: a half-applied catch-up is
        dropped with the index."""
        try:
            return self._catch_up(index, snapshot, read)
        except Exception:  # noqa: BLE001  (a reload reads everything again: it is the answer to any failure)
            del self.runs[index.run_id]
            return False

    def _catch_up(self, index: RunIndex, snapshot: int, read: Callable[..., pa.Table]) -> bool:
        """Add what committed after the index's snapshot up to `snapshot` (two reads: the snapshots'
        changes from the catalog's own table, then the rows inserted into the index's tables); False
        when only a reload can (a deletion, or a snapshot expired by compaction)."""
        metadata = f"__ducklake_metadata_{self.catalog}"
        changes = read(
            f"SELECT changes_made FROM {metadata}.ducklake_snapshot_changes WHERE snapshot_id > ? AND snapshot_id <= ?",
            [index.snapshot, snapshot],
        ).column("changes_made")
        if snapshot < index.snapshot or len(changes) != snapshot - index.snapshot:
            return False  # a snapshot expired, or the catalog was replaced
        changed: set[int] = set()
        for made in changes.to_pylist():
            for change in (made or "").split(","):
                kind, _, table_id = change.partition(":")
                if kind == "inserted_into_table":
                    changed.add(int(table_id))
                elif kind != "merge_adjacent":  # a merge moves rows into new files and changes none
                    return False
        names = {self._table_name(table_id, read) for table_id in changed} & set(COLUMNS)
        if names:
            rows = read(
                " UNION ALL ".join(
                    f"SELECT '{table}' AS tbl, {_union_columns(table)}, created_at "
                    f"FROM ducklake_table_insertions('{self.catalog}', 'main', '{table}', ?, ?) WHERE run_id = ?"
                    for table in sorted(names)
                ),
                [value for _ in sorted(names) for value in (index.snapshot + 1, snapshot, index.run_id)],
            )
            for table in sorted(names):
                index.add(table, rows.filter(pc.equal(rows["tbl"], table)))
        index.snapshot = snapshot
        self.caught_up += 1
        return True

    def _table_name(self, table_id: int, read: Callable[..., pa.Table]) -> str | None:
        if table_id not in self._tables:
            found = read(
                f"SELECT table_id, table_name FROM __ducklake_metadata_{self.catalog}.ducklake_table "
                "WHERE end_snapshot IS NULL"
            ).to_pylist()
            self._tables = {r["table_id"]: r["table_name"] for r in found}
        return self._tables.get(table_id)

    def drop(self) -> None:
        """Forget every index (the next read of a run loads it)."""
        self.runs.clear()


def _union_columns(table: str) -> str:
    return ", ".join(c if c in COLUMNS[table] else f"NULL::{t} AS {c}" for c, t in UNION_TYPES.items())


def with_time(rows: pa.Table, at: dt.datetime) -> pa.Table:
    return rows.append_column("created_at", pa.array([at] * rows.num_rows, pa.timestamp("us", tz="UTC")))


def load_sql(catalog: str) -> dict[str, str]:
    """Per table, the query that reads a run's rows for a new index (parameter: the run id)."""
    return {
        "samples": f"SELECT run_id, sample_id, agent, group_id, group_size, created_at FROM {catalog}.samples "
        "WHERE run_id = ?",
        "segments": f"SELECT run_id, sample_id, segment_index, policy_version, created_at FROM {catalog}.segments "
        "WHERE run_id = ?",
        "rewards": f"SELECT run_id, sample_id, min(created_at) AS created_at FROM {catalog}.rewards WHERE run_id = ? "
        "GROUP BY run_id, sample_id",
        "consumptions": f"SELECT DISTINCT run_id, sample_id, NULL::TIMESTAMPTZ AS created_at "
        f"FROM {catalog}.consumptions WHERE run_id = ?",
        "policy_versions": f"SELECT run_id, version, checkpoint_uri, created_at FROM {catalog}.policy_versions "
        "WHERE run_id = ?",
    }
