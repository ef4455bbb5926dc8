"""Evaluation of the three agents and of the V-C system on a set of problems.

For each problem: k Solver samples (Solver avg@k); one Verifier pass over each sample (precision and
recall of `Wrong` verdicts, i.e. of catching wrong solutions, and balanced accuracy over both
classes); one Corrector pass over each sample given that report (fix rate: wrong → right; break rate:
right → wrong; and the break rate on the right solutions the Verifier wrongly flagged, where most
breaks happen: a Corrector that trusts a false report "repairs" a right step); then the V-C loop with
k workers, each starting from one of the Solver samples (V-C avg@k). Tokens per problem count every
generated token of the Solver samples and of the loop.

A prompt that does not fit the engine's context with its agent's budget is skipped, not decoded
(`TextGenerator.complete`), and the branch it starts is left out: a Solver sample from the Solver's
measures and everything after it, a report from the Verifier's and the Corrector's, a revision from
the Corrector's. The skipped branches are counted per agent (`skipped`) and listed (`skipped_prompts`:
agent, problem id, prompt tokens) for the caller to record. In the V-C loop a skipped step ends its
worker unaccepted, so it counts against the V-C accuracy.

Why a measure is low is counted per agent: `truncated` outputs ran out of their agent's budget;
`unparsable` ones finished but hold no `\\boxed{}` answer (Solver, Corrector) or no verdict (Verifier).

Deliberate simplifications: one Verifier/Corrector pass per Solver sample (not a group); a rate with
no cases (say, no wrong solutions to fix) is reported as NaN rather than guessed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from marsrl_core.agents.outcomes import OutcomeChecker
from marsrl_core.agents.problems import Problem
from marsrl_core.agents.reasoning import run_vc_loop
from marsrl_core.agents.rewards import Judgement, judge_solution
from marsrl_core.agents.roles import CORRECT, CORRECTOR, SOLVER, VERIFIER, WRONG, Roles, parse_bug_report, parse_verdict
from marsrl_core.engines.base import TextGenerator, complete_as, for_role


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
    corrector_fix: float
    corrector_break: float
    corrector_break_false_flag: float  # of right solutions judged Wrong, the fraction the Corrector broke
    vc_acc: float
    tokens_per_problem: float
    skipped: dict[str, int] = field(default_factory=dict)  # per agent: prompts that did not fit the context
    skipped_prompts: list[tuple[str, str, int]] = field(default_factory=list)  # (agent, problem id, tokens)
    truncated: dict[str, int] = field(default_factory=dict)  # per agent: outputs cut by the agent's budget
    unparsable: dict[str, int] = field(default_factory=dict)  # per agent: finished, but no answer or verdict

    COUNTS = ("skipped", "truncated", "unparsable")  # per-agent counts, `<count>_<agent>` in `as_dict`

    def as_dict(self) -> dict[str, float]:
        """The measures, and each per-agent count as `<count>_<agent>` (e.g. `truncated_solver`)."""
        out = {k: v for k, v in self.__dict__.items() if k not in (*self.COUNTS, "skipped_prompts")}
        for count in self.COUNTS:
            out |= {f"{count}_{agent}": float(n) for agent, n in getattr(self, count).items()}
        return out


def evaluate(
    generator: TextGenerator | dict[str, TextGenerator],
    roles: Roles,
    problems: Sequence[Problem],
    *,
    k: int,
    max_tokens: dict[str, int],
    accept_after: int = 4,
    max_rounds: int = 10,
    progress: Any = None,
    checker: OutcomeChecker | None = None,
) -> EvalReport:
    """Measure Solver, Verifier, Corrector and the V-C system on `problems` (k samples each); each
    agent's batched call is a phase of `progress` (`runtime.progress.Progress`) when one is given.
    Outputs are checked by `checker`'s worker processes (each check time-limited), or in this process."""
    if not problems or k < 1:
        raise ValueError(f"evaluate: need at least one problem and k >= 1 (got {len(problems)} problems, k={k})")
    tok = for_role(generator, SOLVER).tokenizer
    pairs = [(p, i) for p in problems for i in range(k)]
    skipped_prompts: list[tuple[str, str, int]] = []

    def complete(role: str, prompts: list[str], rows: list[int]) -> dict[int, object]:
        """The completions of `prompts` (one per pair index in `rows`) that were not skipped."""
        outs = complete_as(generator, role, prompts, max_tokens[role], progress)
        skipped_prompts.extend((role, pairs[r][0].problem_id, o.prompt_tokens) for r, o in zip(rows, outs) if o.skipped)
        return {r: o for r, o in zip(rows, outs) if not o.skipped}

    check = (checker or OutcomeChecker(workers=0)).check_many  # no checker: in this thread

    def judged(completions: dict[int, Any]) -> dict[int, Judgement]:
        """Solver or Corrector completions judged against their problems (the checks side by side)."""
        checked = [r for r, c in completions.items() if not c.truncated]
        outcomes = dict(zip(checked, check([(pairs[r][0], completions[r].text) for r in checked])))
        return {
            r: judge_solution(c.text, pairs[r][0], c.truncated, outcome=outcomes.get(r)) for r, c in completions.items()
        }

    rows = list(range(len(pairs)))
    solutions = complete(SOLVER, [roles.prompt(tok, SOLVER, pairs[r][0].prompt) for r in rows], rows)
    solver_judged = judged(solutions)
    right = {r: j.correct for r, j in solver_judged.items()}

    rows = list(solutions)
    reports = complete(
        VERIFIER, [roles.prompt(tok, VERIFIER, pairs[r][0].prompt, solutions[r].text) for r in rows], rows
    )
    verdicts = {r: parse_verdict(report.text) for r, report in reports.items()}
    caught = sum(v == WRONG and not right[r] for r, v in verdicts.items())
    passed = sum(v == CORRECT and right[r] for r, v in verdicts.items())
    flagged = sum(v == WRONG for v in verdicts.values())
    n_wrong = sum(not right[r] for r in verdicts)
    n_right = len(verdicts) - n_wrong
    recall, specificity = _rate(caught, n_wrong), _rate(passed, n_right)
    parts = [x for x in (recall, specificity) if not math.isnan(x)]

    rows = list(reports)
    fixes = complete(
        CORRECTOR,
        [
            roles.prompt(tok, CORRECTOR, pairs[r][0].prompt, solutions[r].text, parse_bug_report(reports[r].text))
            for r in rows
        ],
        rows,
    )
    fixes_judged = judged(fixes)
    fixed_right = {r: j.correct for r, j in fixes_judged.items()}
    n_wrong_fixed = sum(not right[r] for r in fixes)
    fixed = sum(fr and not right[r] for r, fr in fixed_right.items())
    broken = sum(right[r] and not fr for r, fr in fixed_right.items())
    false_flags = [fr for r, fr in fixed_right.items() if right[r] and verdicts[r] == WRONG]

    # The V-C loop starts from each problem's Solver samples; a problem whose Solver prompt did not fit
    # has none, and is left out of it.
    looped = [pi for pi in range(len(problems)) if pi * k in solutions]
    initial = [[solutions[pi * k + i].text for i in range(k)] for pi in looped]
    vc_generators = {id(for_role(generator, role)): for_role(generator, role) for role in (SOLVER, VERIFIER, CORRECTOR)}
    skipped_before_loop = sum(g.skipped for g in vc_generators.values())
    vc = run_vc_loop(
        generator,
        roles,
        [problems[pi].prompt for pi in looped],
        workers=k,
        accept_after=accept_after,
        max_rounds=max_rounds,
        max_tokens=max_tokens,
        initial_solutions=initial,
        progress=progress,
    )
    if progress is not None:
        progress.close()  # the last phase's closing line
    finals = [(problems[pi], w.final_solution) for pi, workers in zip(looped, vc) for w in workers]
    vc_right = [o.correct for o in check(finals)]
    tokens = sum(len(s.token_ids) for s in solutions.values()) + sum(w.tokens for workers in vc for w in workers)
    skipped = {role: sum(agent == role for agent, _, _ in skipped_prompts) for role in (SOLVER, VERIFIER, CORRECTOR)}
    skipped["vc_loop"] = sum(g.skipped for g in vc_generators.values()) - skipped_before_loop

    return EvalReport(
        problems=len(problems),
        k=k,
        solver_acc=_rate(sum(right.values()), len(right)),
        verifier_precision=_rate(caught, flagged),
        verifier_recall=recall,
        verifier_bal_acc=sum(parts) / len(parts) if parts else math.nan,
        corrector_fix=_rate(fixed, n_wrong_fixed),
        corrector_break=_rate(broken, len(fixes) - n_wrong_fixed),
        corrector_break_false_flag=_rate(false_flags.count(False), len(false_flags)),
        vc_acc=_rate(sum(vc_right), len(vc_right)),
        tokens_per_problem=tokens / len(problems),
        skipped=skipped,
        skipped_prompts=skipped_prompts,
        truncated={
            SOLVER: sum(s.truncated for s in solutions.values()),
            VERIFIER: sum(v.truncated for v in reports.values()),
            CORRECTOR: sum(f.truncated for f in fixes.values()),
        },
        unparsable={
            SOLVER: sum(j.outcome == "no_answer" for j in solver_judged.values()),
            VERIFIER: sum(verdicts[r] is None and not reports[r].truncated for r in reports),
            CORRECTOR: sum(j.outcome == "no_answer" for j in fixes_judged.values()),
        },
    )
