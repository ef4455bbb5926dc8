"""Code checks through the sandbox: all 164 HumanEval problems, reference and broken programs.

Each problem's reference program (HumanEval's prompt plus canonical body) and a broken one (the
prompt with `return None` as its body) go through `OutcomeChecker` as fenced model outputs: every
check runs the program and HumanEval's `check(candidate)` under bubblewrap with the sandbox's limits
(`marsrl_core/sandbox.py`). It reports how many references pass and how many broken programs fail
(all of each, if the checks are right) and the throughput in checks per second with `--workers`
worker processes (2 by default: this machine's cores), side by side with one worker in the same run.

Run: `python benchmarks/code_checks.py`. Writes benchmarks/results/code_checks.json with `problems`,
`reference_pass`, `broken_fail`, `failed_references` (task ids), `passed_broken` (task ids) and,
per worker count, `checks_per_s` and `seconds`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

from benchmarks.common import print_rows, write_results  # noqa: E402
from marsrl_core.agents.humaneval import humaneval_rows  # noqa: E402
from marsrl_core.agents.outcomes import OutcomeChecker  # noqa: E402
from marsrl_core.agents.problems import Problem, code_tests  # noqa: E402


def problems() -> list[Problem]:
    return [Problem(r["qid"], r["query"], r["ans_box"], "humaneval", "code", code_tests(r)) for r in humaneval_rows()]


def run(tasks: list[Problem], workers: int) -> tuple[list, list, float]:
    fenced = lambda program: f"```python\n{program}```"  # noqa: E731
    with OutcomeChecker(workers=workers, timeout_s=60) as checker:
        checker.check(tasks[0], fenced(tasks[0].answer))  # the workers start and build their sandboxes
        start = time.perf_counter()
        right = checker.check_many([(p, fenced(p.answer)) for p in tasks])
        broken = checker.check_many([(p, fenced(p.prompt + "    return None\n")) for p in tasks])
        return right, broken, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="Worker processes of the measured checker.")
    args = parser.parse_args()
    tasks = problems()
    figures: dict = {"problems": len(tasks)}
    rows = []
    for workers in sorted({1, args.workers}):
        right, broken, seconds = run(tasks, workers)
        checks = 2 * len(tasks)
        figures[f"workers_{workers}"] = {"checks_per_s": checks / seconds, "seconds": seconds}
        rows.append([workers, checks, seconds, checks / seconds])
        figures["reference_pass"] = sum(o.correct for o in right)
        figures["broken_fail"] = sum(not o.correct for o in broken)
        figures["failed_references"] = [p.problem_id for p, o in zip(tasks, right) if not o.correct]
        figures["passed_broken"] = [p.problem_id for p, o in zip(tasks, broken) if o.correct]
    print_rows("HumanEval through the sandbox", ["workers", "checks", "seconds", "checks per second"], rows)
    print(
        f"references passing: {figures['reference_pass']} of {len(tasks)}; "
        f"broken programs failing: {figures['broken_fail']} of {len(tasks)}"
    )
    print(f"wrote {write_results('code_checks', figures)}")


if __name__ == "__main__":
    main()
