"""One agent's share of a learner step: its samples packed into micro-batches, the policy run over
them, the loss of `algorithms.policy_loss` back-propagated, and the step's metrics for that agent.

- `TrainItem`: a stored sample with its advantage, whether it takes decoupled PPO's correction (a
  group past `max_trained_age` with `stale_groups='correct'`), and whether it is left out of the loss
  (cut off by its budget, with `mask_truncated_completions`); `train_items` makes them from a step's
  groups.
- `loss_normalizers`: the token and sequence counts an agent's loss is divided by, from how a policy
  weighs the agents that share it (`agent_weighting`), summed over the step's micro-batches so that
  the step's gradient does not depend on how its samples were packed.
- `backward`: forward (`scoring.TokenScorer`: chunked log-probs), loss and backward per micro-batch
  of at most `micro_batch_tokens` tokens; returns sums that ranks add before `finish_metrics`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from marsrl_core.config import LearnerConfig
from marsrl_core.learn.algorithms import group_advantages, policy_loss
from marsrl_core.learn.scoring import PackedBatch
from marsrl_core.store import StoredSample, TrainableGroup


@dataclass
class TrainItem:
    sample: StoredSample
    advantage: float
    decoupled: bool = False  # past `max_trained_age`: decoupled PPO's correction (`stale_groups='correct'`)
    masked: bool = False  # cut off by its budget and left out of the loss (`mask_truncated_completions`)

    @property
    def loss_tokens(self) -> int:
        return 0 if self.masked else len(self.sample.token_ids)


_GROUP_STATS = (
    "groups",
    "zero_variance_groups",
    "reward_sum",
    "samples",
    "decoupled_samples",
    "masked_truncated_samples",
)


def train_items(
    groups: Sequence[TrainableGroup], samples: dict[str, StoredSample], lc: Any
) -> tuple[dict[str, list[TrainItem]], dict[str, dict[str, float]]]:
    """Each agent's items to train (GRPO advantages within each group; a group whose rewards are all
    equal has none and is counted, not trained) and its group statistics (`_GROUP_STATS`)."""
    per_agent: dict[str, list[TrainItem]] = {}
    stats: dict[str, dict[str, float]] = {}
    for g in groups:
        members = [samples[sid] for sid in g.sample_ids]
        s = stats.setdefault(g.agent, dict.fromkeys(_GROUP_STATS, 0.0))
        s["groups"] += 1
        s["samples"] += len(members)
        s["reward_sum"] += sum(m.reward or 0.0 for m in members)
        advantages = group_advantages([m.reward or 0.0 for m in members], lc.scale_rewards)
        if advantages is None:
            s["zero_variance_groups"] += 1
            continue
        items = [
            TrainItem(m, a, g.stale, lc.mask_truncated_completions and m.finish_reason == "budget")
            for m, a in zip(members, advantages)
        ]
        s["decoupled_samples"] += sum(i.decoupled for i in items)
        s["masked_truncated_samples"] += sum(i.masked for i in items)
        if any(i.loss_tokens for i in items):
            per_agent.setdefault(g.agent, []).extend(items)
    return per_agent, stats


def loss_normalizers(
    per_agent: dict[str, list[TrainItem]], policy_name: Callable[[str], str], weighting: str
) -> dict[str, dict[str, float]]:
    """Each agent's loss normalizers (tokens for `dapo`, sequences for `grpo`): its own counts
    ('sum'), times the number of agents sharing its policy in this step ('mean'), or the counts of
    all of them ('token')."""
    counts = {
        agent: (sum(i.loss_tokens for i in items), sum(1 for i in items if i.loss_tokens))
        for agent, items in per_agent.items()
    }
    out = {}
    for agent, (tokens, sequences) in counts.items():
        peers = [b for b in counts if policy_name(b) == policy_name(agent)]
        if weighting == "mean":
            tokens, sequences = tokens * len(peers), sequences * len(peers)
        elif weighting == "token":
            tokens, sequences = sum(counts[b][0] for b in peers), sum(counts[b][1] for b in peers)
        out[agent] = {"token_normalizer": float(max(1, tokens)), "sequence_normalizer": float(max(1, sequences))}
    return out


SUMMED = ("loss", "clip_fraction", "clip_low", "clip_high", "dual_clip", "kl", "entropy", "entropy_tokens", "ratio_sum")
SUMMED += ("tokens", "staleness_sum", "staleness_count", "advantage_sum", "advantage_sq_sum", "advantage_count")
MAXED = ("ratio_max", "staleness_max", "advantage_abs_max")


def backward(
    scorer: torch.nn.Module,
    items: list[TrainItem],
    normalizers: dict[str, float],
    loss_options: dict[str, Any],
    lc: LearnerConfig,
    *,
    reference: torch.nn.Module | None,
    step: int,
    device: torch.device,
    autocast: torch.dtype | None = None,
    min_batches: int = 0,
    filler: TrainItem | None = None,
) -> dict[str, float]:
    """Accumulate the gradient of `items`' loss into the scorer's model (`scoring.TokenScorer`); returns
    the agent's sums and maxima (`finish_metrics` turns them into metrics; ranks add theirs first).
    Batches go to `device` (the learner's: under FSDP2's CPU offload the parameters rest on the CPU between
    uses); forward and loss run under `autocast` when it is set. Past its own
    micro-batches, a rank runs `filler` with zero weight until it has run `min_batches`, so that every
    rank of a sharded model runs as many forwards and backwards (each one is a collective)."""
    totals = dict.fromkeys(SUMMED + MAXED, 0.0)
    own = pack(items, lc.micro_batch_tokens)
    batches = own + [[filler]] * max(0, min_batches - len(own))
    for index, batch in enumerate(batches):
        weight = float(index < len(own))
        packed = PackedBatch.build(
            [i.sample.prompt_tokens for i in batch], [i.sample.token_ids for i in batch], device, lc.padding_free
        )
        behaviour = pad_sequence([torch.as_tensor(i.sample.logprobs, dtype=torch.float32) for i in batch], True)
        token_mask = pad_sequence(
            [torch.full((n,), float(not i.masked) * weight) for n, i in zip(packed.lengths, batch)], True
        )
        with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            logprobs, entropy = scorer(packed)
            ref = None
            if reference is not None:
                with torch.no_grad():
                    ref = reference(packed)[0]
                if hasattr(reference, "reshard"):  # sharded: FSDP2 reshards a root only after its backward
                    reference.reshard()
            out = policy_loss(
                logprobs,
                behaviour.to(device),
                torch.tensor([i.advantage for i in batch], device=device),
                token_mask.to(device),
                ref_logprobs=ref,
                decoupled=torch.tensor([i.decoupled for i in batch], device=device),
                **normalizers,
                **loss_options,
            )
        out.loss.backward()  # a non-finite loss gives non-finite gradients: the step then skips its update
        if not weight:
            continue
        n_tokens = sum(i.loss_tokens for i in batch)
        totals["loss"] += float(out.loss.detach())
        totals["clip_fraction"] += out.clip_fraction * n_tokens
        totals["clip_low"] += out.clip_low_fraction * n_tokens
        totals["clip_high"] += out.clip_high_fraction * n_tokens
        totals["dual_clip"] += out.dual_clip_fraction * n_tokens
        totals["kl"] += out.kl * n_tokens
        totals["entropy"] += float(entropy.detach().sum())  # a metric of the policy: over every token
        totals["entropy_tokens"] += sum(packed.lengths)
        totals["ratio_sum"] += out.ratio_mean * n_tokens
        totals["tokens"] += n_tokens
        totals["ratio_max"] = max(totals["ratio_max"], out.ratio_max)
        staleness = [step - int(i.sample.versions.min()) for i in batch if len(i.sample.versions)]
        totals["staleness_sum"] += sum(staleness)
        totals["staleness_count"] += len(staleness)
        totals["staleness_max"] = max([totals["staleness_max"], *staleness])
        for i in batch:
            totals["advantage_sum"] += i.advantage
            totals["advantage_sq_sum"] += i.advantage**2
            totals["advantage_count"] += 1
            totals["advantage_abs_max"] = max(totals["advantage_abs_max"], abs(i.advantage))
    return totals


def finish_metrics(t: dict[str, float]) -> dict[str, float]:
    """An agent's step metrics from its (all ranks') sums and maxima."""
    n, count = max(1.0, t["tokens"]), max(1.0, t["advantage_count"])
    mean = t["advantage_sum"] / count
    return {
        "loss": t["loss"],
        "clip_fraction": t["clip_fraction"] / n,
        "clip_low_fraction": t["clip_low"] / n,
        "clip_high_fraction": t["clip_high"] / n,
        "dual_clip_fraction": t["dual_clip"] / n,
        "kl": t["kl"] / n,
        "entropy": t["entropy"] / max(1.0, t["entropy_tokens"]),
        "ratio_mean": t["ratio_sum"] / n,
        "ratio_max": t["ratio_max"],
        "advantage_mean": mean,
        "advantage_std": max(0.0, t["advantage_sq_sum"] / count - mean**2) ** 0.5,
        "advantage_abs_max": t["advantage_abs_max"],
        "tokens": t["tokens"],
        "staleness_mean": t["staleness_sum"] / max(1.0, t["staleness_count"]),
        "staleness_max": t["staleness_max"],
    }


def pack(items: list[TrainItem], budget: int) -> list[list[TrainItem]]:
    """Micro-batches of at most `budget` tokens (a longer sample forms its own), as few as fit and
    balanced in tokens: starting from the fewest the tokens allow, the longest sample first goes to
    the micro-batch with the fewest tokens, one more micro-batch whenever that one has no room (sorted
    greedy, as verl's sequence-length balancing). Within a micro-batch the samples keep their order.
    How a step is cut changes no loss: every micro-batch's loss is normalised by the step's totals."""
    sizes = [len(item.sample.prompt_tokens) + len(item.sample.token_ids) for item in items]
    longest_first = sorted(range(len(items)), key=lambda i: (-sizes[i], i))
    count = max(1, -(-sum(min(size, budget) for size in sizes) // budget))  # a longer sample fills one
    while True:
        members: list[list[int]] = [[] for _ in range(count)]
        loads = [0] * count
        for i in longest_first:
            emptiest = min(range(count), key=lambda b: (loads[b], b))
            if members[emptiest] and loads[emptiest] + sizes[i] > budget:
                break  # no micro-batch has room for it: one more
            members[emptiest].append(i)
            loads[emptiest] += sizes[i]
        else:
            return [[items[i] for i in sorted(batch)] for batch in members if batch]
        count += 1
