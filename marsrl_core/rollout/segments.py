"""One segment rollout step: every in-flight sample decodes up to `rollout.segment_tokens` more tokens.

Each sample asks for `min(segment_tokens, its remaining budget)` tokens after its prompt and what it
has decoded so far (the engine re-prefills that prefix: no KV cache is kept across segments), with a
sampling seed derived from the run's seed and the sample's id, so a resumed sample draws what it
would have drawn. Samples of one engine (all of them when the policy is shared) go in one engine
batch. A sample whose output ended is `stop`-finished, one that reached its budget `budget`-finished;
the others continue at the next stage (`length`).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

from marsrl_core.config import RolloutConfig
from marsrl_core.engines.base import SamplingParams, SegmentRequest
from marsrl_core.rollout.samples import Sample
from marsrl_core.store import SegmentRow


def sample_seed(seed: int, sample: Sample) -> int:
    return zlib.crc32(f"{seed}:{sample.sample_id}".encode())


def decode_segment(engines: dict[str, Any], active: Sequence[Sample], rc: RolloutConfig, seed: int) -> list[SegmentRow]:
    """Decode one segment for every sample of `active` (agent -> engine in `engines`), extend each
    sample with it (tokens, versions, finish), and return the segment rows to store, in order."""
    requests = [
        SegmentRequest(
            s.prompt_ids,
            s.token_ids,
            min(rc.segment_tokens, s.max_tokens - len(s.token_ids)),
            SamplingParams(rc.temperature, rc.top_p, rc.top_k, seed=sample_seed(seed, s)),
        )
        for s in active
    ]
    results: list[Any] = [None] * len(active)
    by_engine: dict[int, list[int]] = {}
    for i, sample in enumerate(active):
        by_engine.setdefault(id(engines[sample.agent]), []).append(i)
    for indices in by_engine.values():
        engine = engines[active[indices[0]].agent]
        for i, result in zip(indices, engine.decode_segment([requests[i] for i in indices])):
            results[i] = result
    rows = []
    for sample, result in zip(active, results):
        sample.token_ids.extend(result.token_ids)
        sample.versions.extend([result.policy_version] * len(result.token_ids))
        if result.finished:
            sample.finish = "stop"
        elif len(sample.token_ids) >= sample.max_tokens:
            sample.finish = "budget"
        rows.append(
            SegmentRow(
                sample.sample_id,
                sample.segments,
                result.token_ids,
                result.logprobs,
                result.policy_version,
                sample.finish or "length",
            )
        )
        sample.segments += 1
    return rows
