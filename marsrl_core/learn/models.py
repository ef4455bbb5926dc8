"""The learner's models: loaded from a Hugging Face folder onto the learner's device, or, for a sharded
learner, built empty, sharded with FSDP2 and filled from rank 0, so that no rank holds a whole model.

- `load_model(folder, cfg, dtype, device)`: the model ready to train (gradient checkpointing as
  `learner.gradient_checkpointing` says; with `learner.padding_free`, attention per sequence of a row:
  FlashAttention-2's varlen kernel, or `attention.VARLEN_SDPA` in place of `sdpa` and `eager`; with
  `learner.sequence_parallel`, that kernel inside `sequence_parallel.ulysses_attention`);
  `empty=True` leaves its parameters on the meta device.
- `shard_and_fill(scorers, folder, ...)`: each empty model sharded (`distributed.shard`), then filled:
  rank 0 alone reads the folder (as stored, on its CPU) and scatters each tensor
  (`distributed.fill_from_rank0`); under `learner.fsdp_cpu_offload` the shards rest on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import torch

from marsrl_core.config import MarsRLConfig
from marsrl_core.devices import attn_implementation
from marsrl_core.learn import distributed
from marsrl_core.learn.attention import VARLEN_SDPA
from marsrl_core.learn.sequence_parallel import ULYSSES


def load_model(folder: Path, cfg: MarsRLConfig, dtype: torch.dtype, device: torch.device, empty: bool = False):
    """The model of `folder` in `dtype` on `device`, ready to train; `empty`: its parameters on the meta
    device, for a sharded learner to shard before they exist (`distributed.fill_from_rank0`)."""
    from marsrl_core.engines.hf import empty_model, load_model_folder

    attn = attn_implementation(cfg.model.attn_implementation, device)
    if cfg.learner.padding_free and attn != "flash_attention_2":  # sdpa per sequence, not over the whole row
        attn = VARLEN_SDPA
    if cfg.learner.sequence_parallel > 1:  # the same kernel over the whole row, 1/N of the heads per rank
        attn = ULYSSES + attn
    model = empty_model(folder, dtype, attn) if empty else load_model_folder(folder, dtype, device, attn)
    if cfg.learner.gradient_checkpointing:
        # non-reentrant: the form torch recommends, and the one FSDP2's hooks see through
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model.train()


def shard_and_fill(
    scorers: list[torch.nn.Module],
    folder: Path,
    cfg: MarsRLConfig,
    device: torch.device,
    compute: torch.dtype | None,
    ranks: distributed.Ranks,
) -> None:
    """Shard the empty models of `scorers` (`scoring.TokenScorer`s) over `ranks`, computing in `compute`,
    then give every rank its shards of `folder`'s weights."""
    from marsrl_core.engines.hf import load_model_folder

    source = load_model_folder(folder, "auto", "cpu").state_dict() if ranks.main else None
    distributed.barrier(ranks.control)  # the read may outlast `collective_timeout_s`
    offload = cfg.learner.fsdp_cpu_offload
    for scorer in scorers:
        distributed.shard(scorer, device, compute, offload)
        distributed.fill_from_rank0(scorer.model, torch.device("cpu") if offload else device, source, device)
