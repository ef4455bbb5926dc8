"""The store's rows: what a rollout stage and a learner step write, what a read gives back, and their
conversion to Arrow batches (binding Python lists row by row is ~1000x slower than one Arrow insert).
Every batch builder validates its input and raises `StoreError` naming the row and field at fault."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from marsrl_core.store.schema import ARROW_SCHEMAS

DROPPED_STALE = -1  # consumptions.learner_step of a sample the learner dropped untrained as too stale


class StoreError(RuntimeError):
    """A store operation failed; the message names the input or path at fault."""


@dataclass
class SampleRow:
    """A sample was started: one agent's output for one prompt, member of one same-input group."""

    sample_id: str
    problem_id: str
    agent: str
    turn: int
    group_id: str
    group_size: int
    prompt_tokens: Sequence[int]
    parent_sample_id: str | None = None


@dataclass
class SegmentRow:
    """One decoded segment of a sample: its tokens, their behaviour log-probs, and the policy version."""

    sample_id: str
    segment_index: int
    token_ids: Sequence[int]
    logprobs: Sequence[float]
    policy_version: int
    finish_reason: str  # "stop" (EOS / stop string), "length" (segment full, continues), "budget" (truncated)


@dataclass(frozen=True)
class AppendResult:
    """What `append` did: wrote every row (`written`), or, when any of its keys was stored already,
    nothing at all; `already_stored` then names those keys per table (`sample_id`, or
    `sample_id#segment_index` for segments)."""

    written: bool = True
    already_stored: dict[str, list[str]] = field(default_factory=dict)

    def describe(self) -> str:
        """One line: which keys were found stored (the first few of each table)."""
        return "; ".join(
            f"{table} {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''}"
            for table, keys in self.already_stored.items()
        )


@dataclass
class RewardRow:
    """A sample finished: its reward and what was parsed from it."""

    sample_id: str
    reward: float
    correct: bool | None = None
    outcome: str = "ok"
    parsed: str | None = None
    text: str | None = None


@dataclass(frozen=True)
class Rejection:
    """An input the run went on without (a `rejected_inputs` row): where it came from and why."""

    source: str  # the file, or "rollout:<problem id>"
    location: str  # "line 7" / "row 7" / "turn 2"
    reason: str
    payload: str = ""  # the input itself, cut to 2,000 characters when stored


@dataclass
class StoredSample:
    """A sample rebuilt from the store: prompt, response tokens, behaviour log-probs and versions."""

    sample_id: str
    agent: str
    group_id: str
    prompt_tokens: np.ndarray
    token_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray  # policy version of each response token
    finish_reason: str | None
    reward: float | None = None
    parsed: str | None = None
    num_segments: int = 0


@dataclass
class TrainableGroup:
    group_id: str
    agent: str
    sample_ids: list[str] = field(default_factory=list)
    oldest_version: int = 0  # the policy version of the group's oldest segment
    stale: bool = False  # older than the learner's staleness bound: to be dropped, not trained on


def key_table(column: str, values: Iterable[str]) -> pa.Table:
    """A one-column table of string keys, registered beside a query to join against (an IN list of
    thousands of bound parameters is slow)."""
    return pa.table({column: pa.array(list(values), pa.string())})


def _list_array(arrays: Sequence[np.ndarray], value_type: pa.DataType) -> pa.ListArray:
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(arrays) if arrays else np.zeros(0)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values.astype(value_type.to_pandas_dtype())))


def _as_array(values: Any, kind: str, name: str) -> np.ndarray:
    """`values` as a 1-D numpy array of the wanted kind ('i' integers, 'f' floats), else StoreError."""
    array = np.asarray(values)
    if array.ndim != 1 and array.size != 0:
        raise StoreError(f"{name}: expected a flat sequence, got shape {array.shape}")
    if array.size == 0:
        return array.reshape(0)
    if kind == "i" and array.dtype.kind not in "iu":
        raise StoreError(f"{name}: expected integer token ids, got dtype {array.dtype}")
    if kind == "f" and array.dtype.kind not in "f":
        raise StoreError(f"{name}: expected float log-probs, got dtype {array.dtype}")
    if kind == "f" and not np.all(np.isfinite(array)):
        raise StoreError(f"{name}: log-probs must be finite")
    return array


def samples_batch(run_id: str, samples: Sequence[SampleRow]) -> pa.Table:
    prompts = [_as_array(s.prompt_tokens, "i", f"samples[{i}].prompt_tokens") for i, s in enumerate(samples)]
    for i, s in enumerate(samples):
        if s.group_size < 1:
            raise StoreError(f"samples[{i}].group_size={s.group_size}: must be >= 1")
    return pa.table(
        {
            "run_id": [run_id] * len(samples),
            "sample_id": [s.sample_id for s in samples],
            "problem_id": [s.problem_id for s in samples],
            "agent": [s.agent for s in samples],
            "turn": pa.array([s.turn for s in samples], pa.int32()),
            "parent_sample_id": [s.parent_sample_id for s in samples],
            "group_id": [s.group_id for s in samples],
            "group_size": pa.array([s.group_size for s in samples], pa.int32()),
            "prompt_tokens": _list_array(prompts, pa.int32()),
        },
        schema=ARROW_SCHEMAS["samples"],
    )


def segments_batch(run_id: str, segments: Sequence[SegmentRow]) -> pa.Table:
    tokens, logprobs = [], []
    for i, s in enumerate(segments):
        t = _as_array(s.token_ids, "i", f"segments[{i}].token_ids")
        lp = _as_array(s.logprobs, "f", f"segments[{i}].logprobs")
        if len(t) != len(lp):
            raise StoreError(
                f"segments[{i}] (sample {s.sample_id}): token_ids has {len(t)} entries but logprobs has {len(lp)}"
            )
        if s.finish_reason not in ("stop", "length", "budget"):
            raise StoreError(f"segments[{i}].finish_reason={s.finish_reason!r}: expected stop, length or budget")
        tokens.append(t)
        logprobs.append(lp)
    return pa.table(
        {
            "run_id": [run_id] * len(segments),
            "sample_id": [s.sample_id for s in segments],
            "segment_index": pa.array([s.segment_index for s in segments], pa.int32()),
            "token_ids": _list_array(tokens, pa.int32()),
            "logprobs": _list_array(logprobs, pa.float32()),
            "policy_version": pa.array([s.policy_version for s in segments], pa.int32()),
            "finish_reason": [s.finish_reason for s in segments],
        },
        schema=ARROW_SCHEMAS["segments"],
    )


def rewards_batch(run_id: str, rewards: Sequence[RewardRow]) -> pa.Table:
    for i, r in enumerate(rewards):
        if not isinstance(r.reward, (int, float, np.floating, np.integer)) or not np.isfinite(r.reward):
            raise StoreError(f"rewards[{i}].reward={r.reward!r}: expected a finite number")
    return pa.table(
        {
            "run_id": [run_id] * len(rewards),
            "sample_id": [r.sample_id for r in rewards],
            "reward": pa.array([float(r.reward) for r in rewards], pa.float32()),
            "correct": [r.correct for r in rewards],
            "outcome": [r.outcome for r in rewards],
            "parsed": [r.parsed for r in rewards],
            "text": [r.text for r in rewards],
        },
        schema=ARROW_SCHEMAS["rewards"],
    )
