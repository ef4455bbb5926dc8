"""Engine benchmark: hf tokens/s at batch 1/8/32, batched vs one request at a time, on the tiny model;
weight-update time. Run: `python benchmarks/engine_bench.py`.

Writes benchmarks/results/engine.json with hf_tokens_per_s (per batch size, batched),
hf_sequential_tokens_per_s, hf_batched_speedup_b32, hf_weight_update_s. The vLLM figures
(vllm_startup_s, vllm_weight_update_s) are null until the vLLM engine exists.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

from benchmarks.common import print_rows, write_results  # noqa: E402
from marsrl_core.engines.base import SamplingParams, SegmentRequest  # noqa: E402
from marsrl_core.engines.hf import HFEngine  # noqa: E402
from marsrl_core.tiny import build_tiny_model  # noqa: E402

NEW_TOKENS = 64


def tokens_per_s(engine: HFEngine, batch: int, batched: bool) -> float:
    prompts = [engine.tokenizer(f"S|{i % 10}+{(i * 7) % 10}+3|", add_special_tokens=False)["input_ids"]
               for i in range(batch)]
    requests = [SegmentRequest(p, (), NEW_TOKENS, SamplingParams(temperature=1.0, seed=i)) for i, p in enumerate(prompts)]
    engine.eos_id = -1  # decode the full segment every time, so both sides decode the same count
    start = time.perf_counter()
    if batched:
        results = engine.decode_segment(requests)
    else:
        results = [engine.decode_segment([r])[0] for r in requests]
    elapsed = time.perf_counter() - start
    return sum(len(r.token_ids) for r in results) / elapsed


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_model(Path(tmp) / "tiny", max_position_embeddings=256)
        engine = HFEngine.from_pretrained(folder)
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
    figures["hf_batched_speedup_b32"] = rows[-1][3]
    figures["vllm_startup_s"] = None
    figures["vllm_weight_update_s"] = None
    print_rows(f"hf engine, tiny model, {NEW_TOKENS} new tokens per request",
               ["batch", "batched tokens/s", "one at a time tokens/s", "speed-up"], rows)
    print(f"in-place weight update from a state dict: {figures['hf_weight_update_s'] * 1000:.1f} ms")
    print(f"wrote {write_results('engine', figures)}")


if __name__ == "__main__":
    main()
