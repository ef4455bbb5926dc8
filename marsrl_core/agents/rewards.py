"""Rewards: answer checking and the per-agent (decoupled) rewards.

Decoupled rewards (the MarsRL default) are binary and known the moment an agent's output completes:
- Solver, Corrector: 1 if the output solves the problem (`outcomes.py`: the final answer matches the
  reference for a math problem, the program passes the tests for a code problem);
- Verifier: 1 if its verdict matches the true correctness of the solution it judged (that truth is
  the judged solution's own reward).
The shared-reward baseline (every turn gets its trajectory's final outcome) is computed over the
rollout's samples: `marsrl_core.rollout.samples.shared_outcome`.

Unparsable output gets 0 and outputs cut off by their budget get `truncated_reward` (0), their
outcome recorded with the reward.
"""

from __future__ import annotations

from dataclasses import dataclass

from marsrl_core.agents.outcomes import Outcome, answers_match, check_outcome
from marsrl_core.agents.problems import Problem
from marsrl_core.agents.roles import CORRECT, CORRECTOR, SOLVER, VERIFIER, WRONG, parse_answer, parse_verdict


@dataclass(frozen=True)
class Judgement:
    """The reward of one finished output and what was read from it."""

    reward: float
    correct: bool  # Solver/Corrector: the answer is right; Verifier: the verdict matches the truth
    outcome: str  # "ok", "no_answer", "no_verdict", "truncated", "timeout", or why a code test failed
    parsed: str | None  # the answer (a program's first line) or the verdict


def judge_solution(
    text: str,
    problem: Problem | str,
    truncated: bool = False,
    truncated_reward: float = 0.0,
    outcome: Outcome | None = None,
) -> Judgement:
    """Solver and Corrector reward: 1 if the output solves `problem` (a `Problem`, or a math reference
    answer), by `outcome` when the caller checked it already (an `OutcomeChecker`), else checked here."""
    if truncated:
        return Judgement(truncated_reward, False, "truncated", parse_answer(text))
    if outcome is None:
        outcome = check_outcome(as_problem(problem), text)
    return Judgement(float(outcome.correct), outcome.correct, outcome.reason, outcome.parsed)


def as_problem(problem: Problem | str) -> Problem:
    """A `Problem` as is; a reference answer as a math problem with that answer."""
    return problem if isinstance(problem, Problem) else Problem("", "", problem)


def judge_verdict(
    text: str, judged_solution_correct: bool, truncated: bool = False, truncated_reward: float = 0.0
) -> Judgement:
    """Verifier reward: 1 if its verdict matches the true correctness of the solution it judged."""
    verdict = parse_verdict(text)
    if truncated:
        return Judgement(truncated_reward, False, "truncated", verdict)
    if verdict is None:
        return Judgement(0.0, False, "no_verdict", None)
    right = (verdict == CORRECT) == judged_solution_correct
    return Judgement(float(right), right, "ok", verdict)


def judge(
    agent: str,
    text: str,
    *,
    problem: Problem | str,
    judged_solution_correct: bool | None = None,
    truncated: bool = False,
    truncated_reward: float = 0.0,
    outcome: Outcome | None = None,
) -> Judgement:
    """The decoupled reward of `agent`'s finished output (`outcome`: see `judge_solution`)."""
    if agent in (SOLVER, CORRECTOR):
        return judge_solution(text, problem, truncated, truncated_reward, outcome)
    if agent == VERIFIER:
        if judged_solution_correct is None:
            raise ValueError("judge(verifier): judged_solution_correct is required")
        return judge_verdict(text, judged_solution_correct, truncated, truncated_reward)
    raise ValueError(f"agent={agent!r}: expected solver, verifier or corrector")


__all__ = ["CORRECT", "WRONG", "Judgement", "answers_match", "as_problem", "judge", "judge_solution", "judge_verdict"]
