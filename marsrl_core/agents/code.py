"""The code outcome check: a program passes when every test of its task passes in the sandbox.

A code task carries its tests in one of two forms (`CodeTests`):
- `test`: a Python test program that defines `check(candidate)` and raises (an `assert`) on a wrong
  answer, with `entry_point`, the function under test (HumanEval's form). The sandbox runs the model's
  program, then the test program, then `check(<entry_point>)`;
- `cases`: input/output pairs; the program runs once per case with the input on stdin and passes it
  when its stdout, stripped of trailing whitespace per line, equals the expected output.

The program is the model output's last fenced Python block (```python ... ```, or an unlabelled
fence when there is no labelled one). No block, a failed test, an error, a timeout or too much output
is "incorrect", with the reason. Every run goes through `sandbox.Sandbox` (`time_limit_s` per test
run), never the host's interpreter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from marsrl_core.agents.roles import strip_thinking
from marsrl_core.sandbox import Sandbox

_FENCE = re.compile(r"```[ \t]*(?P<lang>[A-Za-z0-9_+-]*)[ \t]*\n(?P<body>.*?)```", re.DOTALL)


@dataclass(frozen=True)
class CodeTests:
    """A code task's tests: a `test` program with `entry_point`, or input/output `cases`."""

    test: str = ""
    entry_point: str = ""
    cases: tuple[tuple[str, str], ...] = ()
    time_limit_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.test and not self.cases:
            raise ValueError("code tests: give a 'test' program or input/output 'cases'")
        if self.test and not self.entry_point:
            raise ValueError("code tests: a 'test' program needs the 'entry_point' it checks")


@dataclass(frozen=True)
class CodeOutcome:
    correct: bool
    reason: str  # "" when correct
    program: str | None


def last_python_block(text: str) -> str | None:
    """The last fenced Python block of `text` (outside a thinking block), or None."""
    blocks = list(_FENCE.finditer(strip_thinking(text)))
    python = [b for b in blocks if b.group("lang").lower() in ("python", "py", "python3")]
    chosen = python or [b for b in blocks if not b.group("lang")]
    return chosen[-1].group("body") if chosen else None


def check_program(sandbox: Sandbox, output: str, tests: CodeTests) -> CodeOutcome:
    """Whether the program in `output` passes every test of `tests`, run in `sandbox`."""
    program = last_python_block(output)
    if program is None:
        return CodeOutcome(False, "no fenced Python block", None)
    limits = replace(sandbox.limits, wall_s=tests.time_limit_s, cpu_s=max(1, int(tests.time_limit_s)))
    if tests.test:
        source = f"{program}\n\n{tests.test}\n\ncheck({tests.entry_point})\n"
        result = sandbox.run(source, limits=limits)
        return CodeOutcome(result.ok, "" if result.ok else f"test failed: {result.reason()}", program)
    for number, (stdin, expected) in enumerate(tests.cases, start=1):
        result = sandbox.run(program, stdin=stdin, limits=limits)
        if not result.ok:
            return CodeOutcome(False, f"case {number}: {result.reason()}", program)
        if _lines(result.stdout) != _lines(expected):
            return CodeOutcome(False, f"case {number}: wrong output", program)
    return CodeOutcome(True, "", program)


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip().splitlines()]


__all__ = ["CodeOutcome", "CodeTests", "check_program", "last_python_block"]
