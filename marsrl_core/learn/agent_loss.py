"""One agent's share of a learner step: its samples packed into micro-batches, the policy run over
them, the loss of `algorithms.policy_loss` back-propagated, and the step's metrics for that agent.

- `TrainItem`: a stored sample with its advantage, whether it takes decoupled PPO's correction (a
  group past `max_staleness` with `stale_groups='correct'`), and whether it is left out of the loss
  (cut off by its budget, with `mask_truncated_completions`).
- `loss_normalizers`: the token and sequence counts an agent's loss is divided by, from how a policy
  weighs the agents that share it (`agent_weighting`), summed over the step's micro-batches so that
  the step's gradient does not depend on how its samples were packed.
- `backward`: forward, chunked log-probs, loss and backward per micro-batch of at most
  `micro_batch_tokens` tokens.

Deliberate simplification: the reference model (`beta > 0`) is run one sample at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from marsrl_core.config import LearnerConfig
from marsrl_core.learn.algorithms import chunked_logprobs, policy_loss
from marsrl_core.store import StoredSample


@dataclass
class TrainItem:
    sample: StoredSample
    advantage: float
    decoupled: bool = False  # past `max_staleness`: decoupled PPO's correction (`stale_groups='correct'`)
    masked: bool = False  # cut off by its budget and left out of the loss (`mask_truncated_completions`)

    @property
    def loss_tokens(self) -> int:
        return 0 if self.masked else len(self.sample.token_ids)


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


def backward(
    model: torch.nn.Module,
    items: list[TrainItem],
    normalizers: dict[str, float],
    loss_options: dict[str, Any],
    lc: LearnerConfig,
    *,
    reference: torch.nn.Module | None,
    temperature: float,
    step: int,
    autocast: torch.dtype | None = None,
) -> dict[str, float]:
    """Accumulate the gradient of `items`' loss into `model`; returns the agent's step metrics.
    Batches go to the model's device; forward and loss run under `autocast` when it is set."""
    decoder, head = model.get_decoder(), model.get_output_embeddings().weight
    device = head.device
    total_tokens = sum(i.loss_tokens for i in items)
    sums = ("loss", "clip_fraction", "clip_low", "clip_high", "dual_clip", "kl", "entropy", "ratio_sum")
    totals = dict.fromkeys((*sums, "entropy_tokens"), 0.0)
    ratio_max, staleness = 0.0, []
    for batch in pack(items, lc.micro_batch_tokens):
        seqs = [torch.as_tensor(np.concatenate([i.sample.prompt_tokens, i.sample.token_ids])) for i in batch]
        input_ids = pad_sequence(seqs, batch_first=True, padding_value=0).to(device)
        mask = pad_sequence([torch.ones(len(s), dtype=torch.long) for s in seqs], batch_first=True).to(device)
        targets = [torch.as_tensor(i.sample.token_ids, dtype=torch.long) for i in batch]
        lengths = [len(t) for t in targets]
        behaviour = pad_sequence([torch.as_tensor(i.sample.logprobs, dtype=torch.float32) for i in batch], True)
        token_mask = pad_sequence([torch.full((n,), float(not i.masked)) for n, i in zip(lengths, batch)], True)
        with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            hidden = decoder(input_ids=input_ids, attention_mask=mask).last_hidden_state
            positions = [
                hidden[row, len(i.sample.prompt_tokens) - 1 : len(i.sample.prompt_tokens) - 1 + n]
                for row, (i, n) in enumerate(zip(batch, lengths))
            ]
            lp_flat, ent_flat = chunked_logprobs(
                torch.cat(positions), head, torch.cat(targets).to(device), lc.logprob_chunk_tokens, temperature
            )
            logprobs = pad_sequence(list(lp_flat.float().split(lengths)), batch_first=True)
            reference_lp = reference_logprobs(reference, batch, lc, temperature) if reference is not None else None
            out = policy_loss(
                logprobs,
                behaviour.to(device),
                torch.tensor([i.advantage for i in batch], device=device),
                token_mask.to(device),
                ref_logprobs=reference_lp,
                decoupled=torch.tensor([i.decoupled for i in batch], device=device),
                **normalizers,
                **loss_options,
            )
        if torch.isfinite(out.loss):
            out.loss.backward()
        n_tokens = sum(i.loss_tokens for i in batch)
        totals["loss"] += float(out.loss.detach())
        totals["clip_fraction"] += out.clip_fraction * n_tokens
        totals["clip_low"] += out.clip_low_fraction * n_tokens
        totals["clip_high"] += out.clip_high_fraction * n_tokens
        totals["dual_clip"] += out.dual_clip_fraction * n_tokens
        totals["kl"] += out.kl * n_tokens
        totals["entropy"] += float(ent_flat.detach().sum())  # a metric of the policy: over every token
        totals["entropy_tokens"] += sum(lengths)
        totals["ratio_sum"] += out.ratio_mean * n_tokens
        ratio_max = max(ratio_max, out.ratio_max)
        staleness += [step - int(i.sample.versions.min()) for i in batch if len(i.sample.versions)]
    adv = np.array([i.advantage for i in items])
    n = max(1, total_tokens)
    return {
        "loss": totals["loss"],
        "clip_fraction": totals["clip_fraction"] / n,
        "clip_low_fraction": totals["clip_low"] / n,
        "clip_high_fraction": totals["clip_high"] / n,
        "dual_clip_fraction": totals["dual_clip"] / n,
        "kl": totals["kl"] / n,
        "entropy": totals["entropy"] / max(1, totals["entropy_tokens"]),
        "ratio_mean": totals["ratio_sum"] / n,
        "ratio_max": ratio_max,
        "advantage_mean": float(adv.mean()),
        "advantage_std": float(adv.std()),
        "advantage_abs_max": float(np.abs(adv).max()),
        "tokens": float(total_tokens),
        "staleness_mean": float(np.mean(staleness)) if staleness else 0.0,
        "staleness_max": float(max(staleness)) if staleness else 0.0,
    }


@torch.no_grad()
def reference_logprobs(
    reference: torch.nn.Module, batch: list[TrainItem], lc: LearnerConfig, temperature: float
) -> torch.Tensor:
    rows = []
    head = reference.get_output_embeddings().weight
    for item in batch:
        ids = torch.as_tensor(np.concatenate([item.sample.prompt_tokens, item.sample.token_ids]))[None]
        hidden = reference.get_decoder()(input_ids=ids.to(head.device)).last_hidden_state[0]
        p, n = len(item.sample.prompt_tokens), len(item.sample.token_ids)
        lp, _ = chunked_logprobs(
            hidden[p - 1 : p - 1 + n],
            head,
            torch.as_tensor(item.sample.token_ids, device=head.device),
            lc.logprob_chunk_tokens,
            temperature,
        )
        rows.append(lp.float())
    return pad_sequence(rows, batch_first=True)


def pack(items: list[TrainItem], budget: int) -> list[list[TrainItem]]:
    """Greedy micro-batches of at most `budget` tokens (a longer sample forms its own batch)."""
    batches, current, used = [], [], 0
    for item in items:
        size = len(item.sample.prompt_tokens) + len(item.sample.token_ids)
        if current and used + size > budget:
            batches.append(current)
            current, used = [], 0
        current.append(item)
        used += size
    if current:
        batches.append(current)
    return batches
