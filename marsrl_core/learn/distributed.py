"""Several learner ranks on torch.distributed: data parallel, or sharded with FSDP2 (`learner.fsdp`).

Ranks are started by a launcher that sets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and
`MASTER_PORT`: `accelerate launch --config_file deployments/accelerate/<one-gpu|eight-gpus|two-nodes>.yaml`
or `torchrun`. NCCL on GPUs, gloo on CPUs; every collective times out after
`learner.collective_timeout_s`, so a rank that hangs or dies fails the step instead of hanging the run.

One step on N ranks computes the update of one process on the same groups:
- rank 0 alone reads the store; it broadcasts the step's groups and samples (`broadcast`);
- every rank forms the same advantages and loss normalizers (global token and sequence counts), then
  trains on its share of each agent's samples (`split_by_tokens`: balanced by tokens);
- gradients are summed over ranks: `all_reduce_gradients` for a replicated model, FSDP2's
  reduce-scatter (divide factor 1) for a sharded one; metric sums are added by `reduce_totals`;
- rank 0 writes the consolidated checkpoint (`consolidated_state`, in the engines' dtype) and commits
  the step; every rank writes its own shards of the parameters and of the AdamW state.

A sharded model is built on the meta device, sharded, then filled from rank 0 (`fill_from_rank0`):
only rank 0 reads the model folder, and no rank holds the whole model in fp32.

Sharding (`shard`): each decoder layer is one FSDP2 unit, so are the input embeddings and the output
matrix when they are not tied (a vocabulary matrix is gathered only while it is used: for an 8B
model, 2.5 GB each in fp32), and the scorer is the root (the final norm, and a tied matrix); under
mixed precision the units compute in bf16 and reduce gradients in fp32
(`MixedPrecisionPolicy`); `learner.fsdp_cpu_offload` keeps parameters, gradients and optimizer
state on the CPU between uses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

BUCKET_ELEMENTS = 1 << 24  # gradients are summed in flat buckets of up to 16M elements
FOLLOWER_WAIT_S = 7 * 24 * 3600.0  # how long ranks > 0 wait for rank 0's next step (it may idle for hours)


@dataclass(frozen=True)
class Ranks:
    rank: int
    world_size: int
    control: Any = None  # a gloo group without a short timeout: rank 0 starts each step (or stops) on it

    @property
    def main(self) -> bool:
        return self.rank == 0


_RANKS: Ranks | None = None


def init_ranks(timeout_s: float) -> Ranks | None:
    """The process group the launcher described (None for one process); collectives time out after
    `timeout_s`, except the wait of ranks > 0 for the next step."""
    global _RANKS
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    if _RANKS is None:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        # with CUDA, CPU tensors (FSDP2's CPU offload) go through gloo beside NCCL
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        control = dist.new_group(backend="gloo", timeout=timedelta(seconds=FOLLOWER_WAIT_S))
        _RANKS = Ranks(dist.get_rank(), dist.get_world_size(), control)
    return _RANKS


def shutdown() -> None:
    """Leave the process group at the end of a rank's work: a barrier (no rank exits while another
    still sends), then `destroy_process_group`. A gloo group left to the interpreter's exit can abort
    a rank ("terminate called without an active exception") after its work is done."""
    global _RANKS
    if _RANKS is not None and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        _RANKS = None


def current_ranks() -> Ranks | None:
    """This process's ranks once `init_ranks` has run (None in one process)."""
    return _RANKS


def broadcast(value: Any, group: Any = None) -> Any:
    """Rank 0's `value` on every rank (the others pass anything)."""
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def barrier(group: Any = None) -> None:
    dist.barrier(group=group)


def split_by_tokens(items: list, sizes: list[int], world_size: int) -> list[list]:
    """Items dealt to ranks balanced by size (largest first to the least loaded rank); each rank's
    share keeps the items' order. The same on every rank: it depends only on the sizes."""
    loads, shares = [0] * world_size, [[] for _ in range(world_size)]
    for index in sorted(range(len(items)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        loads[rank] += sizes[index]
        shares[rank].append(index)
    return [[items[i] for i in sorted(share)] for share in shares]


def max_over_ranks(value: int) -> int:
    return int(_reduce(torch.tensor([value], dtype=torch.long), dist.ReduceOp.MAX).item())


def _device(kind: str | None = None) -> torch.device:
    """Where a collective's tensors go: this rank's GPU when there is one (or `kind` says 'cuda'), else the CPU."""
    cuda = torch.cuda.is_available() if kind is None else kind == "cuda"
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def _reduce(t: torch.Tensor, op) -> torch.Tensor:
    moved = t.to(_device())
    dist.all_reduce(moved, op=op)
    return moved.cpu()


def any_over_ranks(flag: bool) -> bool:
    return bool(_reduce(torch.tensor([float(flag)]), dist.ReduceOp.MAX).item())


def reduce_totals(totals: dict[str, dict[str, float]], summed: tuple[str, ...], maxed: tuple[str, ...]):
    """Each agent's metric sums added and maxima taken over ranks (every rank has the same agents)."""
    out = {}
    for agent in sorted(totals):
        t = totals[agent]
        sums = _reduce(torch.tensor([t[k] for k in summed], dtype=torch.float64), dist.ReduceOp.SUM)
        maxima = _reduce(torch.tensor([t[k] for k in maxed], dtype=torch.float64), dist.ReduceOp.MAX)
        out[agent] = dict(zip(summed, sums.tolist())) | dict(zip(maxed, maxima.tolist()))
    return out


def all_reduce_gradients(model: torch.nn.Module) -> None:
    """Sum a replicated model's gradients over ranks (a rank without samples contributes zeros)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in params:
        if buckets[-1] and size + p.numel() > BUCKET_ELEMENTS:
            buckets.append([])
            size = 0
        buckets[-1].append(p.grad)
        size += p.numel()
    for bucket in (b for b in buckets if b):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat)
        for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
            g.copy_(part.view_as(g))


def shard(scorer: torch.nn.Module, device: torch.device, compute: torch.dtype | None, cpu_offload: bool):
    """FSDP2 over all ranks: one unit per decoder layer, one each for untied input and output matrices
    (a tied matrix, used first and last, stays in the root), the scorer the root; gradients summed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    from marsrl_core.learn.scoring import LOGPROBS_METHOD

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    options = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32 if compute else None),
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    }
    model = scorer.model
    for layer in model.get_decoder().layers:
        fully_shard(layer, **options)
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embeddings.weight is not head.weight:  # untied: each matrix is gathered only while it is used
        fully_shard(embeddings, **options)
        fully_shard(head, **options)
        register_fsdp_forward_method(head, LOGPROBS_METHOD)
    fully_shard(scorer, **options)
    for module in scorer.modules():
        if isinstance(module, FSDPModule):  # sum, not average: the loss is already normalised globally
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
    return scorer


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (itself unless it is sharded)."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathered from every rank when it is sharded (a collective), else itself."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def consolidated_state(
    model: torch.nn.Module, dtype: torch.dtype, main: bool, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """The whole state dict on rank 0, floating tensors in `dtype` (what the engines load), on `device`:
    gathered and cast one tensor at a time, so rank 0 holds the model in `dtype`, never in fp32. Every
    rank takes part in the gathers; the others get an empty dict. Tied tensors are gathered once."""
    state: dict[str, torch.Tensor] = {}
    seen: dict[int, torch.Tensor | None] = {}
    with torch.no_grad():
        for key, value in model.state_dict(keep_vars=True).items():
            if id(value) not in seen:
                whole = full(value.detach())
                cast = dtype if whole.is_floating_point() else None
                seen[id(value)] = whole.to(dtype=cast).to(device) if main else None
            if main:
                state[key] = seen[id(value)]
    return state


def fill_from_rank0(
    model: torch.nn.Module,
    device: torch.device,
    source: dict[str, torch.Tensor] | None,
    buffer_device: torch.device | None = None,
) -> None:
    """Give a sharded model built on the meta device (`engines.hf.empty_model`, then `shard`) its weights:
    every rank allocates its shards on `device` and receives them from rank 0, which alone holds the whole
    weights (`source`, a state dict on its CPU); each tensor is scattered from rank 0 (`distribute_tensor`)
    in turn, so no rank ever holds more than one whole tensor (accelerate's `cpu_ram_efficient_loading`).
    Buffers (rotary frequencies, real on the CPU) are kept, on `buffer_device` (default `device`; the
    compute device when FSDP2's CPU offload keeps the shards on the CPU). A key missing from `source`, or
    of another shape there, fails every rank."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    targets = model.state_dict(keep_vars=True)
    bad = None
    if source is not None:
        bad = [f"{k} (missing)" for k in targets if k not in source]
        bad += [f"{k} {tuple(source[k].shape)}, expected {tuple(t.shape)}" for k, t in targets.items() if k in source
                and tuple(source[k].shape) != tuple(t.shape)]  # fmt: skip
    bad = broadcast(bad)
    if bad:
        raise RuntimeError(f"the model folder does not fit the model: {len(bad)} tensors, e.g. {bad[0]}")
    done: set[int] = set()
    with torch.no_grad():
        for name, value in buffers.items():
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner)._buffers[leaf] = value.to(buffer_device or device)
        for key, target in targets.items():
            if id(target) in done:  # tied: the same tensor under another key
                continue
            done.add(id(target))
            where = _device(target.device_mesh.device_type) if isinstance(target, DTensor) else _device()
            if source is not None:  # rank 0's tensor goes out; the others' is only a buffer of its shape
                whole = source[key].to(where, target.dtype)
            else:
                whole = torch.empty(target.shape, dtype=target.dtype, device=where)
            if isinstance(target, DTensor):
                part = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=0)
                local(target).copy_(part.to_local())
            else:
                dist.broadcast(whole, src=0)
                target.copy_(whole)
