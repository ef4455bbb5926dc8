"""The policy's forward for training: a causal LM's decoder and chunked log-probs as one module.

`TokenScorer(model)(batch)` returns the log-prob and entropy of every response token of a packed
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

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from marsrl_core.learn.algorithms import chunked_logprobs


@dataclass
class PackedBatch:
    """Sequences (prompt + response) right-padded into one batch, and where their responses are."""

    input_ids: torch.Tensor  # [B, W]
    attention_mask: torch.Tensor  # [B, W]
    positions: torch.Tensor  # [T]: flat index (row * W + column) of the hidden state predicting each response token
    targets: torch.Tensor  # [T]: the response tokens
    lengths: list[int]  # response tokens per row

    @classmethod
    def build(cls, prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray], device: torch.device):
        seqs = [torch.as_tensor(np.concatenate([p, r])) for p, r in zip(prompts, responses)]
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


LOGPROBS_METHOD = "marsrl_logprobs"  # the method of the output module that computes the chunked log-probs


def _output_logprobs(head: torch.nn.Module, hidden, targets, chunk_tokens: int, temperature: float):
    return chunked_logprobs(hidden, head.weight, targets, chunk_tokens, temperature)


class TokenScorer(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, chunk_tokens: int, temperature: float):
        super().__init__()
        self.model, self.chunk_tokens, self.temperature = model, chunk_tokens, temperature
        head = model.get_output_embeddings()
        if not hasattr(head, LOGPROBS_METHOD):
            setattr(head, LOGPROBS_METHOD, types.MethodType(_output_logprobs, head))

    def forward(self, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs [B, T_max] (right-padded) and the flat entropy [T] (a metric: no gradient)."""
        hidden = self.model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        flat = hidden.last_hidden_state.flatten(0, 1)[batch.positions]
        head = getattr(self.model.get_output_embeddings(), LOGPROBS_METHOD)
        logprobs, entropy = head(flat, batch.targets, self.chunk_tokens, self.temperature)
        return pad_sequence(list(logprobs.float().split(batch.lengths)), batch_first=True), entropy
