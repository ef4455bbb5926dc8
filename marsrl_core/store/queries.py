"""The store's reads: what the learner polls, what a resume rebuilds, what a run looks up.

- `trainable_groups(...)` lists complete, unconsumed same-input groups for an agent (or, in one
  query, for several: `trainable_groups_by_agent`);
- `load_samples(...)` rebuilds sample token sequences and behaviour log-probs from their segments;
- `invariants(run_id)` counts what breaks the exactly-once rules (`invariants.py`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from marsrl_core.store.connection import CATALOG, StoreConnection
from marsrl_core.store.invariants import invariants_sql
from marsrl_core.store.rows import StoredSample, StoreError, TrainableGroup, key_table
from marsrl_core.store.schema import ARROW_SCHEMAS


class StoreQueries(StoreConnection):
    """The reads of `SegmentStore`."""

    def evaluation(self, run_id: str, label: str) -> dict[str, Any] | None:
        """The metrics of the run's last evaluation with `label`, or None if it has none."""
        rows = (
            self._read(
                f"SELECT metrics_json FROM {CATALOG}.evaluations WHERE run_id = ? AND label = ?", [run_id, label]
            )
            .column("metrics_json")
            .to_pylist()
        )
        return json.loads(rows[-1]) if rows else None

    def run_config(self, run_id: str) -> dict[str, Any] | None:
        """The config a run was started with (as recorded by `create_run`), or None for an unknown run."""
        rows = (
            self._read(f"SELECT config_json FROM {CATALOG}.runs WHERE run_id = ?", [run_id])
            .column("config_json")
            .to_pylist()
        )
        return json.loads(rows[0]) if rows else None

    def has_event(self, run_id: str, event: str) -> bool:
        return (
            self._read(
                f"SELECT count(*) AS n FROM {CATALOG}.run_events WHERE run_id = ? AND event = ?", [run_id, event]
            )
            .column("n")[0]
            .as_py()
            > 0
        )

    def events(self, run_id: str, prefix: str = "") -> set[str]:
        """The run's recorded events that start with `prefix` (one query for what `has_event` asks one by one)."""
        rows = self._read(
            f"SELECT DISTINCT event FROM {CATALOG}.run_events WHERE run_id = ? AND starts_with(event, ?)",
            [run_id, prefix],
        )
        return set(rows.column("event").to_pylist())

    def event_details(self, run_id: str, event: str) -> list[str]:
        """The details recorded with the run's `event` (empty when it was never recorded)."""
        rows = self._read(
            f"SELECT detail FROM {CATALOG}.run_events WHERE run_id = ? AND event = ?",
            [run_id, event],
        )
        return rows.column("detail").to_pylist()

    def trainable_groups(self, run_id: str, agent: str, limit: int | None = None) -> list[TrainableGroup]:
        """Complete (every member rewarded), unconsumed groups of `agent`: the oldest policy version
        first (the group that would age past the learner's bound soonest), then the oldest completion."""
        return self.trainable_groups_by_agent(run_id, [agent], limit)[agent]

    def trainable_groups_by_agent(
        self,
        run_id: str,
        agents: Sequence[str],
        limit: int | Mapping[str, int] | None = None,
        min_version: int | None = None,
    ) -> dict[str, list[TrainableGroup]]:
        """`trainable_groups` of several agents (at most `limit` each, or `limit[agent]`): the learner's
        poll.

        With `min_version`, groups with a segment sampled by an older policy version come back too,
        flagged `stale` and not counted against `limit` (all of them, so the learner can drop them), and
        so do all fresh groups whose oldest version is `min_version`: the next step would find them
        stale, so the learner takes them now beyond its count.
        Answered from the run's index (`run_index.py`), as the SQL in `tests/test_run_index.py` would."""
        limits = None
        if limit is not None:
            limits = limit if isinstance(limit, Mapping) else {agent: limit for agent in agents}
        floor = -1 if min_version is None else int(min_version)
        found = self._index(run_id).trainable(agents, limits, floor)
        for groups in found.values():
            for group in groups:
                self._remember(run_id, group.sample_ids)  # the learner's commit checks these ids exist: they do
        return found

    def load_samples(self, run_id: str, sample_ids: Sequence[str]) -> dict[str, StoredSample]:
        """Rebuild samples (prompt, tokens, behaviour log-probs, versions) from their segments."""
        ids = key_table("sample_id", sample_ids)
        meta = self._read(
            f"""SELECT s.sample_id, s.agent, s.group_id, s.prompt_tokens, r.reward, r.parsed
                FROM {CATALOG}.samples s JOIN _ids USING (sample_id)
                LEFT JOIN {CATALOG}.rewards r ON r.run_id = s.run_id AND r.sample_id = s.sample_id
                WHERE s.run_id = ?""",
            [run_id],
            {"_ids": ids},
        ).to_pylist()
        segs = self._read(
            f"""SELECT g.sample_id, g.segment_index, g.token_ids, g.logprobs, g.policy_version, g.finish_reason
                FROM {CATALOG}.segments g JOIN _ids USING (sample_id)
                WHERE g.run_id = ? ORDER BY g.sample_id, g.segment_index""",
            [run_id],
            {"_ids": ids},
        ).to_pylist()
        by_sample: dict[str, list[dict[str, Any]]] = {}
        for seg in segs:
            by_sample.setdefault(seg["sample_id"], []).append(seg)
        result = {}
        for m in meta:
            parts = by_sample.get(m["sample_id"], [])
            tokens = [np.asarray(p["token_ids"], dtype=np.int64) for p in parts]
            result[m["sample_id"]] = StoredSample(
                sample_id=m["sample_id"],
                agent=m["agent"],
                group_id=m["group_id"],
                prompt_tokens=np.asarray(m["prompt_tokens"], dtype=np.int64),
                token_ids=np.concatenate(tokens) if tokens else np.zeros(0, np.int64),
                logprobs=np.concatenate([np.asarray(p["logprobs"], np.float32) for p in parts])
                if parts
                else np.zeros(0, np.float32),
                versions=np.concatenate([np.full(len(t), p["policy_version"], np.int64) for t, p in zip(tokens, parts)])
                if parts
                else np.zeros(0, np.int64),
                finish_reason=parts[-1]["finish_reason"] if parts else None,
                reward=m["reward"],
                parsed=m["parsed"],
                num_segments=len(parts),
            )
        missing = [sid for sid in sample_ids if sid not in result]
        if missing:
            raise StoreError(f"sample_id: unknown sample id(s) in run {run_id!r}: {', '.join(missing[:5])}")
        return result

    def samples_of_problems(self, run_id: str, problem_ids: Sequence[str]) -> list[dict[str, Any]]:
        """The stored samples of these problems (ids, agent, turn, group, parent, rewarded or not), by turn.

        Filtered in SQL, so a rollout task's cost does not grow with the run's size."""
        ids = key_table("problem_id", problem_ids)
        return self._read(
            f"""SELECT s.sample_id, s.problem_id, s.agent, s.turn, s.group_id, s.parent_sample_id,
                       EXISTS (SELECT 1 FROM {CATALOG}.rewards r
                               WHERE r.run_id = s.run_id AND r.sample_id = s.sample_id) AS rewarded
                FROM {CATALOG}.samples s JOIN _ids USING (problem_id)
                WHERE s.run_id = ? ORDER BY s.turn, s.sample_id""",
            [run_id],
            {"_ids": ids},
        ).to_pylist()

    def latest_version(self, run_id: str) -> tuple[int, str] | None:
        """The newest committed policy version and its checkpoint, or None before the first step."""
        return self._index(run_id).latest

    def group_counts(self, run_id: str) -> dict[str, dict[str, int]]:
        """Per agent: the run's groups started (any sample stored) and consumed (a learner step took them:
        trained, or dropped as stale). The admission gate's reading of the learner's progress."""
        return self._index(run_id).group_counts()

    def invariants(self, run_id: str) -> dict[str, int]:
        """The run's exactly-once invariants (`store/invariants.py`): offending keys per invariant, all 0
        in a healthy run."""
        return {k: int(v) for k, v in self._read(invariants_sql(CATALOG), [run_id]).to_pylist()[0].items()}

    def count(self, table: str, run_id: str | None = None) -> int:
        if table not in ARROW_SCHEMAS:
            raise StoreError(f"table={table!r}: unknown table; choose one of {sorted(ARROW_SCHEMAS)}")
        where = " WHERE run_id = ?" if run_id is not None else ""
        params = [run_id] if run_id is not None else []
        return self._read(f"SELECT count(*) AS n FROM {CATALOG}.{table}{where}", params).column("n")[0].as_py()
