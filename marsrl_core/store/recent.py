"""The samples this process stored and no learner step has consumed yet, kept in memory, so that a
learner in the same process takes them from here instead of reading them back from the store.

`RecentSamples` holds, per sample, the rows the decode loop's `append` committed: its sample row, its
segments and its reward. Only committed rows: `RecentStore.append` adds them after the store's
transaction returned, so memory never holds what the store does not. `RecentStore.load_samples` answers
a sample from memory when memory holds all of it (the sample row, every segment from index 0 on, and
its reward), rebuilt as the store rebuilds it (token ids int64, log-probs float32, the reward as
float32), and reads the rest from the store: samples stored before this process started, by another
process (a split run's learner has nothing here), or dropped for room. A step's `commit_step` forgets
the samples it consumed or dropped; at most `max_bytes` of arrays are kept, the oldest samples
dropped first.

The store stays the one source of truth for what is ready and what is consumed: the learner's poll
and its commit still go to the store; memory only spares the step reading back what this process
wrote a moment before (`benchmarks/step_profile.py`: the learner's `load_samples` store call).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from inspect import signature
from typing import Any

import numpy as np

from marsrl_core.store.rows import AppendResult, RewardRow, SampleRow, SegmentRow, StoredSample
from marsrl_core.store.segment_store import SegmentStore

_APPEND, _COMMIT_STEP = signature(SegmentStore.append), signature(SegmentStore.commit_step)


@dataclass
class _Recent:
    run_id: str
    row: SampleRow
    prompt_tokens: np.ndarray
    segments: dict[int, tuple[np.ndarray, np.ndarray, int, str]] = field(default_factory=dict)
    reward: tuple[float, str | None] | None = None
    nbytes: int = 0

    def complete(self) -> bool:
        """Rewarded, its segments 0..n-1 all here, the last one ending the output (not cut at a
        segment's length, which a next segment continues)."""
        n = len(self.segments)
        whole = all(i in self.segments for i in range(n)) and (n == 0 or self.segments[n - 1][3] != "length")
        return self.reward is not None and whole

    def rebuild(self) -> StoredSample:
        parts = [self.segments[i] for i in range(len(self.segments))]
        empty = not parts
        return StoredSample(
            sample_id=self.row.sample_id,
            agent=self.row.agent,
            group_id=self.row.group_id,
            prompt_tokens=self.prompt_tokens,
            token_ids=np.zeros(0, np.int64) if empty else np.concatenate([p[0] for p in parts]),
            logprobs=np.zeros(0, np.float32) if empty else np.concatenate([p[1] for p in parts]),
            versions=np.zeros(0, np.int64)
            if empty
            else np.concatenate([np.full(len(p[0]), p[2], np.int64) for p in parts]),
            finish_reason=None if empty else parts[-1][3],
            reward=self.reward[0],
            parsed=self.reward[1],
            num_segments=len(parts),
        )


class RecentSamples:
    """Committed, unconsumed samples of this process's appends (see the module docstring)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.served = self.fetched = 0  # samples `RecentStore.load_samples` took from memory, from the store
        self._samples: dict[str, _Recent] = {}  # insertion order: the oldest first
        self._lock = threading.Lock()

    def stored(
        self, run_id: str, samples: Sequence[SampleRow], segments: Sequence[SegmentRow], rewards: Sequence[RewardRow]
    ) -> None:
        """Keep what one committed `append` wrote."""
        with self._lock:
            for s in samples:
                prompt = np.asarray(s.prompt_tokens, dtype=np.int64)
                self._samples[s.sample_id] = _Recent(run_id, s, prompt, nbytes=prompt.nbytes)
                self.nbytes += prompt.nbytes
            for g in segments:
                recent = self._samples.get(g.sample_id)
                if recent is None or recent.run_id != run_id:
                    continue  # its sample row was written before this process kept anything, or dropped
                tokens = np.asarray(g.token_ids, dtype=np.int64)
                logprobs = np.asarray(g.logprobs, dtype=np.float32)
                recent.segments[g.segment_index] = (tokens, logprobs, int(g.policy_version), g.finish_reason)
                recent.nbytes += tokens.nbytes + logprobs.nbytes
                self.nbytes += tokens.nbytes + logprobs.nbytes
            for r in rewards:
                recent = self._samples.get(r.sample_id)
                if recent is not None and recent.run_id == run_id:
                    recent.reward = (float(np.float32(r.reward)), r.parsed)
            while self.nbytes > self.max_bytes and self._samples:
                self._drop(next(iter(self._samples)))

    def take(self, run_id: str, sample_ids: Sequence[str]) -> dict[str, StoredSample]:
        """Those of `sample_ids` that memory holds whole, rebuilt as the store's `load_samples` would."""
        with self._lock:
            found = {}
            for sid in sample_ids:
                recent = self._samples.get(sid)
                if recent is not None and recent.run_id == run_id and recent.complete():
                    found[sid] = recent.rebuild()
            return found

    def forget(self, run_id: str, sample_ids: Sequence[str]) -> None:
        with self._lock:
            for sid in sample_ids:
                recent = self._samples.get(sid)
                if recent is not None and recent.run_id == run_id:
                    self._drop(sid)

    def __len__(self) -> int:
        return len(self._samples)

    def _drop(self, sample_id: str) -> None:
        self.nbytes -= self._samples.pop(sample_id).nbytes


class RecentStore:
    """A store (a `SegmentStore` or a `StoreProcess`) whose appends are kept in a `RecentSamples` and
    whose `load_samples` reads from it first; every other call goes to the store as it is."""

    def __init__(self, store: Any, recent: RecentSamples):
        self.store, self.recent = store, recent

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def append(self, run_id: str, *args: Any, **kwargs: Any) -> AppendResult:
        """The store's `append`; what it wrote is kept."""
        result = self.store.append(run_id, *args, **kwargs)
        if result.written:
            rows = _APPEND.bind(self, run_id, *args, **kwargs)
            rows.apply_defaults()
            self.recent.stored(run_id, rows.arguments["samples"], rows.arguments["segments"], rows.arguments["rewards"])
        return result

    def load_samples(self, run_id: str, sample_ids: Sequence[str]) -> dict[str, StoredSample]:
        found = self.recent.take(run_id, sample_ids)
        rest = [sid for sid in sample_ids if sid not in found]
        if rest:
            found.update(self.store.load_samples(run_id, rest))
        self.recent.served += len(sample_ids) - len(rest)
        self.recent.fetched += len(rest)
        return found

    def commit_step(self, run_id: str, step: int, consumed: dict[str, Sequence[str]], *args: Any, **kwargs: Any):
        """The store's `commit_step`; then the samples it consumed or dropped are forgotten."""
        self.store.commit_step(run_id, step, consumed, *args, **kwargs)
        given = _COMMIT_STEP.bind(self, run_id, step, consumed, *args, **kwargs).arguments
        spent = [*consumed.values(), *(given.get("dropped") or {}).values()]
        self.recent.forget(run_id, [sid for ids in spent for sid in ids])
