"""Test helper: sample groups with a real engine and store them as the rollout would."""

from __future__ import annotations

import uuid

from marsrl_core.engines.base import SamplingParams, generate
from marsrl_core.store import RewardRow, SampleRow, SegmentRow, SegmentStore, TrainableGroup


def sample_groups(
    engine,
    store: SegmentStore,
    run: str,
    agent: str,
    prompt: str,
    *,
    groups: int,
    size: int,
    reward_fn,
    max_tokens: int = 8,
    segment_tokens: int = 4,
    seed: int = 0,
    temperature: float = 1.0,
) -> list[TrainableGroup]:
    """Decode `groups` x `size` samples of `prompt`, store them segment by segment, reward them."""
    ids = engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    outs = generate(
        engine, [ids] * (groups * size), max_tokens, segment_tokens, SamplingParams(temperature=temperature, seed=seed)
    )
    result = []
    for g in range(groups):
        group_id = f"{agent}-{uuid.uuid4().hex[:8]}"
        samples, segments, rewards, members = [], [], [], []
        for m in range(size):
            out = outs[g * size + m]
            sid = f"{group_id}-{m}"
            members.append(sid)
            samples.append(SampleRow(sid, "p", agent, 0, group_id, size, ids))
            for k, start in enumerate(range(0, len(out.token_ids), segment_tokens)):
                end = start + segment_tokens
                last = end >= len(out.token_ids)
                reason = ("stop" if out.finish_reason == "stop" else "budget") if last else "length"
                segments.append(
                    SegmentRow(sid, k, out.token_ids[start:end], out.logprobs[start:end], out.versions[start], reason)
                )
            rewards.append(RewardRow(sid, float(reward_fn(out.token_ids, engine.tokenizer))))
        store.append(run, samples, segments, rewards)
        result.append(TrainableGroup(group_id, agent, members))
    return result


def digit_fraction(token_ids, tokenizer) -> float:
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    return sum(c.isdigit() for c in text) / max(1, len(token_ids))
