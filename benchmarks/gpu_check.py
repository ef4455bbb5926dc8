"""The GPU check: the learner's update and the `hf` engine on one CUDA device, for a model shaped
like Qwen2.5-0.5B built from a config (random weights: they do not change speed or memory).

Runs on a bare machine (torch, transformers, safetensors, numpy): it imports only the project modules
that need nothing else (`learn.scoring`, `learn.algorithms`, `learn.distributed`, `engines.hf`), so
neither pydantic, Prefect, DuckDB nor MLflow has to be installed. What it measures:
- the learner step as `Learner` runs it sharded: fp32 master weights and AdamW state, FSDP2
  (`distributed.shard`) on a one-GPU NCCL group computing in bf16 and reducing gradients in fp32,
  gradient checkpointing, chunked log-probs (`TokenScorer`), the PPO loss, clipping, AdamW; one
  sequence of 4K, 16K and 64K tokens: train tokens/s and peak GPU memory per length;
- the same step on a padding-free row of 64K tokens in eight sequences of uneven lengths
  (`learner.padding_free`: the per-sequence kernel of `learn/attention.py`, or FlashAttention-2's
  varlen kernel where `flash_attn` is installed), with Ulysses sequence parallelism over the ranks
  when it is started by `torchrun --nproc-per-node N` (`learn/sequence_parallel.py`; one rank: N=1);
- the `hf` engine decoding a batch (bf16, sdpa): decode tokens/s;
- the weight copy from the learner into the engine: gathering the sharded fp32 weights and casting
  them to bf16 on the GPU (`distributed.consolidated_state`), then loading them into the engine in
  place (`update_weights` with a state dict), in seconds.

Run: `bash benchmarks/gpu_check.sh` (under 8 minutes on one H100/H200-class GPU); on N GPUs,
`torchrun --nproc-per-node N benchmarks/gpu_check.py --packed` runs the packed step alone (writes
gpu_packed.json). Writes
benchmarks/results/gpu.json (or $OUT/gpu.json when OUT is set). `--smoke` runs the same code on the CPU
with a small model and short sequences (gloo), as a test of the script, and writes nothing.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from marsrl_core.engines.base import SamplingParams, SegmentRequest  # noqa: E402
from marsrl_core.engines.hf import HFEngine  # noqa: E402
from marsrl_core.learn import distributed  # noqa: E402
from marsrl_core.learn.algorithms import policy_loss  # noqa: E402
from marsrl_core.learn.scoring import PackedBatch, TokenScorer  # noqa: E402

QWEN25_05B = {  # Qwen2.5-0.5B's config.json shape
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 65536 + 1024,
    "tie_word_embeddings": True,
    "rope_theta": 1000000.0,
}
SMOKE = QWEN25_05B | {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
SMOKE |= {"num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 2048}


def build(shape: dict, device: torch.device, dtype: torch.dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**shape)
    config._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(config).to(device=device, dtype=dtype)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def learner_step(
    scorer, optimizer, lengths: list[int], vocab: int, device: torch.device, free: bool = False, prompt: int = 512
) -> dict:
    """One update on sequences of `lengths` tokens (`prompt` of them the prompt), one padding-free row
    when `free`; tokens/s and peak memory."""
    generator = torch.Generator().manual_seed(sum(lengths))
    seqs = [torch.randint(0, vocab, (length,), generator=generator).numpy() for length in lengths]
    batch = PackedBatch.build([t[:prompt] for t in seqs], [t[prompt:] for t in seqs], device, free)
    n = max(batch.lengths)
    rows = len(lengths)
    behaviour = torch.full((rows, n), -float(torch.log(torch.tensor(vocab))), device=device)
    mask = torch.zeros(rows, n, device=device)
    for row, count in enumerate(batch.lengths):
        mask[row, :count] = 1.0
    length = sum(lengths)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    start = time.perf_counter()
    logprobs, _ = scorer(batch)
    out = policy_loss(
        logprobs,
        behaviour,
        torch.ones(rows, device=device),
        mask,
        token_normalizer=float(mask.sum()),
        sequence_normalizer=float(rows),
        tis_cap=2.0,  # the importance-sampling path (decoupled PPO's form) on the device too
    )
    out.loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(scorer.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync(device)
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    norm = float(distributed.full(norm))
    return {
        "tokens": length,
        "sequences": rows,
        "train_tokens_per_s": length / elapsed,
        "step_s": elapsed,
        "peak_gb": peak,
        "grad_norm": norm,
    }


def packed_step(scorer, optimizer, shape: dict, device: torch.device, smoke: bool) -> dict:
    """The learner step on one padding-free row (64K tokens; 2K in the smoke run) of eight sequences,
    the longest half of it, each with a prompt of half the shortest one, with sequence parallelism over
    all ranks: `scorer` is already sharded over them; its model's attention is switched to the
    padding-free kernel (Ulysses-wrapped on several ranks)."""
    from marsrl_core.learn.attention import VARLEN_SDPA
    from marsrl_core.learn.sequence_parallel import ULYSSES, SequenceGroup, check_heads

    total = 2048 if smoke else 65536
    lengths = [total // 2, total // 4, total // 8, total // 16, total // 32, total // 64, total // 128]
    lengths.append(total - sum(lengths))
    kernel = VARLEN_SDPA
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401

            kernel = "flash_attention_2"
        except ImportError:
            pass
    ranks = dist.get_world_size()
    if ranks > 1:
        check_heads(scorer.model.config, ranks)
        scorer.sequence = SequenceGroup.form(SimpleNamespace(rank=dist.get_rank(), world_size=ranks), ranks)
        kernel = ULYSSES + kernel
    scorer.model.config._attn_implementation = kernel
    row = learner_step(scorer, optimizer, lengths, shape["vocab_size"], device, free=True, prompt=min(lengths) // 2)
    row |= {"kernel": kernel, "sequence_parallel": ranks}
    if dist.get_rank() == 0:
        print(
            f"learner packed {total} tokens in {len(lengths)} sequences (sequence_parallel={ranks}, {kernel}): "
            f"{row['train_tokens_per_s']:,.0f} tokens/s, {row['step_s']:.2f} s, peak {row['peak_gb'] or 0:.1f} GB"
        )
    return row


def main_packed(smoke: bool) -> dict:
    """The packed step alone, on every rank torchrun started (one GPU each)."""
    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available() and not smoke
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    shape = SMOKE if smoke else QWEN25_05B
    model = build(shape, device, torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    scorer = distributed.shard(TokenScorer(model.train(), 4096, 1.0), device, torch.bfloat16, cpu_offload=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    figures = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "model": shape, "ranks": world}
    figures["packed"] = packed_step(scorer, optimizer, shape, device, smoke)
    dist.destroy_process_group()
    return figures


def decode(engine: HFEngine, batch: int, prompt: int, new: int, vocab: int) -> dict:
    generator = torch.Generator().manual_seed(1)
    requests = [
        SegmentRequest(
            torch.randint(0, vocab - 2, (prompt,), generator=generator).tolist(), (), new, SamplingParams(1.0, seed=i)
        )
        for i in range(batch)
    ]
    engine.decode_segment(requests[:2])  # warm-up (kernels, allocator)
    sync(engine.device)
    start = time.perf_counter()
    results = engine.decode_segment(requests)
    sync(engine.device)
    elapsed = time.perf_counter() - start
    return {
        "batch": batch,
        "prompt_tokens": prompt,
        "new_tokens": new,
        "decode_tokens_per_s": sum(len(r.token_ids) for r in results) / elapsed,
    }


def main(smoke: bool) -> dict:
    cuda = torch.cuda.is_available() and not smoke
    if not cuda and not smoke:
        raise SystemExit("gpu_check: no CUDA device (use --smoke to run the script on the CPU)")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    shape = SMOKE if smoke else QWEN25_05B
    lengths = (1024, 2048) if smoke else (4096, 16384, 65536)
    figures: dict = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "model": shape}
    figures |= {"torch": torch.__version__}

    model = build(shape, device, torch.float32)  # fp32 master weights
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    scorer = distributed.shard(TokenScorer(model.train(), 4096, 1.0), device, torch.bfloat16, cpu_offload=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    figures["parameters_m"] = sum(p.numel() for p in model.parameters()) / 1e6
    figures["learner"] = []
    for length in lengths:
        row = learner_step(scorer, optimizer, [length], shape["vocab_size"], device)
        print(
            f"learner {length:>6} tokens: {row['train_tokens_per_s']:,.0f} tokens/s, "
            f"{row['step_s']:.2f} s, peak {row['peak_gb'] or 0:.1f} GB"
        )
        figures["learner"].append(row)
    figures["packed"] = packed_step(scorer, optimizer, shape, device, smoke)

    engine_model = build(shape, device, torch.bfloat16).eval()
    engine_model.config.use_cache = True
    engine = HFEngine(
        engine_model, SimpleNamespace(eos_token_id=shape["vocab_size"] - 1, pad_token_id=shape["vocab_size"] - 2)
    )
    sync(device)
    start = time.perf_counter()
    state = distributed.consolidated_state(model, torch.bfloat16, main=True, device=device)  # whole, bf16, on the GPU
    engine.update_weights(1, state)
    sync(device)
    figures["weight_copy_s"] = time.perf_counter() - start
    print(f"weight copy learner -> engine: {figures['weight_copy_s']:.2f} s")
    figures["decode"] = decode(
        engine, 8 if smoke else 64, 64 if smoke else 512, 16 if smoke else 256, shape["vocab_size"]
    )
    print(f"decode: {figures['decode']['decode_tokens_per_s']:,.0f} tokens/s at batch {figures['decode']['batch']}")
    dist.destroy_process_group()
    return figures


if __name__ == "__main__":
    smoke = "--smoke" in sys.argv
    figures = main_packed(smoke) if "--packed" in sys.argv else main(smoke)
    if not smoke and int(os.environ.get("RANK", "0")) == 0:
        out = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).with_name("results")
        out.mkdir(parents=True, exist_ok=True)
        path = out / ("gpu_packed.json" if "--packed" in sys.argv else "gpu.json")
        path.write_text(json.dumps(figures, indent=2))
        print(f"wrote {path}")
