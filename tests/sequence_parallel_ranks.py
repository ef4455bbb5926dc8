"""Two ranks of the sequence-parallel scorer against one process, for tests/test_distributed.py:

    python -m torch.distributed.run --nproc-per-node 2 tests/sequence_parallel_ranks.py OUT.json FOLDER...

For each model folder and each row of `ROWS`, both ranks score the row with `learner.sequence_parallel=2`
(`learn/sequence_parallel.py`) and back-propagate a weighted sum of the log-probs; the gradients summed
over the ranks are compared with one process's on the whole row. Rank 0 writes the largest differences
of log-probs and gradients to OUT.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from marsrl_core.learn.attention import VARLEN_SDPA
from marsrl_core.learn.scoring import PackedBatch, TokenScorer
from marsrl_core.learn.sequence_parallel import ULYSSES, SequenceGroup

ROWS = {  # (prompt, response) lengths of the sequences of one padding-free row
    "uneven, one padding token": [(7, 5), (3, 9), (12, 1)],
    "rank 0 holds no response token": [(14, 2), (2, 6)],
}


def gradients(model, scorer, batch, weights) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logprobs, _ = scorer(batch)
    (logprobs * weights).sum().backward()
    return logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def main(out: str, folders: list[str]) -> None:
    dist.init_process_group("gloo")
    sequence = SequenceGroup.form(SimpleNamespace(rank=dist.get_rank(), world_size=2), 2)
    results = {}
    for folder in folders:
        one = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=VARLEN_SDPA)
        cut = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=ULYSSES + VARLEN_SDPA)
        for name, lengths in ROWS.items():
            rng = np.random.default_rng(0)
            batch = PackedBatch.build(
                [rng.integers(5, 90, p) for p, _ in lengths], [rng.integers(5, 90, r) for _, r in lengths], "cpu", True
            )
            weights = torch.as_tensor(rng.normal(size=(len(lengths), max(r for _, r in lengths))), dtype=torch.float32)
            reference, expected = gradients(one, TokenScorer(one, 4, 1.0), batch, weights)
            logprobs, grads = gradients(cut, TokenScorer(cut, 4, 1.0, sequence), batch, weights)
            for g in grads.values():
                dist.all_reduce(g)
            results[f"{Path(folder).name}: {name}"] = {
                "logprobs": float((logprobs - reference).abs().max()),
                "gradients": max(float((grads[n] - g).abs().max()) for n, g in expected.items()),
                "gradient_scale": max(float(g.abs().max()) for g in expected.values()),
            }
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
