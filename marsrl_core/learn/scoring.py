"""The policy's forward for training: a causal LM's decoder and chunked log-probs as one module.

A micro-batch (`PackedBatch.build`) is either right-padded rows with an attention mask, or, padding
free, one row: the sequences concatenated, `position_ids` restarting at 0 for each and no attention
mask, its sequences' boundaries passed on as `cu_seq_lens_q`: the attention kernel confines attention
to each sequence (FlashAttention-2's variable-length kernel, or `attention.VARLEN_SDPA`, which the
learner's models use instead of `sdpa` and `eager`; with those two, transformers would build a
block-diagonal causal mask over the whole row, exact but quadratic in the row's tokens). No padding
token runs through the model.

`TokenScorer(model)(batch)` returns the log-prob and entropy of every response token of a
micro-batch, never materialising [tokens x vocabulary] logits (`algorithms.chunked_logprobs`). The
output matrix is read by a method of the output module itself (`LOGPROBS_METHOD`), which FSDP2 treats
as that module's forward (`distributed.shard` registers it): when the output module is an FSDP2 unit
of its own, its matrix is gathered for that call and its gradient reduce-scattered after backward
like every other parameter.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from marsrl_core.learn import sequence_parallel
from marsrl_core.learn.algorithms import chunked_logprobs


@dataclass
class PackedBatch:
    """Sequences (prompt + response) in one micro-batch, and where their responses are: right-padded
    rows with an attention mask, or one padding-free row with restarting `position_ids`."""

    input_ids: torch.Tensor  # [B, W], or [1, N] padding free
    attention_mask: torch.Tensor | None  # [B, W]; None padding free
    positions: torch.Tensor  # [T]: flat index (row * W + column) of the hidden state predicting each response token
    targets: torch.Tensor  # [T]: the response tokens
    lengths: list[int]  # response tokens per sequence
    position_ids: torch.Tensor | None = None  # [1, N] padding free: 0.. for each sequence
    cu_seqlens: torch.Tensor | None = None  # [S + 1] padding free: where each sequence starts in the row, then N

    @classmethod
    def build(
        cls,
        prompts: Sequence[np.ndarray],
        responses: Sequence[np.ndarray],
        device: torch.device,
        padding_free: bool = False,
    ):
        seqs = [torch.as_tensor(np.concatenate([p, r])) for p, r in zip(prompts, responses)]
        if padding_free:
            return cls._one_row(seqs, [len(p) for p in prompts], responses, device)
        input_ids = pad_sequence(seqs, batch_first=True, padding_value=0)
        mask = pad_sequence([torch.ones(len(s), dtype=torch.long) for s in seqs], batch_first=True)
        width = input_ids.shape[1]
        positions = torch.cat(
            [
                torch.arange(len(p) - 1, len(p) - 1 + len(r)) + row * width
                for row, (p, r) in enumerate(zip(prompts, responses))
            ]
        )
        targets = torch.cat([torch.as_tensor(r, dtype=torch.long) for r in responses])
        return cls(
            input_ids.to(device), mask.to(device), positions.to(device), targets.to(device), [len(r) for r in responses]
        )

    @classmethod
    def _one_row(cls, seqs: list[torch.Tensor], prompt_lengths: list[int], responses, device: torch.device):
        starts = np.cumsum([0] + [len(s) for s in seqs[:-1]])
        positions = torch.cat(
            [
                torch.arange(start + p - 1, start + p - 1 + len(r))
                for start, p, r in zip(starts, prompt_lengths, responses)
            ]
        )
        targets = torch.cat([torch.as_tensor(r, dtype=torch.long) for r in responses])
        position_ids = torch.cat([torch.arange(len(s)) for s in seqs])[None]
        cu_seqlens = torch.tensor([*starts, starts[-1] + len(seqs[-1])], dtype=torch.int32)
        return cls(
            torch.cat(seqs)[None].to(device),
            None,
            positions.to(device),
            targets.to(device),
            [len(r) for r in responses],
            position_ids.to(device),
            cu_seqlens.to(device),
        )

    def varlen_kwargs(self) -> dict:
        """A padding-free row's sequence boundaries as transformers' attention kernels read them
        (FlashAttention-2's varlen path, `attention.VARLEN_SDPA`); nothing for padded rows."""
        if self.cu_seqlens is None:
            return {}
        longest = int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())
        return {
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": longest,
            "max_length_k": longest,
        }


LOGPROBS_METHOD = "marsrl_logprobs"  # the method of the output module that computes the chunked log-probs


def _output_logprobs(head: torch.nn.Module, hidden, targets, chunk_tokens: int, temperature: float):
    return chunked_logprobs(hidden, head.weight, targets, chunk_tokens, temperature)


class TokenScorer(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, chunk_tokens: int, temperature: float, sequence: Any = None):
        super().__init__()
        self.model, self.chunk_tokens, self.temperature = model, chunk_tokens, temperature
        self.sequence = sequence  # a `sequence_parallel.SequenceGroup`: this rank runs 1/N of each row
        head = model.get_output_embeddings()
        if not hasattr(head, LOGPROBS_METHOD):
            setattr(head, LOGPROBS_METHOD, types.MethodType(_output_logprobs, head))

    def forward(self, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs [B, T_max] (right-padded) and the flat entropy [T] (a metric: no gradient).
        Sequence parallel: this rank runs its part of the row, the group's log-probs are gathered."""
        part, extra = batch, {}
        if self.sequence is not None:
            part, counts = sequence_parallel.local_part(batch, self.sequence)
            extra = {"sequence_group": self.sequence.group}
        hidden = self.model.get_decoder()(  # no KV cache: a training forward; with one, transformers ignores packing
            input_ids=part.input_ids,
            attention_mask=part.attention_mask,
            position_ids=part.position_ids,
            use_cache=False,
            **part.varlen_kwargs(),
            **extra,
        )
        flat = hidden.last_hidden_state.flatten(0, 1)[part.positions]
        head = getattr(self.model.get_output_embeddings(), LOGPROBS_METHOD)
        logprobs, entropy = head(flat, part.targets, self.chunk_tokens, self.temperature)
        if self.sequence is not None:
            logprobs = sequence_parallel.gather_tokens(logprobs, counts, self.sequence)
            entropy = sequence_parallel.gather_tokens(entropy.detach(), counts, self.sequence)
        return pad_sequence(list(logprobs.float().split(batch.lengths)), batch_first=True), entropy
