"""The Verifier–Corrector inference loop (V-C loop).

solve → verify → (if Wrong) correct → verify → …: a solution is accepted once it collects
`accept_after` consecutive `Correct` verdicts (default 4, as the public pipeline); the loop stops after
`max_rounds` verifications (default 10). If nothing is accepted, the solution judged Correct most
often is returned (ties go to the newer one). Several independent workers run per problem.

All (problem, worker) loops advance together: each round makes one batched Verifier call over every
active loop and one batched Corrector call over those judged Wrong, so any engine batches them.
A verdict that cannot be parsed counts as Wrong for the loop (a cautious reading: the solution is
not accepted on it) but the Corrector is given the report as written.

Deliberate simplification: a worker's first solution may be given (evaluation reuses the Solver-alone
samples); otherwise the Solver writes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from marsrl_core.agents.roles import (
    CORRECT,
    CORRECTOR,
    SOLVER,
    VERIFIER,
    Roles,
    parse_answer,
    parse_bug_report,
    parse_verdict,
)
from marsrl_core.engines.base import TextGenerator, complete_as, for_role


@dataclass
class Candidate:
    text: str
    correct_votes: int = 0
    born_round: int = 0


@dataclass
class VCResult:
    """The outcome of one worker's V-C loop on one problem."""

    problem_index: int
    worker: int
    final_solution: str = ""
    accepted: bool = False
    rounds: int = 0
    tokens: int = 0
    verdicts: list[str | None] = field(default_factory=list)
    candidates: list[Candidate] = field(default_factory=list)

    @property
    def answer(self) -> str | None:
        return parse_answer(self.final_solution)


@dataclass
class _Loop:
    result: VCResult
    problem: str
    current: Candidate
    streak: int = 0
    done: bool = False


def run_vc_loop(
    generator: TextGenerator | dict[str, TextGenerator],
    roles: Roles,
    problems: Sequence[str],
    *,
    workers: int = 1,
    accept_after: int = 4,
    max_rounds: int = 10,
    max_tokens: dict[str, int],
    initial_solutions: Sequence[Sequence[str]] | None = None,
    progress: Any = None,
) -> list[list[VCResult]]:
    """Run the V-C loop for every problem with `workers` independent workers; results[p][w]. Each
    batched call is a phase of `progress` (`runtime.progress.Progress`) when one is given."""
    if accept_after < 1 or max_rounds < 1 or workers < 1:
        raise ValueError(
            f"run_vc_loop: accept_after={accept_after}, max_rounds={max_rounds}, workers={workers} must all be >= 1"
        )
    tokenizer = for_role(generator, SOLVER).tokenizer
    loops = [
        _Loop(VCResult(p, w), problem, Candidate("")) for p, problem in enumerate(problems) for w in range(workers)
    ]
    if initial_solutions is None:
        prompts = [roles.prompt(tokenizer, SOLVER, lp.problem) for lp in loops]
        for lp, out in zip(loops, complete_as(generator, SOLVER, prompts, max_tokens[SOLVER], progress, "V-C solver")):
            lp.current.text, lp.result.tokens = out.text, len(out.token_ids)
    else:
        for lp in loops:
            lp.current.text = initial_solutions[lp.result.problem_index][lp.result.worker]
    for lp in loops:
        lp.result.candidates.append(lp.current)

    for round_index in range(1, max_rounds + 1):
        active = [lp for lp in loops if not lp.done]
        if not active:
            break
        prompts = [roles.prompt(tokenizer, VERIFIER, lp.problem, lp.current.text) for lp in active]
        label = f"V-C round {round_index} verifier"
        reports = complete_as(generator, VERIFIER, prompts, max_tokens[VERIFIER], progress, label)
        to_correct = []
        for lp, report in zip(active, reports):
            if report.skipped:  # the solution is too long for the Verifier's prompt: the worker stops here
                lp.done = True
                continue
            verdict = parse_verdict(report.text)
            lp.result.rounds, lp.result.tokens = round_index, lp.result.tokens + len(report.token_ids)
            lp.result.verdicts.append(verdict)
            if verdict == CORRECT:
                lp.current.correct_votes += 1
                lp.streak += 1
                if lp.streak >= accept_after:
                    lp.done, lp.result.accepted = True, True
            else:
                lp.streak = 0
                to_correct.append((lp, parse_bug_report(report.text)))
        if to_correct and round_index < max_rounds:
            prompts = [
                roles.prompt(tokenizer, CORRECTOR, lp.problem, lp.current.text, report) for lp, report in to_correct
            ]
            label = f"V-C round {round_index} corrector"
            revisions = complete_as(generator, CORRECTOR, prompts, max_tokens[CORRECTOR], progress, label)
            for (lp, _), out in zip(to_correct, revisions):
                if out.skipped:  # too long to revise: the worker stops with what it has
                    lp.done = True
                    continue
                lp.result.tokens += len(out.token_ids)
                lp.current = Candidate(out.text, 0, round_index)
                lp.result.candidates.append(lp.current)

    for lp in loops:
        if lp.result.accepted:
            lp.result.final_solution = lp.current.text
        else:  # most often judged Correct; ties to the newest
            best = max(lp.result.candidates, key=lambda c: (c.correct_votes, c.born_round))
            lp.result.final_solution = best.text
    results: list[list[VCResult]] = [[] for _ in problems]
    for lp in loops:
        results[lp.result.problem_index].append(lp.result)
    return results
