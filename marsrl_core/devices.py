"""Where models run and in what precision: the one place that turns `model.device`,
`model.attn_implementation` and `learner.mixed_precision` into torch objects.

- `resolve_device("auto")` is `cuda:<LOCAL_RANK>` when CUDA is present (rank 0's GPU in one process),
  else the CPU; `cuda` or `cuda:N` on a machine without CUDA is a `ConfigError`, not a crash inside torch,
  and so is `cuda:N` in a process of several ranks (each rank takes `cuda:<LOCAL_RANK>`).
- `compute_dtype`: the learner keeps fp32 master weights and optimizer state and computes in bf16 under
  autocast when `mixed_precision` is 'bf16' ('auto': when `model.dtype` is a half type). An AdamW step
  of lr 1e-6 on bf16 weights themselves rounds away (bf16 has 8 bits of mantissa); on fp32 masters it
  does not, and the checkpoint the engines load is written in `model.dtype`.
- `attn_implementation("auto")`: FlashAttention-2 on CUDA when `flash_attn` is installed, else PyTorch's
  `sdpa`.
- `learner_gpus`: `marsrl train` with a learner of several ranks beside its rollouts gives the ranks the
  last GPUs and leaves the first (where the rollout process's `hf` or `vllm` engine runs) to the rollouts.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from marsrl_core.config import ConfigError, MarsRLConfig


def resolve_device(spec: str = "auto", local_rank: int | None = None) -> torch.device:
    """The torch device for `model.device` (`auto` | `cpu` | `cuda` | `cuda:N`)."""
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if spec == "cpu":
        return torch.device("cpu")
    cuda = torch.cuda.is_available()
    if spec == "auto":
        return torch.device("cuda", local_rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if not spec.startswith("cuda"):
        raise ConfigError(f"model.device={spec!r}: must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
    if ":" in spec and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            f"model.device={spec!r}: a learner of several ranks puts each rank on its own GPU (cuda:<LOCAL_RANK>); "
            "use 'auto' or 'cuda', and CUDA_VISIBLE_DEVICES to choose the GPUs"
        )
    if not cuda:
        raise ConfigError(
            f"model.device={spec!r}: CUDA is not available on this machine (torch {torch.__version__}); "
            "use 'auto' or 'cpu'"
        )
    index = int(spec.split(":", 1)[1]) if ":" in spec else local_rank
    if index >= torch.cuda.device_count():
        raise ConfigError(f"model.device={spec!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", index)


def learner_gpus(nproc: int, spec: str, visible: str | None = None, count: int | None = None) -> str | None:
    """`CUDA_VISIBLE_DEVICES` for a learner of `nproc` ranks started beside this process's rollouts.

    The rollouts' engine takes the first visible GPU (`auto` is cuda:0 in a process without a rank, and
    vLLM places itself there), so the ranks get the last `nproc` GPUs, one each, disjoint from it. None
    (the ranks inherit this process's GPUs) when `model.device` is not 'auto', when there is no GPU, or
    when there are no more GPUs than ranks: then rank 0 shares GPU 0 with the engine, and
    `engine.gpu_memory_utilization` must leave it room. `visible` is this process's
    `CUDA_VISIBLE_DEVICES` (default: the environment's), `count` its GPU count (default: torch's)."""
    if spec != "auto":
        return None
    if count is None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",") if d.strip()][:count] if visible else [str(i) for i in range(count)]
    if len(ids) <= nproc:
        return None
    return ",".join(ids[-nproc:])


def compute_dtype(cfg: MarsRLConfig) -> torch.dtype | None:
    """The learner's autocast dtype (None: it computes in its parameters' dtype)."""
    mode = cfg.learner.mixed_precision
    if mode == "auto":
        mode = "bf16" if cfg.model.dtype in ("bfloat16", "float16") else "native"
    return torch.bfloat16 if mode == "bf16" else None


def master_dtype(cfg: MarsRLConfig) -> torch.dtype:
    """The dtype of the learner's trained parameters: fp32 under mixed precision, else `model.dtype`."""
    return torch.float32 if compute_dtype(cfg) is not None else getattr(torch, cfg.model.dtype)


def attn_implementation(spec: str, device: torch.device) -> str:
    """The transformers attention kernel for `model.attn_implementation`."""
    if spec != "auto":
        return spec
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gb(device: torch.device) -> float | None:
    """Peak accelerator memory allocated since the last reset, in GB (None on the CPU)."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 1e9
