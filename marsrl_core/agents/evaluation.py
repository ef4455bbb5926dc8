"""Evaluation of the three agents and of the V-C system on a set of problems.

For each problem: k Solver samples (Solver avg@k); one Verifier pass over each sample (precision and
recall of `Wrong` verdicts, i.e. of catching wrong solutions, and balanced accuracy over both
classes); one Corrector pass over each sample given that report (fix rate: wrong → right; break rate:
right → wrong; and the break rate on the right solutions the Verifier wrongly flagged, where most
breaks happen: a Corrector that trusts a false report "repairs" a right step); then the V-C loop with
k workers, each starting from one of the Solver samples (V-C avg@k). Tokens per problem count every
generated token of the Solver samples and of the loop.

Deliberate simplifications: one Verifier/Corrector pass per Solver sample (not a group); a rate with
no cases (say, no wrong solutions to fix) is reported as NaN rather than guessed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from marsrl_core.agents.problems import Problem
from marsrl_core.agents.reasoning import run_vc_loop
from marsrl_core.agents.rewards import answers_match, judge_solution
from marsrl_core.agents.roles import CORRECT, CORRECTOR, SOLVER, VERIFIER, WRONG, Roles, parse_bug_report, parse_verdict
from marsrl_core.engines.base import TextGenerator, for_role


def _rate(hits: int, total: int) -> float:
    return hits / total if total else math.nan


@dataclass
class EvalReport:
    problems: int
    k: int
    solver_acc: float
    verifier_precision: float  # of Wrong verdicts, the fraction on wrong solutions
    verifier_recall: float  # of wrong solutions, the fraction judged Wrong ("caught")
    verifier_bal_acc: float
    verifier_unparsable: int
    corrector_fix: float
    corrector_break: float
    corrector_break_false_flag: float  # of right solutions judged Wrong, the fraction the Corrector broke
    vc_acc: float
    tokens_per_problem: float

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


def evaluate(
    generator: TextGenerator | dict[str, TextGenerator],
    roles: Roles,
    problems: Sequence[Problem],
    *,
    k: int,
    max_tokens: dict[str, int],
    accept_after: int = 4,
    max_rounds: int = 10,
) -> EvalReport:
    """Measure Solver, Verifier, Corrector and the V-C system on `problems` (k samples each)."""
    if not problems or k < 1:
        raise ValueError(f"evaluate: need at least one problem and k >= 1 (got {len(problems)} problems, k={k})")
    tok = for_role(generator, SOLVER).tokenizer
    pairs = [(p, i) for p in problems for i in range(k)]
    solutions = for_role(generator, SOLVER).complete(
        [roles.prompt(tok, SOLVER, p.prompt) for p, _ in pairs], max_tokens[SOLVER]
    )
    right = [judge_solution(s.text, p.answer, s.truncated).correct for (p, _), s in zip(pairs, solutions)]

    reports = for_role(generator, VERIFIER).complete(
        [roles.prompt(tok, VERIFIER, p.prompt, s.text) for (p, _), s in zip(pairs, solutions)], max_tokens[VERIFIER]
    )
    verdicts = [parse_verdict(r.text) for r in reports]
    caught = sum(v == WRONG and not ok for v, ok in zip(verdicts, right))
    passed = sum(v == CORRECT and ok for v, ok in zip(verdicts, right))
    flagged = sum(v == WRONG for v in verdicts)
    n_wrong, n_right = right.count(False), right.count(True)
    recall, specificity = _rate(caught, n_wrong), _rate(passed, n_right)
    parts = [x for x in (recall, specificity) if not math.isnan(x)]

    fixes = for_role(generator, CORRECTOR).complete(
        [
            roles.prompt(tok, CORRECTOR, p.prompt, s.text, parse_bug_report(r.text))
            for (p, _), s, r in zip(pairs, solutions, reports)
        ],
        max_tokens[CORRECTOR],
    )
    fixed_right = [judge_solution(f.text, p.answer, f.truncated).correct for (p, _), f in zip(pairs, fixes)]
    fixed = sum(fr and not ok for fr, ok in zip(fixed_right, right))
    broken = sum(ok and not fr for fr, ok in zip(fixed_right, right))
    false_flags = [fr for fr, ok, v in zip(fixed_right, right, verdicts) if ok and v == WRONG]

    initial = [[solutions[pi * k + i].text for i in range(k)] for pi in range(len(problems))]
    vc = run_vc_loop(
        generator,
        roles,
        [p.prompt for p in problems],
        workers=k,
        accept_after=accept_after,
        max_rounds=max_rounds,
        max_tokens=max_tokens,
        initial_solutions=initial,
    )
    vc_right = [answers_match(w.answer, p.answer) for p, workers in zip(problems, vc) for w in workers]
    tokens = sum(len(s.token_ids) for s in solutions) + sum(w.tokens for workers in vc for w in workers)

    return EvalReport(
        problems=len(problems),
        k=k,
        solver_acc=_rate(sum(right), len(right)),
        verifier_precision=_rate(caught, flagged),
        verifier_recall=recall,
        verifier_bal_acc=sum(parts) / len(parts) if parts else math.nan,
        verifier_unparsable=sum(v is None for v in verdicts),
        corrector_fix=_rate(fixed, n_wrong),
        corrector_break=_rate(broken, n_right),
        corrector_break_false_flag=_rate(false_flags.count(False), len(false_flags)),
        vc_acc=_rate(sum(vc_right), len(vc_right)),
        tokens_per_problem=tokens / len(problems),
    )
