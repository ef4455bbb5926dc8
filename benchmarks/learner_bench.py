"""Learner benchmark: peak memory and time of one train step (forward, log-probs, PPO loss, backward)
on a tiny Llama model with a 32K vocabulary at 4K, 16K and 64K tokens, chunked vs naive log-probs.

Each measurement runs in its own process so that peak resident memory (ru_maxrss) is its own; the
figure reported is the peak minus the resident memory just before the step. The naive path
materialises [tokens x vocab] logits and log-softmax (and their gradients): at 64K tokens that is
over 30 GB, more than this machine has, so it is skipped and reported as null.

Run: `python benchmarks/learner_bench.py`. Writes benchmarks/results/learner.json with
{"peak_mb": {"chunked": {"4096": ...}, "naive": {...}}, "step_s": {...}}.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

LENGTHS = (4096, 16384, 65536)
VOCAB = 32000
NAIVE_LIMIT = 16384  # naive at 64K needs > 30 GB


def one_step(mode: str, length: int) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    from marsrl_core.demo.tiny import tiny_llama_config
    from marsrl_core.learn.algorithms import chunked_logprobs, naive_logprobs, policy_loss

    torch.manual_seed(0)
    config = tiny_llama_config(VOCAB, 128, 2, 4, max_position_embeddings=length + 8)
    model = LlamaForCausalLM(config).train()
    model.gradient_checkpointing_enable()
    ids = torch.randint(0, VOCAB, (1, length))
    behaviour = torch.full((1, length - 1), -10.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    hidden = model.get_decoder()(input_ids=ids).last_hidden_state[0, :-1]
    weight, targets = model.get_output_embeddings().weight, ids[0, 1:]
    if mode == "chunked":
        logprobs, _ = chunked_logprobs(hidden, weight, targets, 1024)
    else:
        logprobs, _ = naive_logprobs(hidden, weight, targets)
    out = policy_loss(logprobs[None], behaviour, torch.tensor([1.0]), torch.ones(1, length - 1))
    out.loss.backward()
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_mb": (peak - before) / 1024, "step_s": elapsed}


def main() -> None:
    from benchmarks.common import print_rows, write_results

    figures: dict = {"peak_mb": {"chunked": {}, "naive": {}}, "step_s": {"chunked": {}, "naive": {}}}
    for length in LENGTHS:
        for mode in ("chunked", "naive"):
            if mode == "naive" and length > NAIVE_LIMIT:
                figures["peak_mb"][mode][str(length)] = None
                figures["step_s"][mode][str(length)] = None
                continue
            result = subprocess.run(
                [sys.executable, __file__, "--one", mode, str(length)], capture_output=True, text=True, check=True
            )
            measured = json.loads(result.stdout.strip().splitlines()[-1])
            figures["peak_mb"][mode][str(length)] = measured["peak_mb"]
            figures["step_s"][mode][str(length)] = measured["step_s"]
    rows = []
    for length in LENGTHS:
        c, n = figures["peak_mb"]["chunked"][str(length)], figures["peak_mb"]["naive"][str(length)]
        rows.append(
            [
                length,
                c,
                "skipped (>30 GB)" if n is None else n,
                "-" if n is None else n / c,
                figures["step_s"]["chunked"][str(length)],
                "-" if n is None else figures["step_s"]["naive"][str(length)],
            ]
        )
    c = figures["peak_mb"]["chunked"]
    figures["chunked_growth_4k_to_64k"] = c["65536"] / c["4096"]
    figures["naive_over_chunked_16k"] = figures["peak_mb"]["naive"]["16384"] / c["16384"]
    print_rows(
        f"one train step, tiny Llama, vocab {VOCAB}, gradient checkpointing",
        ["tokens", "chunked peak MB", "naive peak MB", "naive / chunked", "chunked s", "naive s"],
        rows,
    )
    print(f"chunked peak grows {figures['chunked_growth_4k_to_64k']:.1f}x from 4K to 64K tokens (16x tokens)")
    print(f"wrote {write_results('learner', figures)}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--one":
        print(json.dumps(one_step(sys.argv[2], int(sys.argv[3]))))
    else:
        main()
