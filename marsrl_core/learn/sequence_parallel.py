"""Ulysses sequence parallelism (DeepSpeed-Ulysses, arXiv 2309.14509) over the learner's padding-free
rows: `learner.sequence_parallel = N`.

The learner's ranks form a data x sequence layout: ranks `d*N .. d*N+N-1` are sequence group `d`; the
step's samples are split over the groups (`world_size / N` of them), and the N ranks of a group train
the same micro-batches. Each rank runs 1/N of every row's tokens through the model (`local_part`):
embeddings, norms and MLPs work token by token; attention needs every token of a sequence, so around
it the group exchanges query, key and value by all-to-all (its own tokens with every head -> every
token with 1/N of the heads), runs the variable-length kernel over the whole row (FlashAttention-2's,
or `attention.VARLEN_SDPA`), and exchanges the output back (`ulysses_attention`). Each rank computes
the log-probs of the response tokens among its own; the group gathers them (`gather_tokens`, whose
gradient is the rank's own part), so every rank of a group computes the same loss, and its backward
leaves on each rank the gradient through its own tokens. Summed over all ranks (FSDP2's
reduce-scatter, or the data-parallel all-reduce) that is the step's gradient; a step's metrics are
counted on the first rank of each group.

Decisions and simplifications:
- a row whose length is not a multiple of N gets fewer than N padding tokens at its end, as a
  sequence of their own (attended to by nothing else, no targets): the only padding tokens the
  learner runs, and a row shorter than N tokens works the same way;
- query heads must divide by N (`check_heads`: a clear error when the learner starts); key/value
  heads that do not are repeated to the query heads for the exchange (more all-to-all traffic, the
  same numbers);
- FSDP2 shards the parameters over all ranks (data x sequence flattened, as verl does), not over the
  data dimension alone: every rank holds 1/world of the parameters and reduce-scatters its gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from marsrl_core.learn.attention import VARLEN_SDPA, varlen_sdpa

ULYSSES = "marsrl_ulysses_"  # + the kernel it wraps: the attention implementation of a sequence-parallel learner


@dataclass(frozen=True)
class SequenceGroup:
    group: Any  # the process group of the N ranks that share a row
    rank: int  # this rank's place in it
    size: int  # N = learner.sequence_parallel

    @classmethod
    def form(cls, ranks: Any, size: int) -> SequenceGroup:
        """This rank's group of `size` consecutive ranks of `ranks` (`distributed.Ranks`; every rank forms
        every group, in the same order, as `torch.distributed.new_group` requires)."""
        world_size = 1 if ranks is None else ranks.world_size
        if world_size % size:
            raise ValueError(
                f"learner.sequence_parallel = {size} must divide the learner's ranks, {world_size} "
                f"(data x sequence: ranks = data groups x {size}; learner.nproc or the launcher sets them)"
            )
        mine = None
        for start in range(0, world_size, size):
            group = dist.new_group(list(range(start, start + size)))
            if start <= ranks.rank < start + size:
                mine = cls(group, ranks.rank - start, size)
        return mine


def check_heads(config: Any, size: int) -> None:
    """A model whose attention heads `size` does not divide cannot be cut by heads: a clear error before
    any rank starts a step."""
    heads = config.num_attention_heads
    if heads % size:
        raise ValueError(
            f"learner.sequence_parallel = {size} must divide the model's {heads} attention heads (Ulysses gives "
            f"each rank of a sequence group heads / sequence_parallel of them): use a divisor of {heads}"
        )


def local_part(batch: Any, sequence: SequenceGroup) -> tuple[Any, list[int]]:
    """This rank's 1/N of a padding-free row (a `scoring.PackedBatch`, padded to a multiple of N by a
    last sequence of its own), and how many response tokens each rank of the group scores. The row's sequence
    boundaries (`cu_seqlens`) stay those of the whole row: attention runs over the whole row."""
    if batch.cu_seqlens is None:
        raise ValueError("learner.sequence_parallel > 1 cuts padding-free rows: set learner.padding_free=true")
    n, size = batch.input_ids.shape[1], sequence.size
    width = -(-n // size)
    pad = width * size - n
    input_ids, position_ids, cu_seqlens = batch.input_ids, batch.position_ids, batch.cu_seqlens
    if pad:
        input_ids = F.pad(input_ids, (0, pad))
        position_ids = torch.cat([position_ids, torch.arange(pad, device=position_ids.device)[None]], dim=1)
        cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([n + pad])])
    owner = batch.positions // width  # the rank whose tokens hold each predicting hidden state
    counts = torch.bincount(owner, minlength=size).tolist()
    mine = owner == sequence.rank
    lo, hi = sequence.rank * width, (sequence.rank + 1) * width
    part = dataclasses.replace(
        batch,
        input_ids=input_ids[:, lo:hi],
        positions=batch.positions[mine] - lo,
        targets=batch.targets[mine],
        position_ids=position_ids[:, lo:hi],
        cu_seqlens=cu_seqlens,
    )
    return part, counts


class _AllToAll(torch.autograd.Function):
    """Split `x` along `scatter` into N parts, send part j to rank j, concatenate what arrives along
    `gather`; the gradient goes back the reverse way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, scatter: int, gather: int) -> torch.Tensor:
        ctx.group, ctx.dims = group, (scatter, gather)
        return _all_to_all(x, group, scatter, gather)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scatter, gather = ctx.dims
        return _all_to_all(grad, ctx.group, gather, scatter), None, None, None


def _all_to_all(x: torch.Tensor, group: Any, scatter: int, gather: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    send = torch.stack([part.contiguous() for part in x.chunk(size, dim=scatter)])
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)  # received[i]: rank i's part for this rank
    return torch.cat(received.unbind(0), dim=gather)


class _GatherTokens(torch.autograd.Function):
    """The group's per-token values in rank order (rank r holds `counts[r]` of them); the gradient is
    this rank's part of the gradient, which every rank computes the same from the same loss."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, counts: list[int], sequence: SequenceGroup) -> torch.Tensor:
        ctx.part = (sum(counts[: sequence.rank]), counts[sequence.rank])
        padded = F.pad(x, (0, max(counts) - x.shape[0]))
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded.contiguous(), group=sequence.group)
        return torch.cat([p[:count] for p, count in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start, count = ctx.part
        return grad[start : start + count], None, None


def gather_tokens(x: torch.Tensor, counts: list[int], sequence: SequenceGroup) -> torch.Tensor:
    return _GatherTokens.apply(x, counts, sequence)


def ulysses_attention(kernel: Callable) -> Callable:
    """`kernel` (a transformers attention function over a padding-free row) run on the whole row with
    1/N of the heads: query, key and value [1, heads, tokens/N, head_dim] in, [1, tokens/N, heads,
    head_dim] out, as transformers expects."""

    def attention(module, query, key, value, attention_mask, sequence_group: Any = None, **kwargs):
        if sequence_group is None:
            raise ValueError(f"{ULYSSES}: a sequence-parallel forward passes its sequence_group")
        size = dist.get_world_size(sequence_group)
        heads, kv_heads = query.shape[1], key.shape[1]  # heads divide by size (`check_heads`)
        if kv_heads % size:  # fewer key/value heads than ranks: repeated to the query heads for the exchange
            key = key.repeat_interleave(heads // kv_heads, dim=1)
            value = value.repeat_interleave(heads // kv_heads, dim=1)
        query, key, value = (_AllToAll.apply(t, sequence_group, 1, 2) for t in (query, key, value))
        kwargs.pop("position_ids", None)  # this rank's; the kernel reads the whole row's cu_seq_lens_q
        out, _ = kernel(module, query, key, value, attention_mask, **kwargs)
        return _AllToAll.apply(out, sequence_group, 1, 2), None

    return attention


def _flash_attention_2(*args, **kwargs):
    return ALL_ATTENTION_FUNCTIONS["flash_attention_2"](*args, **kwargs)


for _name, _kernel in ((VARLEN_SDPA, varlen_sdpa), ("flash_attention_2", _flash_attention_2)):
    AttentionInterface.register(ULYSSES + _name, ulysses_attention(_kernel))
