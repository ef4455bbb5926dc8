"""The synthetic demo task: single-digit addition chains modulo 10, solved step by step.

A problem is `7+5+9+3`; its answer is the running sum modulo 10 (`4`). A solution writes one local
step per term, each a single-digit fact a tiny model can learn fast, then the answer:
`7+5=2;2+9=1;1+3=4;Answer: 4`. Because every step is local, a Verifier can check each step and
a Corrector can repair a solution from its first wrong step. The Verifier's report
(`7+5=2>2 ok;2+9=3>1 no;Correctness: Wrong`) copies the steps up to the first wrong one with its own
recomputed totals, so the tiny Corrector's template shows it the problem and the report only: it
keeps the steps that hold, recomputes the flagged one itself (some demonstrations misreport its total,
see `misreport`), and solves on from there.

The code form of the task (`code=True`; `marsrl train --set data.verifier=code`) asks for the answer
as a one-line Python function instead of an `Answer:` line: `7+5=2;2+9=1;1+3=4;` then
`` ```python\ndef f():return 4\n``` ``. The problem carries a test (`check(f)` asserts `f() == 4`), so
the Solver's and Corrector's rewards come from running their program in the sandbox (`agents/code.py`)
and the Verifier's from agreeing with that run. It exercises the code path end to end (fenced-block
extraction, sandboxed tests, code rewards) on a task the tiny model can learn; it measures no
program synthesis beyond that one line.

Deliberately simple: no carries, no multi-digit numbers (a tiny character model learns those far
too slowly on a CPU, as measured before this task was chosen).
"""

from __future__ import annotations

import random
import re

from marsrl_core.agents.code import CodeTests
from marsrl_core.agents.problems import Problem
from marsrl_core.agents.roles import parse_bug_report

CODE_ANSWER = re.compile(r"^```python\ndef f\(\):return (?P<answer>.*)\n```$", re.DOTALL)


def make_problem(
    rng: random.Random, index: int, min_terms: int = 3, max_terms: int = 5, prefix: str = "syn", code: bool = False
) -> Problem:
    terms = [rng.randint(0, 9) for _ in range(rng.randint(min_terms, max_terms))]
    prompt, answer = "+".join(map(str, terms)), str(sum(terms) % 10)
    if not code:
        return Problem(f"{prefix}-{index}", prompt, answer, "synthetic")
    tests = CodeTests(
        test=f"def check(candidate):\n    assert candidate() == {answer}\n", entry_point="f", time_limit_s=5.0
    )
    return Problem(f"{prefix}-{index}", prompt, correct_solution(prompt, code=True), "synthetic", "code", tests)


def make_problems(count: int, seed: int, prefix: str = "syn", code: bool = False, **kwargs: int) -> list[Problem]:
    """`count` problems drawn from a seeded generator (the same seed gives the same problems); `code`:
    the code form, whose outputs are checked by running their program against the problem's test."""
    rng = random.Random(seed)
    return [make_problem(rng, i, prefix=prefix, code=code, **kwargs) for i in range(count)]


def solution_steps(prompt: str) -> list[tuple[int, int, int]]:
    """The correct steps (running total, term, new total) of a problem."""
    terms = [int(t) for t in prompt.split("+")]
    steps, total = [], terms[0]
    for term in terms[1:]:
        steps.append((total, term, (total + term) % 10))
        total = (total + term) % 10
    return steps


def write_solution(steps: list[tuple[int, int, int]], code: bool = False) -> str:
    body = ";".join(f"{a}+{b}={c}" for a, b, c in steps)
    answer = steps[-1][2] if steps else ""
    return f"{body};```python\ndef f():return {answer}\n```" if code else f"{body};Answer: {answer}"


def correct_solution(prompt: str, code: bool = False) -> str:
    return write_solution(solution_steps(prompt), code)


def stated_answer(solution: str) -> str | None:
    """What a solution's last part states as its answer (`Answer: x`, or the code form's `return x`)."""
    last = solution.rsplit(";", 1)[-1].strip()
    if last.startswith("Answer:"):
        return last.removeprefix("Answer:").strip()
    match = CODE_ANSWER.match(last)
    return match.group("answer").strip() if match else None


# ---------------------------------------------------------------------------------------------------
# Demonstrations for the SFT warm start: the three roles, each with injected mistakes so that the warm
# start is imperfect in all of them (RL's job is to sharpen them).


def parse_steps(solution: str) -> list[tuple[int, int, int]] | None:
    """The (a, b, c) steps of a solution written as `a+b=c;...;Answer: x` (or in the code form), or None
    if malformed."""
    parts = solution.split(";")
    if stated_answer(solution) is None:
        return None
    steps = []
    for part in parts[:-1]:
        try:
            left, c = part.split("=")
            a, b = left.split("+")
            steps.append((int(a), int(b), int(c)))
        except ValueError:
            return None
    return steps


def noisy_steps(prompt: str, rng: random.Random, step_error: float) -> list[tuple[int, int, int]]:
    """A chain with each step wrong with probability `step_error`; later steps build on the wrong total."""
    terms = [int(t) for t in prompt.split("+")]
    steps, total = [], terms[0]
    for term in terms[1:]:
        result = (total + term) % 10
        if rng.random() < step_error:
            result = (result + rng.randint(1, 9)) % 10
        steps.append((total, term, result))
        total = result
    return steps


def verifier_report(solution: str, prompt: str) -> str:
    """Each step checked locally up to the first wrong one, then the verdict:
    `7+5=2>2 ok;2+9=3>1 no;Correctness: Wrong`.

    Per step the Verifier copies the step `a+b=c`, recomputes `>(a+b) mod 10` itself, and marks it `ok`
    or `no`; the check is then a comparison of two nearby digits, which a tiny model can learn (a bare
    verdict, or a whole re-solution before it, stayed at chance in a prototype). The marks also check
    that a step continues the previous total and uses the right term. The report stops at the first
    `no`, as a bug report cites the first error: the verdict then follows from the last mark alone, and
    the report carries what the Corrector needs (the steps that hold, and the recomputed total of the
    first one that does not). A chain that holds but stops early or states another answer ends `end no`.
    """
    steps = parse_steps(solution)
    if steps is None:
        return "bad;Correctness: Wrong"
    wrong = _first_wrong_step(steps, prompt)
    if wrong is not None:
        return _flagged_report(steps, wrong)
    marks = [_mark(*step, "ok") for step in steps[: _step_count(prompt)]]
    answer = stated_answer(solution)
    if len(steps) != _step_count(prompt) or not steps or answer != str(steps[-1][2]):
        return ";".join(marks + ["end no"]) + ";Correctness: Wrong"
    return ";".join(marks) + ";Correctness: Correct"


def _first_wrong_step(steps: list[tuple[int, int, int]], prompt: str) -> int | None:
    """The index of the first step that does not continue the running total with the next term and
    its sum modulo 10, or None if every step (up to the problem's number of steps) holds."""
    terms = [int(t) for t in prompt.split("+")]
    total = terms[0]
    for i, ((a, b, c), term) in enumerate(zip(steps, terms[1:])):
        if not (a == total and b == term and c == (a + b) % 10):
            return i
        total = c
    return None


def _step_count(prompt: str) -> int:
    return prompt.count("+")


def _mark(a: int, b: int, c: int, verdict: str, recomputed: int | None = None) -> str:
    """One step's mark: the step copied, the recomputed total (the right one unless given), the verdict."""
    return f"{a}+{b}={c}>{(a + b) % 10 if recomputed is None else recomputed} {verdict}"


def _flagged_report(steps: list[tuple[int, int, int]], flagged: int, recomputed: int | None = None) -> str:
    """The steps before `flagged` marked ok, then `flagged` marked no: a report of a `Wrong` verdict."""
    marks = [_mark(*step, "ok") for step in steps[:flagged]] + [_mark(*steps[flagged], "no", recomputed)]
    return ";".join(marks) + ";Correctness: Wrong"


def keep_first_mistake(solution: str, prompt: str, code: bool = False) -> str:
    """A failed repair: the solution's first wrong total trusted, the remaining steps done right from it."""
    terms = [int(t) for t in prompt.split("+")]
    steps, total = [], terms[0]
    for (_, _, c), term in zip(parse_steps(solution) or [], terms[1:]):
        holds = c == (total + term) % 10
        steps.append((total, term, c))
        total = c
        if not holds:
            break
    rest = "+".join(map(str, [total, *terms[len(steps) + 1 :]]))  # the remaining chain, from the trusted total
    return write_solution(steps + solution_steps(rest), code)


def misreport(solution: str, prompt: str, rng: random.Random) -> str:
    """A report whose flagged step carries a wrong recomputed total: on a right solution a false flag
    (a random step marked `no`, `7+5=2>5 no`), on a wrong one the first wrong step flagged with a total
    that is neither its own nor the right one. A Corrector that takes the report's total breaks the
    first and fails the second; one that recomputes the flagged step itself repairs both."""
    steps = parse_steps(solution)
    if not steps:
        return verifier_report(solution, prompt)
    flagged = _first_wrong_step(steps, prompt)
    if flagged is None:  # every step holds (or the chain ends early): flag a random step that holds
        flagged = rng.randrange(min(len(steps), _step_count(prompt)))
    a, b, c = steps[flagged]
    return _flagged_report(steps, flagged, rng.choice([x for x in range(10) if x not in (c, (a + b) % 10)]))


def demonstrations(
    problems: list[Problem],
    rng: random.Random,
    *,
    solver_error: float,
    verdict_flip: float,
    repair_failure: float,
    report_corruption: float = 0.0,
    code: bool = False,
) -> list[tuple[str, str, str]]:
    """(role, prompt fields joined by '|', target) demonstrations for all three roles; the mistake rates
    are `SFTConfig`'s fields of the same names. A Corrector demonstration's report is misreported
    (`misreport`) with probability `report_corruption`; its target is the same as with a true report.
    `code`: solutions in the code form."""
    demos = []
    for p in problems:
        solution = write_solution(noisy_steps(p.prompt, rng, solver_error), code)
        demos.append(("solver", p.prompt, solution))
        judged = write_solution(noisy_steps(p.prompt, rng, 0.35), code)
        report = verifier_report(judged, p.prompt)
        if rng.random() < verdict_flip:
            flipped = "Correct" if report.endswith("Wrong") else "Wrong"
            report = report.rsplit(":", 1)[0] + f": {flipped}"
        demos.append(("verifier", f"{p.prompt}|{judged}", report))
        previous = write_solution(noisy_steps(p.prompt, rng, 0.35), code)  # right in about a third of cases
        repair = correct_solution(p.prompt, code)
        if previous != repair and rng.random() < repair_failure:
            repair = keep_first_mistake(previous, p.prompt, code)
        report = (
            misreport(previous, p.prompt, rng)
            if rng.random() < report_corruption
            else verifier_report(previous, p.prompt)
        )
        # The Corrector sees the bug report as rollouts and the V-C loop pass it: without the verdict.
        report_text = parse_bug_report(report)
        demos.append(("corrector", f"{p.prompt}|{previous}|{report_text}", repair))
    return demos
