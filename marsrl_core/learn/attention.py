"""Variable-length attention for padding-free micro-batches where FlashAttention-2 is not available
(the CPU, or a GPU without `flash_attn`).

A padding-free row holds several sequences end to end (`scoring.PackedBatch`). FlashAttention-2's
variable-length kernel attends within each from the row's cumulative sequence lengths
(`cu_seq_lens_q`); transformers' `sdpa` and `eager` instead build a block-diagonal causal mask over the
whole row, whose mask and scores cost the square of the row's tokens. `VARLEN_SDPA` is PyTorch's
`scaled_dot_product_attention`, causal, run on each sequence of the row on its own: the same numbers,
at the cost of the sum of the squares of the sequences' lengths. It is registered with transformers'
`AttentionInterface` under that name, and it reads the same `cu_seq_lens_q` keyword that
FlashAttention-2's path reads (the scorer passes it). transformers builds no mask for a kernel it
does not know, so none is built.

Deliberate simplification: one kernel call per sequence (a Python loop over the row's sequences,
per layer); a training row holds tens of sequences, not thousands.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

VARLEN_SDPA = "marsrl_varlen_sdpa"


def varlen_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each sequence of a packed row: `query` [1, heads, N, head_dim], `key` and
    `value` [1, key/value heads, N, head_dim]; returns [1, N, heads, head_dim] as transformers expects."""
    if cu_seq_lens_q is None or query.shape[0] != 1 or attention_mask is not None:
        raise ValueError(
            f"{VARLEN_SDPA}: attention over one padding-free row with its cu_seq_lens_q (learner.padding_free), "
            f"got {query.shape[0]} rows, cu_seq_lens_q {'missing' if cu_seq_lens_q is None else 'given'}, "
            f"an attention mask {'given' if attention_mask is not None else 'absent'}"
        )
    bounds = cu_seq_lens_q.tolist()
    gqa = key.shape[1] != query.shape[1]
    parts = [
        F.scaled_dot_product_attention(
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            dropout_p=dropout,
            is_causal=True,
            scale=scaling,
            enable_gqa=gqa,
        )
        for start, end in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(VARLEN_SDPA, varlen_sdpa)
