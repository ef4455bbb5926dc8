"""Checkpoint contents: policy weights in Hugging Face format plus the full trainer state, all safetensors.

Where the version folders live, which are durable and which are deleted is `checkpoint_folders.py`.
A checkpoint of version v holds one `save_pretrained` folder per policy and the trainer state: optimizer
tensors, the torch RNG and the fp32 master weights under mixed precision (the model folders hold
`model.dtype`) in `trainer_state.safetensors`, the rest (optimizer hyper-parameters,
scheduler state, Python RNG, step) in `trainer_state.json`. Nothing is ever unpickled.

A sharded (FSDP2) learner's checkpoint has the same model folders (the whole weights in `model.dtype`,
gathered by rank 0), and one `shard.rank<r>.safetensors` per rank with that rank's shards of the trained
parameters and of the AdamW state (`save_rank_shard`); `trainer_state.json` indexes them (`rank_files`,
one per rank). A resume reads only its own rank's file, so it needs the same number of ranks.

A durable version (every `learner.save_every` steps) holds all of the above; the versions between are
weights-only (the model folders alone, not fsynced), enough for the engines and an evaluation, not for
a resume. `save_version` writes either to a temporary folder and renames it into place when complete,
so a folder named `v<v>` is always whole. `add_trainer_state` makes a weights-only folder durable in
place (the learner's background write): the JSON goes last, so a folder is durable only once all of
it is on disk.

Deliberate simplification: the optimizer is flattened per parameter index; this supports AdamW (and
any optimizer whose state is tensors and numbers), which is all the learner uses.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from marsrl_core.faults import crash_point
from marsrl_core.learn.checkpoint_folders import (
    STATE_JSON,
    STATE_TENSORS,
    CheckpointError,
    version_folder,
)


def engine_state(model: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A copy of `model`'s state dict as its checkpoint folder holds it: floating tensors in `dtype`, on
    the model's device; tied tensors share one copy."""
    copies: dict[int, torch.Tensor] = {}
    state = {}
    with torch.no_grad():
        for key, tensor in model.state_dict().items():
            if tensor.data_ptr() not in copies:
                cast = dtype if tensor.is_floating_point() else None
                copies[tensor.data_ptr()] = tensor.detach().to(dtype=cast, copy=True)
            state[key] = copies[tensor.data_ptr()]
    return state


def save_version(
    root: Path,
    version: int,
    models: dict[str, Any],
    tokenizer: Any,
    save_dtype: torch.dtype,
    full_states: dict[str, dict[str, torch.Tensor]] | None = None,
    trainer: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None,
    rank_shards: int = 0,
) -> Path:
    """Version `<root>/v<version>`, written to a temporary folder and renamed into place when complete.

    The model folders hold the weights in `save_dtype` (what the engines load); a sharded learner's are
    its gathered `full_states`, already in that dtype. Without `trainer` that is all: a weights-only
    version, not fsynced (a crash voids it anyway: a resume restarts from the last durable one). With
    `trainer` (`trainer_state`'s tensors and meta) the version is durable: the trainer state beside the
    model folders (when the trained weights are of another dtype, fp32 masters under mixed precision,
    they are in it, so a resume restores them exactly), the `rank_shards` files of a sharded learner's
    ranks (`save_rank_shard`: their masters and AdamW state) moved in, and all of it fsynced before the
    rename."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = version_folder(root, version)
    tmp = root / f"tmp-v{version}-{uuid.uuid4().hex[:8]}"
    for name, model in models.items():
        if full_states is not None:
            _save_pretrained(model, tmp / name, full_states[name], save_dtype)
        else:
            _save_model(model, tmp / name, save_dtype)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / name)
    if trainer is not None and rank_shards:
        trainer[1]["rank_shards"] = rank_shards
        trainer[1]["rank_files"] = [_shard_file(rank) for rank in range(rank_shards)]  # the index: rank -> file
        shards = _shard_folder(root, version)
        for rank in range(rank_shards):
            shutil.move(shards / _shard_file(rank), tmp / _shard_file(rank))
        shutil.rmtree(shards)
    crash_point("checkpoint.write")
    if trainer is not None:
        save_file(trainer[0], str(tmp / STATE_TENSORS))
        (tmp / STATE_JSON).write_text(json.dumps(trainer[1]))
        _fsync_tree(tmp)  # on disk before the store commit that points at it
    if final.exists():  # a folder left by a step whose store commit never happened
        shutil.rmtree(final)
    os.replace(tmp, final)
    if trainer is not None:
        _fsync_dir(root)
    return final


def trainer_state(
    models: dict[str, Any],
    optimizers: dict[str, torch.optim.Optimizer],
    schedulers: dict[str, Any],
    step: int,
    save_dtype: torch.dtype | None,
    sharded: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The trainer state as (tensors, JSON meta). The RNG states and the optimizers' and schedulers'
    numbers are copied now; the tensors are the live ones, not copies (the trained weights where they
    are not in `save_dtype`, AdamW's moments), so they must not change until written. A sharded
    learner's tensors are in its rank files (`save_rank_shard`): here only the RNG."""
    tensors: dict[str, torch.Tensor] = {"rng.torch": torch.get_rng_state()}
    meta: dict[str, Any] = {"step": step, "python_rng": _jsonable(random.getstate()), "optimizers": {}}
    meta["schedulers"] = {
        name: {k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"} for name, sched in schedulers.items()
    }
    for name, opt in optimizers.items():
        meta["optimizers"][name] = _optimizer_meta(opt)
        if not sharded:
            tensors.update(_optimizer_tensors(name, opt))
    for name, model in models.items():
        params = dict(model.named_parameters())  # tied parameters once
        if not sharded and save_dtype is not None and any(p.dtype != save_dtype for p in params.values()):
            tensors.update({f"master.{name}.{key}": p.detach().contiguous() for key, p in params.items()})
    return tensors, meta


def add_trainer_state(folder: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """Make the weights-only version `folder` durable in place (`trainer_state`'s output beside its model
    folders): the tensors first, then everything fsynced, then the JSON, renamed into place, so that
    `is_durable` holds only once all of it is on disk. The learner's background writer runs this."""
    folder = Path(folder)
    save_file(tensors, str(folder / STATE_TENSORS))
    crash_point("checkpoint.durable")
    _fsync_tree(folder)
    tmp = folder / f"{STATE_JSON}.tmp"
    tmp.write_text(json.dumps(meta))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, folder / STATE_JSON)
    _fsync_dir(folder)
    return folder


def _optimizer_tensors(name: str, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """An optimizer's tensors (this rank's shards of sharded ones)."""
    from marsrl_core.learn.distributed import local

    return {
        f"opt.{name}.{index}.{key}": local(value).detach().cpu().contiguous()  # no copy on the CPU
        for index, entry in opt.state_dict()["state"].items()
        for key, value in entry.items()
        if torch.is_tensor(value)
    }


def _optimizer_meta(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer's JSON part: its hyper-parameters and its state's numbers."""
    state = opt.state_dict()
    scalars: dict[str, dict[str, Any]] = {}
    for index, entry in state["state"].items():
        for key, value in entry.items():
            if not torch.is_tensor(value):
                scalars.setdefault(str(index), {})[key] = value
    return {"param_groups": state["param_groups"], "scalars": scalars}


def _shard_folder(root: Path, version: int) -> Path:
    return Path(root) / f"tmp-v{version}-shards"


def _shard_file(rank: int) -> str:
    return f"shard.rank{rank}.safetensors"


def save_rank_shard(
    root: Path, version: int, rank: int, models: dict[str, Any], optimizers: dict[str, torch.optim.Optimizer]
) -> None:
    """A sharded learner's rank writes its shards of the trained parameters (fp32 masters under mixed
    precision) and of the AdamW state for version `version` (rank 0's `save_version` then moves every
    rank's file into the checkpoint)."""
    from marsrl_core.learn.distributed import local

    tensors = {}
    for name, model in models.items():
        for key, param in model.named_parameters():  # tied parameters once
            tensors[f"param.{name}.{key}"] = local(param).detach().cpu().contiguous()
    for name, opt in optimizers.items():
        tensors.update(_optimizer_tensors(name, opt))
    folder = _shard_folder(root, version)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / _shard_file(rank)))


def _save_model(model: Any, folder: Path, dtype: torch.dtype | None) -> None:
    """The model's Hugging Face folder in `dtype` (its trained weights as they are, if of that dtype)."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if dtype is None or all(p.dtype == dtype for p in model.parameters()):
        model.save_pretrained(folder, state_dict=state, safe_serialization=True)
        return
    _save_pretrained(model, folder, {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}, dtype)


def _save_pretrained(model: Any, folder: Path, state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> None:
    """`state` as a Hugging Face folder whose config says `dtype`."""
    saved_dtype = model.config.dtype
    model.config.dtype = dtype or saved_dtype
    try:
        model.save_pretrained(folder, state_dict=state, safe_serialization=True)
    finally:
        model.config.dtype = saved_dtype


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    for path in sorted(Path(folder).rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        else:
            _fsync_dir(path)
    _fsync_dir(folder)


def load_checkpoint(
    folder: Path,
    models: dict[str, Any],
    optimizers: dict[str, torch.optim.Optimizer],
    schedulers: dict[str, Any],
    rank: int | None = None,
    world_size: int = 1,
) -> int:
    """Restore weights, optimizers, schedulers and RNG from `folder`; returns the step. A sharded
    learner (`rank` set) reads only its own rank's file (its parameter and AdamW shards), which needs
    the world size the checkpoint was written with."""
    from marsrl_core.engines.hf import load_safetensors_state, read_safetensors

    folder = Path(folder)
    if not (folder / STATE_JSON).is_file() or not (folder / STATE_TENSORS).is_file():
        raise CheckpointError(f"checkpoint {str(folder)!r}: incomplete (no trainer state)")

    def read(file: str, parse: Callable[[Path], Any]) -> Any:
        try:
            return parse(folder / file)
        except Exception as err:  # a file cut short is named, not just its folder
            raise CheckpointError(f"checkpoint file {str(folder / file)!r} cannot be read ({err})") from None

    meta = read(STATE_JSON, lambda path: json.loads(path.read_text()))
    tensors = read(STATE_TENSORS, read_safetensors)
    if "optimizer_shards" in meta:
        raise CheckpointError(
            f"checkpoint {str(folder)!r}: a sharded checkpoint of an older layout (optimizer shards without "
            "parameter shards); it cannot be resumed, start the run from its model folder instead"
        )
    shards = meta.get("rank_shards", 0)
    if shards != (world_size if rank is not None else 0):
        written = f"a learner sharded over {shards} ranks" if shards else "an unsharded learner"
        reading = f"one sharded over {world_size} ranks" if rank is not None else "an unsharded one"
        raise CheckpointError(
            f"checkpoint {str(folder)!r}: written by {written}, resumed by {reading}; its optimizer state "
            f"cannot be resharded: resume with the same number of ranks and `learner.fsdp`"
        )
    if shards:
        try:
            tensors |= read_safetensors(folder / meta["rank_files"][rank])
        except Exception as err:
            raise CheckpointError(f"checkpoint {str(folder)!r}: rank {rank}'s shard cannot be read ({err})") from None
    for name, model in models.items():
        if shards:
            _load_shards(model, _prefixed(tensors, f"param.{name}."), folder)
            continue
        try:
            state = load_safetensors_state(folder / name)
        except Exception as err:
            raise CheckpointError(f"checkpoint {str(folder / name)!r}: {err}") from None
        _load_weights(model, state | _prefixed(tensors, f"master.{name}."))
    for name, opt in optimizers.items():
        saved = meta["optimizers"][name]
        state: dict[int, dict[str, Any]] = {}
        for key, value in tensors.items():
            match = re.fullmatch(rf"opt\.{re.escape(name)}\.(\d+)\.(.+)", key)
            if match:
                state.setdefault(int(match.group(1)), {})[match.group(2)] = value
        for index, scalars in saved["scalars"].items():
            state.setdefault(int(index), {}).update(scalars)
        opt.load_state_dict({"state": _as_sharded(state, opt), "param_groups": saved["param_groups"]})
    for name, sched in schedulers.items():
        sched.load_state_dict(meta["schedulers"][name] | {"lr_lambdas": [None] * len(sched.lr_lambdas)})
    torch.set_rng_state(tensors["rng.torch"])
    random.setstate(_tupled(meta["python_rng"]))
    return int(meta["step"])


def _prefixed(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors whose names start with `prefix`, under the rest of their names."""
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def _load_weights(model: Any, state: dict[str, torch.Tensor]) -> None:
    """Whole weights into a model."""
    with torch.no_grad():
        for key, param in model.state_dict(keep_vars=True).items():
            if key in state:
                param.copy_(state[key])


def _load_shards(model: Any, shards: dict[str, torch.Tensor], folder: Path) -> None:
    """This rank's saved shards into a sharded model's parameters (tied ones under one name)."""
    from marsrl_core.learn.distributed import local

    with torch.no_grad():
        for key, param in model.named_parameters():
            mine = local(param)
            if key not in shards or shards[key].shape != mine.shape:
                found = tuple(shards[key].shape) if key in shards else "nothing"
                raise CheckpointError(
                    f"checkpoint {str(folder)!r}: parameter {key} holds {found} for this rank, "
                    f"expected {tuple(mine.shape)}"
                )
            mine.copy_(shards[key])


def _as_sharded(state: dict[int, dict[str, Any]], opt: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """Optimizer tensors read from a shard file, as DTensors shaped like their sharded parameters."""
    from torch.distributed.tensor import DTensor

    params = [p for group in opt.param_groups for p in group["params"]]
    for index, entry in state.items():
        param = params[index]
        if isinstance(param, DTensor):
            for key, value in entry.items():
                if torch.is_tensor(value) and value.shape == param.to_local().shape and value.dim():
                    entry[key] = DTensor.from_local(  # the global shape: a dimension may not split evenly
                        value.to(param.device), param.device_mesh, param.placements, shape=param.shape,
                        stride=param.stride(),
                    )  # fmt: skip
    return state


def _jsonable(value: Any) -> Any:
    return [_jsonable(v) for v in value] if isinstance(value, (tuple, list)) else value


def _tupled(value: Any) -> Any:
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value
