"""The synthetic demo task: single-digit addition chains modulo 10, solved step by step.

A problem is `7+5+9+3`; its answer is the running sum modulo 10 (`4`). A solution writes one local
step per term, each a single-digit fact a tiny model can learn fast, then the answer:
`7+5=2;2+9=1;1+3=4;Answer: 4`. Because every step is local, a Verifier can check each step and
a Corrector can repair a solution from its first wrong step.

Deliberately simple: no carries, no multi-digit numbers (a tiny character model learns those far
too slowly on a CPU, as measured before this task was chosen).
"""

from __future__ import annotations

import random

from marsrl_core.problems import Problem


def make_problem(rng: random.Random, index: int, min_terms: int = 3, max_terms: int = 5, prefix: str = "syn") -> Problem:
    terms = [rng.randint(0, 9) for _ in range(rng.randint(min_terms, max_terms))]
    return Problem(f"{prefix}-{index}", "+".join(map(str, terms)), str(sum(terms) % 10), "synthetic")


def make_problems(count: int, seed: int, prefix: str = "syn", **kwargs: int) -> list[Problem]:
    """`count` problems drawn from a seeded generator (the same seed gives the same problems)."""
    rng = random.Random(seed)
    return [make_problem(rng, i, prefix=prefix, **kwargs) for i in range(count)]


def solution_steps(prompt: str) -> list[tuple[int, int, int]]:
    """The correct steps (running total, term, new total) of a problem."""
    terms = [int(t) for t in prompt.split("+")]
    steps, total = [], terms[0]
    for term in terms[1:]:
        steps.append((total, term, (total + term) % 10))
        total = (total + term) % 10
    return steps


def write_solution(steps: list[tuple[int, int, int]]) -> str:
    body = ";".join(f"{a}+{b}={c}" for a, b, c in steps)
    return f"{body};Answer: {steps[-1][2] if steps else ''}"


def correct_solution(prompt: str) -> str:
    return write_solution(solution_steps(prompt))
