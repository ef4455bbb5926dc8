"""The store's writes: append-only rows, each call one transaction (a rollback alone deletes).

- `append(...)` writes samples, segments and rewards of one rollout stage in one transaction, keyed:
  a sample id, a segment `(sample_id, segment_index)` or a sample's reward that is stored already is
  never stored again. When any key of the call is found stored the call writes nothing and says so
  (`AppendResult`): its caller's state is behind the store and must be rebuilt from it;
- `commit_step(...)` records a learner step's consumptions, its policy version and its metrics in one
  transaction (exactly-once: a sample consumed by a committed step is never listed again; a step that
  never committed leaves its samples trainable). Samples the learner dropped as too stale are
  consumptions too, with `learner_step = DROPPED_STALE` (-1), so they are accounted for and never
  listed again;
- `rollback_to(run_id, version)` voids the committed steps after `version` (a resume from the last
  durable checkpoint, `learner.save_every`): their consumptions, versions and metrics are deleted and a
  `rolled_back` run event records what, in one transaction, so their samples are trainable again.
  DuckLake's snapshots keep the deleted rows for time travel until the files expire. Samples those
  steps dropped as stale stay dropped (a drop does not record its step).

Appends never conflict logically, so a retried commit always converges. `replay(...)` runs a write
again whose store process died during it (`store/process.py`): a write is one transaction and no other
call writes the rows it is keyed on, so its first row found stored means all of it committed, and it
is not written twice. Deliberate simplifications: unknown-sample checks use a bounded in-process cache
and fall back to one query; the key check of `append` sees what is committed when it runs, so two
processes appending the same new key at the same moment would both write it (one sample is decoded by
one rollout turn at a time).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from marsrl_core.store.connection import CATALOG, StoreConnection, registered
from marsrl_core.store.rows import (
    DROPPED_STALE,
    AppendResult,
    StoreError,
    key_table,
    rewards_batch,
    samples_batch,
    segments_batch,
)
from marsrl_core.store.schema import ARROW_SCHEMAS

if TYPE_CHECKING:
    from marsrl_core.store.rows import Rejection, RewardRow, SampleRow, SegmentRow

KEYED_WRITES = frozenset({"append", "commit_step", "reject"})  # those `replay` checks first


class StoreWrites(StoreConnection):
    """The writes of `SegmentStore`."""

    def create_run(self, run_id: str, config: dict[str, Any]) -> None:
        """Record a run and its config; a run already recorded keeps its row (so a repeated call writes
        nothing twice)."""
        batch = pa.table(
            {"run_id": [run_id], "config_json": [json.dumps(config, default=str)]}, schema=ARROW_SCHEMAS["runs"]
        )
        self._transaction(lambda c: self._insert_absent(c, "runs", batch, "run_id = ?", [run_id]))

    def add_problems(self, run_id: str, problems: Iterable[Any]) -> int:
        """Record the problems (objects with problem_id, prompt, answer, source) the run has not recorded
        yet, in one transaction; returns how many were new (so a repeated call writes nothing twice)."""
        rows = list(problems)
        if not rows:
            return 0
        batch = pa.table(
            {
                "run_id": [run_id] * len(rows),
                "problem_id": [p.problem_id for p in rows],
                "prompt": [p.prompt for p in rows],
                "answer": [p.answer for p in rows],
                "source": [p.source for p in rows],
            },
            schema=ARROW_SCHEMAS["problems"],
        )

        def body(con: duckdb.DuckDBPyConnection) -> int:
            known = self._stored_keys(con, run_id, {"problems": batch["problem_id"].to_pylist()}).get("problems", [])
            new = batch.filter(pc.invert(pc.is_in(batch["problem_id"], pa.array(known, pa.string()))))
            if new.num_rows:
                self._insert(con, "problems", new)
            return new.num_rows

        return self._transaction(body)

    def record_evaluation(self, run_id: str, label: str, dataset: str, metrics: dict[str, Any]) -> None:
        """Append one evaluation's metrics (e.g. label 'before' / 'after'); the same row already recorded
        is not written again (so a repeated call writes nothing twice)."""
        metrics_json = json.dumps(metrics)
        batch = pa.table(
            {"run_id": [run_id], "label": [label], "dataset": [dataset], "metrics_json": [metrics_json]},
            schema=ARROW_SCHEMAS["evaluations"],
        )
        same = "run_id = ? AND label = ? AND dataset = ? AND metrics_json = ?"
        self._transaction(
            lambda c: self._insert_absent(c, "evaluations", batch, same, [run_id, label, dataset, metrics_json])
        )

    def mark(self, run_id: str, event: str, detail: str = "") -> None:
        """Record a run event (e.g. 'rollouts_finished'), visible to every process. An event already
        recorded with the same detail is not recorded again (two tasks that see one divergence record
        it once)."""
        batch = pa.table({"run_id": [run_id], "event": [event], "detail": [detail]}, schema=ARROW_SCHEMAS["run_events"])
        same = "run_id = ? AND event = ? AND detail = ?"
        self._transaction(lambda c: self._insert_absent(c, "run_events", batch, same, [run_id, event, detail]))

    def rollback_to(self, run_id: str, version: int) -> int:
        """Void the run's committed steps after `version` (see the module docstring); how many. Calling
        it again voids nothing more."""

        def body(con: duckdb.DuckDBPyConnection) -> int:
            voided = con.execute(
                f"SELECT count(*), max(version) FROM {CATALOG}.policy_versions WHERE run_id = ? AND version > ?",
                [run_id, version],
            ).fetchone()
            if not voided[0]:
                return 0
            self.indexes.drop()  # the polls' indexes do not follow deletions: they are read again
            for table, column in (
                ("consumptions", "learner_step"),
                ("policy_versions", "version"),
                ("train_steps", "step"),
            ):
                con.execute(f"DELETE FROM {CATALOG}.{table} WHERE run_id = ? AND {column} > ?", [run_id, version])
            event = {
                "run_id": [run_id],
                "event": ["rolled_back"],
                "detail": [f"to {version}, voided {version + 1}..{voided[1]}"],
            }
            self._insert(con, "run_events", pa.table(event, schema=ARROW_SCHEMAS["run_events"]))
            return int(voided[0])

        return self._transaction(body)

    def reject(self, run_id: str, rejections: Sequence[Rejection]) -> None:
        """Record rejected inputs (what and why); the run goes on without them."""
        if not rejections:
            return
        batch = pa.table(
            {
                "run_id": [run_id] * len(rejections),
                "source": [r.source for r in rejections],
                "location": [r.location for r in rejections],
                "reason": [r.reason for r in rejections],
                "payload": [r.payload[:2000] for r in rejections],
            },
            schema=ARROW_SCHEMAS["rejected_inputs"],
        )
        self._transaction(lambda c: self._insert(c, "rejected_inputs", batch))

    def append(
        self,
        run_id: str,
        samples: Sequence[SampleRow] = (),
        segments: Sequence[SegmentRow] = (),
        rewards: Sequence[RewardRow] = (),
    ) -> AppendResult:
        """Append one stage's new samples, decoded segments and rewards in a single transaction, unless
        any of their keys is stored already: then nothing is written and the result names those keys."""
        keys = {
            "samples": [s.sample_id for s in samples],
            "segments": [f"{s.sample_id}#{s.segment_index}" for s in segments],
            "rewards": [r.sample_id for r in rewards],
        }
        for table, values in keys.items():
            if len(set(values)) != len(values):
                twice = sorted({v for v in values if values.count(v) > 1})
                raise StoreError(f"append: {table} key(s) given twice in one call: {', '.join(twice[:5])}")
        batches = {}
        if samples:
            batches["samples"] = samples_batch(run_id, samples)
        new_ids = set(keys["samples"])
        referenced = {s.sample_id for s in segments} | {r.sample_id for r in rewards}
        self._check_known(run_id, referenced - new_ids)
        if segments:
            batches["segments"] = segments_batch(run_id, segments)
        if rewards:
            batches["rewards"] = rewards_batch(run_id, rewards)
        if not batches:
            return AppendResult()

        self._refresh_index(run_id)

        def body(con: duckdb.DuckDBPyConnection) -> dict[str, list[str]]:
            index = self._index_in(con, run_id)
            stored = index.stored_keys(keys) if index is not None else None
            if stored is None:
                stored = self._stored_keys(con, run_id, keys)
            if not stored:
                for table, batch in batches.items():
                    self._insert(con, table, batch)
            return stored

        stored = self._transaction(body)
        if stored:
            return AppendResult(written=False, already_stored=stored)
        self._remember(run_id, new_ids)
        return AppendResult()

    @staticmethod
    def _stored_keys(con: duckdb.DuckDBPyConnection, run_id: str, keys: dict[str, list[str]]) -> dict[str, list[str]]:
        """Those of `keys` (table -> keys: `append`'s sample ids, `sample_id#segment_index` for segments,
        or problem ids) that the store holds already."""
        found: dict[str, list[str]] = {}
        for table, values in keys.items():
            if not values:
                continue
            if table == "segments":
                ids, indices = zip(*(v.rsplit("#", 1) for v in values))
                given = pa.table({"sample_id": list(ids), "segment_index": pa.array(map(int, indices), pa.int32())})
                columns, label = "sample_id, segment_index", "sample_id || '#' || segment_index"
            else:
                column = "problem_id" if table == "problems" else "sample_id"
                given, columns, label = key_table(column, values), column, column
            with registered(con, "_keys", given):
                rows = con.execute(
                    f"SELECT DISTINCT {label} AS k FROM {CATALOG}.{table} JOIN _keys USING ({columns}) "
                    "WHERE run_id = ? ORDER BY k",
                    [run_id],
                ).fetchall()
            if rows:
                found[table] = [k for (k,) in rows]
        return found

    def commit_step(
        self,
        run_id: str,
        step: int,
        consumed: dict[str, Sequence[str]],
        checkpoint_uri: str,
        mlflow_run_id: str | None = None,
        metrics: dict[str, dict[str, float]] | None = None,
        dropped: dict[str, Sequence[str]] | None = None,
    ) -> None:
        """Exactly-once commit of a learner step: consumptions + policy version + metrics together.

        `consumed` maps agent -> sample ids trained in this step; `dropped` (same shape) the samples this
        step dropped untrained as too stale (recorded with `learner_step = DROPPED_STALE`). Call it
        only after the checkpoint at
        `checkpoint_uri` is completely written. Raises StoreError (and writes nothing) if any sample
        was already consumed by a committed step or the version already exists.
        """
        pairs = [(sid, agent, step) for agent, ids in consumed.items() for sid in ids]
        pairs += [(sid, agent, DROPPED_STALE) for agent, ids in (dropped or {}).items() for sid in ids]
        ids = [sid for sid, _, _ in pairs]
        if len(set(ids)) != len(ids):
            raise StoreError(f"commit_step(step={step}): a sample id appears twice in consumed")
        self._check_known(run_id, set(ids))
        consumptions = pa.table(
            {
                "run_id": [run_id] * len(pairs),
                "sample_id": ids,
                "agent": [a for _, a, _ in pairs],
                "learner_step": [k for _, _, k in pairs],
            },
            schema=ARROW_SCHEMAS["consumptions"],
        )
        version = pa.table(
            {
                "run_id": [run_id],
                "version": [step],
                "checkpoint_uri": [checkpoint_uri],
                "mlflow_run_id": [mlflow_run_id],
            },
            schema=ARROW_SCHEMAS["policy_versions"],
        )
        metric_rows = metrics or {}
        steps = pa.table(
            {
                "run_id": [run_id] * len(metric_rows),
                "step": [step] * len(metric_rows),
                "agent": list(metric_rows),
                "metrics_json": [json.dumps(m) for m in metric_rows.values()],
            },
            schema=ARROW_SCHEMAS["train_steps"],
        )
        ids_table = key_table("sample_id", ids)

        self._refresh_index(run_id)

        def body(con: duckdb.DuckDBPyConnection) -> None:
            index = self._index_in(con, run_id)
            if index is not None:
                twice, exists = sum(sid in index.consumed for sid in ids), int(step in index.versions)
            else:
                with registered(con, "_step_ids", ids_table):
                    twice = con.execute(
                        f"SELECT count(*) FROM {CATALOG}.consumptions c JOIN _step_ids USING (sample_id) "
                        "WHERE c.run_id = ?",
                        [run_id],
                    ).fetchone()[0]
                exists = con.execute(
                    f"SELECT count(*) FROM {CATALOG}.policy_versions WHERE run_id = ? AND version = ?", [run_id, step]
                ).fetchone()[0]
            if twice or exists:
                raise StoreError(
                    f"commit_step(step={step}): {twice} samples already consumed, "
                    f"version {step} {'exists' if exists else 'is new'}; nothing written"
                )
            self._insert(con, "consumptions", consumptions)
            self._insert(con, "policy_versions", version)
            if len(metric_rows):
                self._insert(con, "train_steps", steps)

        self._transaction(body)

    def replay(self, method: str, args: tuple, kwargs: dict) -> Any:
        """Run again a write (`KEYED_WRITES`) that may or may not have committed: if its first row is
        stored, all of it is (one transaction), so it returns what the write returns without writing."""
        if method not in KEYED_WRITES:
            raise StoreError(f"replay({method!r}): not one of the keyed writes {sorted(KEYED_WRITES)}")
        call = inspect.signature(getattr(self, method)).bind(*args, **kwargs)
        call.apply_defaults()
        given = call.arguments
        key = self._first_row_key(method, given)
        if key is not None:
            table, where, params = key
            sql = f"SELECT count(*) AS n FROM {CATALOG}.{table} WHERE run_id = ? AND {where}"
            if self._read(sql, [given["run_id"], *params]).column("n")[0].as_py():  # it had committed
                return AppendResult() if method == "append" else None
        return getattr(self, method)(*args, **kwargs)

    @staticmethod
    def _first_row_key(method: str, given: dict[str, Any]) -> tuple[str, str, list[Any]] | None:
        """(table, condition, parameters) that find the first row `method` writes; None if it writes none."""
        if method == "commit_step":
            return "policy_versions", "version = ? AND checkpoint_uri = ?", [given["step"], given["checkpoint_uri"]]
        if method == "reject" and given["rejections"]:
            r = given["rejections"][0]
            return "rejected_inputs", "source = ? AND location = ? AND reason = ?", [r.source, r.location, r.reason]
        if method == "append":
            if given["samples"]:
                return "samples", "sample_id = ?", [given["samples"][0].sample_id]
            if given["segments"]:
                first = given["segments"][0]
                return "segments", "sample_id = ? AND segment_index = ?", [first.sample_id, first.segment_index]
            if given["rewards"]:
                return "rewards", "sample_id = ?", [given["rewards"][0].sample_id]
        return None

    def _insert_absent(
        self, con: duckdb.DuckDBPyConnection, table: str, batch: pa.Table, where: str, params: list[Any]
    ) -> None:
        """Insert `batch` unless `table` has a row matching `where` (inside the caller's transaction)."""
        if con.execute(f"SELECT count(*) FROM {CATALOG}.{table} WHERE {where}", params).fetchone()[0] == 0:
            self._insert(con, table, batch)

    def _check_known(self, run_id: str, sample_ids: set[str]) -> None:
        unknown = {sid for sid in sample_ids if (run_id, sid) not in self._known_samples}
        if not unknown:
            return
        found = (
            self._read(
                f"SELECT DISTINCT s.sample_id FROM {CATALOG}.samples s JOIN _ids USING (sample_id) WHERE s.run_id = ?",
                [run_id],
                {"_ids": key_table("sample_id", sorted(unknown))},
            )
            .column("sample_id")
            .to_pylist()
        )
        self._remember(run_id, found)
        missing = unknown - set(found)
        if missing:
            shown = ", ".join(sorted(missing)[:5])
            raise StoreError(f"sample_id: {len(missing)} unknown sample id(s) in run {run_id!r}: {shown}")
