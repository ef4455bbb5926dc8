"""Rewards: answer checking and the per-agent (decoupled) rewards.

Decoupled rewards (the MarsRL default) are binary and known the moment an agent's output completes:
- Solver, Corrector: 1 if the final answer matches the reference;
- Verifier: 1 if its verdict matches the true correctness of the solution it judged (that truth is
  the judged solution's own reward).
The shared-reward baseline (every turn gets its trajectory's final outcome) is computed over the
rollout's samples: `marsrl_core.rollout.samples.shared_outcome`.

Answers are checked with math-verify (LaTeX, fractions, units such as `336^\\circ` = `336`), with an
exact fast path when both sides are plain integers (the demo task). Unparsable output and outputs cut
off by their budget get 0 (`truncated_reward`), their outcome recorded with the reward.

Deliberate simplification: math-verify's signal-based timeouts only work in the main thread, so they
are switched off elsewhere (Prefect runs tasks in threads).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

from math_verify import parse, verify

from marsrl_core.agents.roles import CORRECT, CORRECTOR, SOLVER, VERIFIER, WRONG, parse_answer, parse_verdict

_INTEGER = re.compile(r"^[+-]?\d+$")


def _math_parse(text: str, timeout: int | None):
    wrapped = text if "$" in text or "\\boxed" in text else f"${text}$"
    return parse(wrapped, parsing_timeout=timeout)


def answers_match(predicted: str | None, reference: str) -> bool:
    """True when `predicted` is mathematically equal to `reference`."""
    if predicted is None:
        return False
    predicted, reference = predicted.strip(), reference.strip()
    if _INTEGER.match(predicted) and _INTEGER.match(reference):
        return int(predicted) == int(reference)
    if predicted == reference:
        return True
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold, target = _math_parse(reference, timeout), _math_parse(predicted, timeout)
    if not gold or not target:
        return False
    return bool(verify(gold, target, timeout_seconds=timeout))


@dataclass(frozen=True)
class Judgement:
    """The reward of one finished output and what was read from it."""

    reward: float
    correct: bool  # Solver/Corrector: the answer is right; Verifier: the verdict matches the truth
    outcome: str  # "ok", "no_answer", "no_verdict", "truncated"
    parsed: str | None  # the answer or the verdict


def judge_solution(text: str, reference: str, truncated: bool = False, truncated_reward: float = 0.0) -> Judgement:
    """Solver and Corrector reward: 1 if the final answer matches the reference."""
    answer = parse_answer(text)
    if truncated:
        return Judgement(truncated_reward, False, "truncated", answer)
    if answer is None:
        return Judgement(0.0, False, "no_answer", None)
    right = answers_match(answer, reference)
    return Judgement(float(right), right, "ok", answer)


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
    reference: str,
    judged_solution_correct: bool | None = None,
    truncated: bool = False,
    truncated_reward: float = 0.0,
) -> Judgement:
    """The decoupled reward of `agent`'s finished output."""
    if agent in (SOLVER, CORRECTOR):
        return judge_solution(text, reference, truncated, truncated_reward)
    if agent == VERIFIER:
        if judged_solution_correct is None:
            raise ValueError("judge(verifier): judged_solution_correct is required")
        return judge_verdict(text, judged_solution_correct, truncated, truncated_reward)
    raise ValueError(f"agent={agent!r}: expected solver, verifier or corrector")


__all__ = ["CORRECT", "WRONG", "Judgement", "answers_match", "judge", "judge_solution", "judge_verdict"]
