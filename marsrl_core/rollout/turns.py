"""A problem's next turn: whether there is one, which outputs of the turn before feed it, and the
prompts they make.

A Verifier judges a solution: its candidates are the turn's Solver (or Corrector) outputs, and
incorrect ones are preferred. A Corrector revises a solution that a Verifier flagged: its candidates
are the Verifier outputs whose verdict is `Wrong`, rightly flagged ones preferred (the solution they
judged is incorrect), and its prompt carries that solution and the Verifier's bug report. The picks
follow `rollout.select_inputs`, `selection` and `explore` (`agents/selection.py`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

from marsrl_core.agents.problems import Problem
from marsrl_core.agents.roles import CORRECTOR, VERIFIER, WRONG, Roles, parse_bug_report
from marsrl_core.agents.selection import select_inputs
from marsrl_core.rollout.samples import ProblemState, Sample, agent_of_turn


def _report(verifier_output: Sample) -> str:
    return parse_bug_report(verifier_output.text)


def batches_on_their_turn(states: Iterable[ProblemState]) -> set[int | None]:
    """The batches with a sample still decoding: under the per-batch turn barrier none of their
    problems starts its next turn (the rule the simulator compares the streaming one against)."""
    return {st.batch for st in states if not st.done and any(s.finish is None for s in st.turns[max(st.turns)])}


def has_next_turn(turn: int, upstream: list[Sample]) -> bool:
    """Whether a problem plays turn `turn` after its finished `upstream` turn: a Verifier always, a
    Corrector only if a Verifier output says Wrong."""
    return agent_of_turn(turn) == VERIFIER or any(v.judgement.parsed == WRONG for v in upstream)


def next_turn_inputs(
    problem: Problem, turn: int, upstream: list[Sample], rc: Any, roles: Roles, tokenizer: Any, rng: random.Random
) -> list[tuple[Sample, str]]:
    """(input sample, prompt text) for each group of turn `turn`, from the finished `upstream` turn."""
    if agent_of_turn(turn) == VERIFIER:
        candidates = upstream
        preferred = lambda s: not s.judgement.correct  # noqa: E731  (incorrect solutions)
    else:
        candidates = [v for v in upstream if v.judgement.parsed == WRONG]
        preferred = lambda v: not v.parent.solution.judgement.correct  # noqa: E731  (rightly flagged)
    picks = select_inputs(candidates, rc.select_inputs, rc.selection, preferred, rng, rc.explore)
    if agent_of_turn(turn) == VERIFIER:
        return [(pick, roles.prompt(tokenizer, VERIFIER, problem.prompt, pick.text)) for pick in picks]
    return [
        (
            pick,
            roles.prompt(tokenizer, CORRECTOR, problem.prompt, pick.parent.solution.text, parse_bug_report(pick.text)),
        )
        for pick in picks
    ]
