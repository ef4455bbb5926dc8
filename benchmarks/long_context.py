"""Learner throughput on long, uneven samples: padding-free micro-batches against padded ones.

A step's samples have log-normal lengths whose median is about an eighth of the longest, as reasoning
models' outputs do. Both layouts cut them into micro-batches of at most `--budget` real tokens with the
learner's own `agent_loss.pack`, build them with `scoring.PackedBatch` and run the learner's forward
(`scoring.TokenScorer`: chunked log-probs) and a backward of the summed log-probs, on the same model
and samples, alternating the layouts `--repeats` times. Padded: right-padded rows with an attention
mask and transformers' sdpa. Padding free: one row per micro-batch and the learner's per-sequence
kernel (`learn/attention.py`). It reports real tokens per second of each and their ratio.

Sequence parallelism's memory: one sequence of each of `--sp-lengths` tokens through a forward and a
backward, on one process (`sequence_parallel=1`) and on two gloo ranks (`sequence_parallel=2`,
`learn/sequence_parallel.py`), each in fresh processes. Per rank it measures the peak resident memory
the step added (the process's high-water mark, reset just before the step, less its resident memory
then: the activations, attention's working memory, the all-to-all buffers and the gradients; glibc's
malloc maps each allocation past 64 kB on its own, so that freed tensors leave the resident set, as a
GPU's `max_memory_allocated` counts live tensors only) and the bytes of
the tensors autograd held for backward at the end of the forward (the activations alone).

Writes benchmarks/results/long_context.json: `packed_vs_padded_tokens_per_s` (the median of the
per-repeat ratios), the tokens/s of each, the padded layout's share of padding, the setting, and
`sp2_vs_sp1_peak_ratio_<K>k` (rank 0's step peak with two ranks over one process's) with the measures
behind it under `sequence_parallel`. Run: `python benchmarks/long_context.py` (about 10 minutes on 2 CPU
cores; `--sp-lengths` with no value skips the memory part).

Deliberate simplifications: the models are small Llama-style ones on the CPU (4 layers of width 256 for
throughput; 2 layers of width 128, two heads, for the long sequences, whose attention dominates a CPU's
time); what they show is the padding a layout runs, the attention it computes and how memory divides
over ranks, not a GPU's speed.
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


def _status_kb(field: str) -> int:
    """A field of this process's /proc/self/status, in kB (VmRSS: resident now; VmHWM: its high-water mark)."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1])


def _sp_rank(rank: int, size: int, port: int, folder: str, length: int, out: str) -> None:
    """One rank of a sequence-parallel step on one sequence of `length` tokens (or one process, size 1):
    its step peak and saved activations, written to `out`-RANK.json."""
    import json
    import os
    from types import SimpleNamespace

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from marsrl_core.learn.attention import VARLEN_SDPA
    from marsrl_core.learn.scoring import PackedBatch, TokenScorer
    from marsrl_core.learn.sequence_parallel import ULYSSES, SequenceGroup

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    sequence = None
    if size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
        sequence = SequenceGroup.form(SimpleNamespace(rank=rank, world_size=size), size)
    attention = ULYSSES + VARLEN_SDPA if size > 1 else VARLEN_SDPA
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attention)
    scorer = TokenScorer(model, 1024, 1.0, sequence)
    rng = np.random.default_rng(0)
    batch = PackedBatch.build(
        [rng.integers(5, 90, PROMPT_TOKENS)], [rng.integers(5, 90, length - PROMPT_TOKENS)], torch.device("cpu"), True
    )
    saved: dict[int, int] = {}

    def pack_hook(t: torch.Tensor):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    Path("/proc/self/clear_refs").write_text("5")  # Linux: the high-water mark restarts from what is resident
    before = _status_kb("VmRSS")
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        logprobs, _ = scorer(batch)
    logprobs.sum().backward()
    seconds = time.perf_counter() - start
    peak = _status_kb("VmHWM")
    figures = {"step_peak_mb": (peak - before) / 1024, "saved_activations_mb": sum(saved.values()) / 2**20}
    Path(f"{out}-{rank}.json").write_text(json.dumps(figures | {"seconds": seconds}))
    if size > 1:
        dist.destroy_process_group()


def sequence_parallel_memory(lengths: list[int], folder: Path, tmp: Path) -> dict:
    """Rank 0's step peak and saved activations, one process against two ranks, per length."""
    import json
    import os
    import socket

    import torch.multiprocessing as mp

    # glibc's malloc maps every allocation past 64 kB on its own, so a freed tensor leaves the resident set
    # and the high-water mark is what the tensors held (by default freed memory stays in malloc's heap)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    out: dict = {}
    for length in lengths:
        for size in (1, 2):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            stem = tmp / f"sp{size}-{length}"
            mp.spawn(_sp_rank, args=(size, port, str(folder), length, str(stem)), nprocs=size, join=True)
            out[f"sp{size}_{length // 1024}k"] = json.loads(Path(f"{stem}-0.json").read_text())
        one, two = out[f"sp1_{length // 1024}k"], out[f"sp2_{length // 1024}k"]
        out[f"ratio_{length // 1024}k"] = two["step_peak_mb"] / one["step_peak_mb"]
        out[f"saved_ratio_{length // 1024}k"] = two["saved_activations_mb"] / one["saved_activations_mb"]
    return out


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
    parser.add_argument(
        "--sp-lengths", type=int, nargs="*", default=[32768, 65536], help="Sequence parallelism's sequences."
    )
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
        sp_figures = {}
        if args.sp_lengths:
            long_model = build_tiny_model(
                Path(tmp) / "long", hidden_size=128, num_layers=2, num_heads=2,
                max_position_embeddings=max(args.sp_lengths),
            )  # fmt: skip
            sp_figures = sequence_parallel_memory(args.sp_lengths, long_model, Path(tmp))
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
    if sp_figures:
        for length in args.sp_lengths:
            figures[f"sp2_vs_sp1_peak_ratio_{length // 1024}k"] = sp_figures[f"ratio_{length // 1024}k"]
        figures["sequence_parallel"] = sp_figures
        print_rows(
            "one sequence, forward+backward: rank 0's memory, sequence_parallel 2 vs 1 (2 layers, width 128)",
            ["tokens", "step peak MB (1)", "step peak MB (2)", "ratio", "saved activations MB (1)", "(2)", "ratio"],
            [
                [
                    length,
                    sp_figures[f"sp1_{length // 1024}k"]["step_peak_mb"],
                    sp_figures[f"sp2_{length // 1024}k"]["step_peak_mb"],
                    sp_figures[f"ratio_{length // 1024}k"],
                    sp_figures[f"sp1_{length // 1024}k"]["saved_activations_mb"],
                    sp_figures[f"sp2_{length // 1024}k"]["saved_activations_mb"],
                    sp_figures[f"saved_ratio_{length // 1024}k"],
                ]
                for length in args.sp_lengths
            ],
        )
    print(f"written to {write_results('long_context', figures)}")


if __name__ == "__main__":
    main()
