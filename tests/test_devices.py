"""Devices and precision: `model.device`, bf16 compute over fp32 master weights, and what the
checkpoints hold. GPU-only checks carry the `gpu` marker (skipped without CUDA)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from marsrl_core.config import ConfigError, load_config
from marsrl_core.demo.sft import _key, find_warm_start
from marsrl_core.demo.tiny import build_tiny_model
from marsrl_core.devices import compute_dtype, learner_gpus, master_dtype, resolve_device
from marsrl_core.engines.hf import HFEngine, load_safetensors_state
from marsrl_core.learn.learner import Learner
from marsrl_core.runtime.work import _sync_from_memory
from marsrl_core.store import SegmentStore
from tests.rollout_helpers import digit_fraction, sample_groups

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), max_position_embeddings=128, seed=0)


def _cfg(tmp_path, *overrides):
    return load_config(
        "tiny",
        None,
        [f"store.catalog_url=sqlite:{tmp_path}/lake.sqlite", f"store.data_path={tmp_path}/data", *overrides],
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_asking_for_cuda_without_it_is_a_config_error_naming_the_field():
    assert resolve_device("auto") == torch.device("cpu")
    for spec in ("cuda", "cuda:1"):
        with pytest.raises(ConfigError, match=rf"model.device='{spec}': CUDA is not available"):
            resolve_device(spec)
    with pytest.raises(ConfigError, match="model.device"):
        load_config("tiny", None, ["model.device=tpu"])


def test_a_numbered_gpu_in_a_process_of_several_ranks_is_a_config_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"model.device='cuda:1': a learner of several ranks puts each rank"):
        resolve_device("cuda:1")


def test_memory_weight_sync_into_tensor_parallel_vllm_is_a_config_error():
    with pytest.raises(ConfigError, match=r"weight_sync='memory' with tensor_parallel_size=2"):
        load_config("tiny", None, ["engine.name=vllm", "engine.tensor_parallel_size=2", "engine.weight_sync=memory"])
    on_gpu = SimpleNamespace(ranks=None, device=torch.device("cuda", 0))  # where the learner is is all it reads
    assert _sync_from_memory(load_config("tiny", None, ["engine.name=vllm"]), on_gpu)
    auto = load_config("tiny", None, ["engine.name=vllm", "engine.tensor_parallel_size=2"])
    assert not _sync_from_memory(auto, on_gpu)  # auto: the folder


def test_a_learner_beside_the_rollouts_gets_the_last_gpus_and_the_engine_keeps_the_first():
    assert learner_gpus(4, "auto", count=8) == "4,5,6,7"
    assert learner_gpus(2, "auto", visible="2,3,5", count=3) == "3,5"  # the user's own selection, narrowed
    assert learner_gpus(1, "auto", count=2) == "1"
    assert learner_gpus(2, "auto", count=2) is None  # no spare GPU: rank 0 shares GPU 0 with the engine
    assert learner_gpus(2, "auto", count=0) is None  # the CPU
    assert learner_gpus(2, "cuda:3", count=8) is None  # a device the user named is left alone
    if not torch.cuda.is_available():
        assert learner_gpus(2, "auto") is None


def test_where_a_model_runs_does_not_change_the_warm_start_it_uses():
    cfg = load_config("tiny", None, [])
    moved = load_config("tiny", None, ["model.device=cpu", "model.attn_implementation=eager"])
    assert _key(cfg) == _key(moved)
    assert find_warm_start(cfg) is not None  # the committed warm start of `make train`


def test_mixed_precision_follows_the_model_dtype_unless_set():
    assert compute_dtype(load_config("tiny", None, [])) is None
    bf16 = load_config("tiny", None, ["model.dtype=bfloat16"])
    assert compute_dtype(bf16) == torch.bfloat16 and master_dtype(bf16) == torch.float32
    pure = load_config("tiny", None, ["model.dtype=bfloat16", "learner.mixed_precision=native"])
    assert compute_dtype(pure) is None and master_dtype(pure) == torch.bfloat16


def _one_step(cfg, folder, tmp_path, run):
    store = SegmentStore.from_config(cfg.store)
    engine = HFEngine.from_pretrained(folder)
    learner = Learner(cfg, store, run, folder, tmp_path / f"ckpt-{run}", engine.tokenizer)
    before = {k: v.detach().float().clone() for k, v in learner.models["policy"].named_parameters()}
    groups = sample_groups(engine, store, run, "solver", "S|", groups=2, size=4, seed=3, reward_fn=digit_fraction)
    report = learner.train_step(groups)
    after = dict(learner.models["policy"].named_parameters())
    changed = sum(int((after[k].detach().float() != v).sum()) for k, v in before.items())
    return learner, report, changed / sum(v.numel() for v in before.values())


def test_a_tiny_step_changes_a_bf16_model_through_its_fp32_master_weights(folder, tmp_path):
    durable = "learner.save_every=1"  # the step's version is a durable checkpoint, with the masters
    mixed, report, changed = _one_step(
        _cfg(tmp_path, "model.dtype=bfloat16", "learner.learning_rate=1e-6", durable), folder, tmp_path, "mixed"
    )
    assert next(mixed.models["policy"].parameters()).dtype == torch.float32
    _, _, changed_pure = _one_step(
        _cfg(tmp_path, "model.dtype=bfloat16", "learner.learning_rate=1e-6", "learner.mixed_precision=native"),
        folder,
        tmp_path,
        "pure",
    )
    # AdamW's first step moves every weight by ~lr = 1e-6: below half a bf16 ulp for almost every weight.
    print(f"weights changed by a 1e-6 step: fp32 masters {changed:.3f}, bf16 weights {changed_pure:.3f}")
    assert changed > 0.9 and changed_pure < 0.1
    # The checkpoint the engines load is bf16; the masters it carries restore the fp32 weights exactly.
    state = load_safetensors_state(report.checkpoint / "policy")
    assert {v.dtype for v in state.values()} == {torch.bfloat16}
    assert HFEngine.from_pretrained(report.checkpoint / "policy", dtype="bfloat16").model.dtype == torch.bfloat16
    mixed.wait_for_durable()  # its trainer state is written in the background (`learner.async_save`)
    cfg = _cfg(tmp_path, "model.dtype=bfloat16", "learner.learning_rate=1e-6", durable)
    resumed = Learner(cfg, SegmentStore.from_config(cfg.store), "mixed", folder, tmp_path / "ckpt-mixed")
    assert resumed.resume() == 1
    for (name, a), b in zip(mixed.models["policy"].named_parameters(), resumed.models["policy"].parameters()):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b), name


def test_the_weights_an_engine_takes_from_memory_are_the_committed_checkpoints(folder, tmp_path):
    """`engine.weight_sync=memory`: what the learner hands an in-process engine is bit for bit the
    version's checkpoint (bf16 from the fp32 masters), one copy for tied tensors, and the learner's
    next step leaves it as it was."""
    cfg = _cfg(tmp_path, "model.dtype=bfloat16", "learner.learning_rate=1e-3")
    learner, report, _ = _one_step(cfg, folder, tmp_path, "memory")
    weights = learner.state_dict("solver")
    saved = load_safetensors_state(report.checkpoint / "policy")
    assert set(saved) <= set(weights) and all(torch.equal(weights[k], saved[k]) for k in saved)
    assert {v.dtype for v in weights.values()} == {torch.bfloat16}
    live = {p.data_ptr() for p in learner.models["policy"].parameters()}
    assert not live & {v.data_ptr() for v in weights.values()}  # copies, not the training tensors
    ties = learner.models["policy"].config.tie_word_embeddings
    assert ties == (weights["lm_head.weight"] is weights["model.embed_tokens.weight"])
    kept = {k: v.clone() for k, v in weights.items()}
    engine = HFEngine.from_pretrained(folder, dtype="bfloat16")
    groups = sample_groups(
        engine, learner.store, "memory", "solver", "S|", groups=2, size=4, seed=4, reward_fn=digit_fraction
    )
    learner.train_step(groups)
    assert all(torch.equal(weights[k], kept[k]) for k in kept)
    engine.update_weights(report.step, weights)  # loads into an engine of the model's dtype
    assert all(torch.equal(engine.model.state_dict()[k], saved[k]) for k in saved)


def test_gradient_checkpointing_with_mixed_precision_gives_the_same_update(folder, tmp_path):
    base = ("model.dtype=bfloat16", "learner.learning_rate=1e-3")
    plain, _, _ = _one_step(_cfg(tmp_path, *base), folder, tmp_path, "plain")
    recomputed, _, _ = _one_step(_cfg(tmp_path, *base, "learner.gradient_checkpointing=true"), folder, tmp_path, "gc")
    for (name, a), b in zip(plain.models["policy"].named_parameters(), recomputed.models["policy"].parameters()):
        assert torch.allclose(a, b, atol=1e-6), name


@pytest.mark.gpu
@cuda
def test_the_learner_and_the_hf_engine_run_on_cuda(folder, tmp_path):
    cfg = _cfg(tmp_path, "model.dtype=bfloat16", "model.device=cuda", "learner.tis_cap=2.0")
    store = SegmentStore.from_config(cfg.store)
    engine = HFEngine.from_pretrained(folder, dtype="bfloat16", device="cuda")
    learner = Learner(cfg, store, "gpu", folder, tmp_path / "ckpt-gpu", engine.tokenizer)
    assert next(learner.models["policy"].parameters()).device.type == "cuda"
    groups = sample_groups(engine, store, "gpu", "solver", "S|", groups=2, size=4, reward_fn=digit_fraction)
    report = learner.train_step(groups)
    assert report.metrics["solver"]["peak_memory_gb"] > 0
    engine.update_weights(report.step, learner.state_dict("solver"))
