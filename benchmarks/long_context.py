"""Learner throughput on long, uneven samples: padding-free micro-batches against padded ones.

A step's samples have log-normal lengths whose median is about an eighth of the longest, as reasoning
models' outputs do. Both layouts cut them into micro-batches of at most `--budget` real tokens with the
learner's own `agent_loss.pack`, build them with `scoring.PackedBatch` and run the learner's forward
(`scoring.TokenScorer`: chunked log-probs) and a backward of the summed log-probs, on the same model
and samples, alternating the layouts `--repeats` times. Padded: right-padded rows with an attention
mask and transformers' sdpa. Padding free: one row per micro-batch and the learner's per-sequence
kernel (`learn/attention.py`). It reports real tokens per second of each and their ratio.

Writes benchmarks/results/long_context.json: `packed_vs_padded_tokens_per_s` (the median of the
per-repeat ratios), the tokens/s of each, the padded layout's share of padding, and the setting.
Run: `python benchmarks/long_context.py` (a few minutes on 2 CPU cores).

Deliberate simplification: the model is a small Llama-style one (by default 4 layers of width 256) on
the CPU; what it shows is the padding a layout runs and the attention it computes, not a GPU's speed.
Sequence parallelism's memory is not measured here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import print_rows, write_results  # noqa: E402

PROMPT_TOKENS = 64


def samples(count: int, longest: int, seed: int) -> list[SimpleNamespace]:
    """`count` samples (a 64-token prompt, a log-normal response) whose median length is about an
    eighth of `longest`; the first is the longest."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(longest / 8), 0.9, count), 16, longest - PROMPT_TOKENS).astype(int)
    lengths[0] = longest - PROMPT_TOKENS
    return [
        SimpleNamespace(
            sample=SimpleNamespace(prompt_tokens=rng.integers(5, 90, PROMPT_TOKENS), token_ids=rng.integers(5, 90, n))
        )
        for n in lengths
    ]


def tokens(item: SimpleNamespace) -> int:
    return len(item.sample.prompt_tokens) + len(item.sample.token_ids)


def step(scorer, batches, padding_free: bool) -> float:
    """Seconds for one forward and backward over `batches`."""
    from marsrl_core.learn.scoring import PackedBatch

    start = time.perf_counter()
    for batch in batches:
        packed = PackedBatch.build(
            [i.sample.prompt_tokens for i in batch],
            [i.sample.token_ids for i in batch],
            torch.device("cpu"),
            padding_free,
        )
        logprobs, _ = scorer(packed)
        logprobs.sum().backward()
    return time.perf_counter() - start


def main() -> None:
    from transformers import AutoModelForCausalLM

    from marsrl_core.demo.tiny import build_tiny_model
    from marsrl_core.learn.agent_loss import pack
    from marsrl_core.learn.attention import VARLEN_SDPA
    from marsrl_core.learn.scoring import TokenScorer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--longest", type=int, default=4096, help="The longest sample's tokens.")
    parser.add_argument("--budget", type=int, default=8192, help="Real tokens per micro-batch.")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    items = samples(args.samples, args.longest, seed=0)
    batches = pack(items, args.budget)
    real = sum(tokens(i) for i in items)
    padded = sum(len(b) * max(tokens(i) for i in b) for b in batches)
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_model(
            tmp, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.hidden // 64,
            max_position_embeddings=args.longest,
        )  # fmt: skip
        scorers = {
            free: TokenScorer(
                AutoModelForCausalLM.from_pretrained(folder, attn_implementation=VARLEN_SDPA if free else "sdpa"),
                1024,
                1.0,
            )
            for free in (False, True)
        }
        for free in (False, True):  # warm-up
            step(scorers[free], batches[-1:], free)
        seconds: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):
            for free in (False, True):
                seconds[free].append(step(scorers[free], batches, free))
    ratios = [p / f for p, f in zip(seconds[False], seconds[True])]
    figures = {
        "packed_vs_padded_tokens_per_s": statistics.median(ratios),
        "packed_tokens_per_s": real / statistics.median(seconds[True]),
        "padded_tokens_per_s": real / statistics.median(seconds[False]),
        "padding_fraction_padded": 1 - real / padded,
        "ratios": ratios,
        "samples": args.samples,
        "longest": args.longest,
        "median_length": int(np.median([tokens(i) for i in items])),
        "micro_batches": len(batches),
        "budget": args.budget,
        "model": {"hidden": args.hidden, "layers": args.layers},
    }
    print_rows(
        f"learner forward+backward: {args.samples} samples, longest {args.longest}, {len(batches)} micro-batches",
        ["layout", "tokens/s", "s per pass (median)"],
        [
            ["padded (sdpa, mask)", figures["padded_tokens_per_s"], statistics.median(seconds[False])],
            ["padding free (sdpa per sequence)", figures["packed_tokens_per_s"], statistics.median(seconds[True])],
        ],
    )
    print(
        f"packed vs padded tokens/s: {figures['packed_vs_padded_tokens_per_s']:.2f}x "
        f"(padding in the padded layout: {figures['padding_fraction_padded']:.0%})"
    )
    print(f"written to {write_results('long_context', figures)}")


if __name__ == "__main__":
    main()
