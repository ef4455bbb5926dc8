"""A run's problem batches: batch `b` is `rollout.problems_per_batch` problems, the same on every call.

Synthetic problems (no `data.train_dataset`) come from a generator seeded by the run's seed and the
batch index. A training file's good rows are dealt out in order, batch after batch, cycling when the
file runs out; problem ids carry the batch (`b<b>-<row id>`), so a row used twice is two problems.
The file is read once per process (every turn task of every batch slices it); rows whose question is
longer than `model.max_prompt_tokens` (with the policy's tokenizer) are rejected there, as evaluation
rows are.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from marsrl_core.agents.problems import LoadedProblems, Problem, load_problems
from marsrl_core.config import MarsRLConfig
from marsrl_core.demo.synthetic import make_problems
from marsrl_core.policy import policy_folder
from marsrl_core.store import Rejection


def batch_problems(cfg: MarsRLConfig, batch_index: int) -> list[Problem]:
    """The problems of batch `batch_index`."""
    n = cfg.rollout.problems_per_batch
    if cfg.data.train_dataset is None:
        return make_problems(
            n,
            cfg.seed * 100_003 + batch_index,
            prefix=f"b{batch_index}",
            min_terms=cfg.data.synthetic_min_terms,
            max_terms=cfg.data.synthetic_max_terms,
            code=cfg.data.verifier == "code",
        )
    pool = training_set(cfg).problems
    return [
        replace(p, problem_id=f"b{batch_index}-{p.problem_id}")
        for p in (pool[(batch_index * n + i) % len(pool)] for i in range(n))
    ]


def training_rejections(cfg: MarsRLConfig) -> list[Rejection]:
    """The training file's bad rows (none for synthetic problems)."""
    return [] if cfg.data.train_dataset is None else training_set(cfg).rejected


def training_set(cfg: MarsRLConfig) -> LoadedProblems:
    """The training file's problems and bad rows (DatasetError when it has no good row)."""
    data = cfg.data
    folder = str(policy_folder(cfg))
    return _load(
        data.train_dataset, data.question_field, data.answer_field, folder, cfg.model.max_prompt_tokens, data.verifier
    )


@functools.lru_cache(maxsize=4)
def _load(
    path: str, question_field: str, answer_field: str, tokenizer_folder: str, max_prompt_tokens: int, verifier: str
):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    return load_problems(
        path,
        question_field=question_field,
        answer_field=answer_field,
        count_tokens=lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]),
        max_prompt_tokens=max_prompt_tokens,
        verifier=verifier,
    )
