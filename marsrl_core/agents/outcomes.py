"""Outcome checks: whether a Solver's or Corrector's final output solves its problem.

A problem names its check (`Problem.verifier`):
- `math` (the default): the final answer (`roles.parse_answer`) equals the reference answer,
  mathematically (`answers_match`: math-verify for LaTeX, fractions and units such as `336^\\circ` =
  `336`, with an exact fast path when both sides are plain integers, the demo's task);
- `code`: the output's last fenced Python block passes the problem's tests (`Problem.tests`) in the
  sandbox (`agents.code`, `sandbox.py`).

`check_outcome` runs one check in this process. `OutcomeChecker` runs them in a pool of worker
processes (pebble) with a wall-clock limit per check: a check that passes it is cut, its worker
killed and replaced, and the outcome is "incorrect, timeout"; the caller never waits longer than
the limit, whatever the output holds (math-verify's own timeouts rely on signals, which work only
in a process's main thread, and an expression such as `9^{9^{9^{9}}}` keeps the interpreter's lock
while sympy computes it, so no thread of the caller could stop it). The rollout, the evaluation and
the decoupled rewards all judge through it.

Deliberate simplification: a worker builds its sandbox once (the first code check it runs); the
sandbox's limits are the run's (`outcome` config section), a code task's tests set their own time
limit per test run.
"""

from __future__ import annotations

import logging
import multiprocessing
import re
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from math_verify import parse, verify
from pebble import ProcessPool

from marsrl_core.agents.code import check_program
from marsrl_core.agents.problems import Problem
from marsrl_core.agents.roles import parse_answer
from marsrl_core.sandbox import Sandbox, SandboxLimits

VERIFIERS = ("math", "code")
TIMEOUT = "timeout"


@dataclass(frozen=True)
class Outcome:
    """A check's result: `correct`, what was read (`parsed`: the answer, or the program's first line)
    and `reason`: "ok" when the check ran to a verdict, else why not ("no_answer", "timeout", a failed
    test's one line)."""

    correct: bool
    reason: str
    parsed: str | None = None


_INTEGER = re.compile(r"^[+-]?\d+$")


class _OwnTimeout(logging.Filter):
    """Drops math-verify's "Timeout is disabled" warning for the checks `answers_match` makes without its
    timeout (outside a main thread, where its signals cannot work; `OutcomeChecker` bounds them). Only
    while such a check runs in the thread that logs: math-verify's other lines, and its warning for
    other callers, pass."""

    checking = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        return not (getattr(self.checking, "on", False) and record.getMessage().startswith("Timeout is disabled"))


_OWN_TIMEOUT = _OwnTimeout()
for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_OWN_TIMEOUT)


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
    _OwnTimeout.checking.on = timeout is None
    try:
        gold, target = _math_parse(reference, timeout), _math_parse(predicted, timeout)
        return bool(gold and target and verify(gold, target, timeout_seconds=timeout))
    finally:
        _OwnTimeout.checking.on = False


_sandbox: Sandbox | None = None  # this process's sandbox (built on its first code check)
_sandbox_lock = threading.Lock()


def check_outcome(problem: Problem, text: str, sandbox_limits: SandboxLimits = SandboxLimits()) -> Outcome:
    """Whether `text` solves `problem`, checked in this process (no time limit of its own)."""
    if problem.verifier == "code":
        if problem.tests is None:
            raise ValueError(f"problem {problem.problem_id!r}: a code problem needs tests")
        result = check_program(_code_sandbox(sandbox_limits), text, problem.tests)
        if result.program is None:
            return Outcome(False, "no_answer", None)
        first = (result.program.strip().splitlines() or [None])[0]
        return Outcome(result.correct, "ok" if result.correct else result.reason[:300], first and first[:200])
    if problem.verifier != "math":
        raise ValueError(f"problem {problem.problem_id!r}: verifier={problem.verifier!r}; expected one of {VERIFIERS}")
    answer = parse_answer(text)
    if answer is None:
        return Outcome(False, "no_answer", None)
    return Outcome(answers_match(answer, problem.answer), "ok", answer)


def _code_sandbox(limits: SandboxLimits) -> Sandbox:
    global _sandbox
    with _sandbox_lock:
        if _sandbox is None or _sandbox.limits != limits:
            _sandbox = Sandbox(limits)
        return _sandbox


class OutcomeChecker:
    """`workers` processes that run `check_outcome`, each check cut at `timeout_s` (0 workers: checks
    run in the caller's thread, with no time limit).

    `check(problem, text)` blocks for one outcome; `check_many` submits several at once, so the
    workers run them side by side. `close()` ends the workers (the run's end); the checker is a context
    manager. A code check needs the sandbox: with `code=True` the constructor builds one here first,
    so a machine without bubblewrap or user namespaces is refused at start (`SandboxUnavailable`),
    not at the first code output."""

    def __init__(
        self, workers: int = 2, timeout_s: float = 30.0, sandbox_limits: SandboxLimits = SandboxLimits(), code=False
    ):
        if code:
            Sandbox(sandbox_limits)
        self.timeout_s, self.sandbox_limits = timeout_s, sandbox_limits
        # spawn, not fork: the caller has threads (Prefect's, torch's), which a forked child would not have.
        spawn = multiprocessing.get_context("spawn")
        self.pool = ProcessPool(max_workers=workers, context=spawn) if workers else None
        self.timeouts = 0

    @classmethod
    def from_config(cls, cfg: Any, code: bool = False) -> OutcomeChecker:
        """The checker `cfg.outcome` describes (`code`: build the sandbox now, refusing a machine without it)."""
        oc = cfg.outcome
        limits = SandboxLimits(
            memory_mb=oc.sandbox_memory_mb,
            processes=oc.sandbox_processes,
            tmp_mb=oc.sandbox_tmp_mb,
            output_bytes=oc.sandbox_output_kb << 10,
            python=oc.sandbox_python,
        )
        return cls(oc.workers, oc.timeout_s, limits, code=code)

    def check(self, problem: Problem, text: str) -> Outcome:
        return self.check_many([(problem, text)])[0]

    def check_many(self, items: list[tuple[Problem, str]]) -> list[Outcome]:
        if self.pool is None:  # workers=0: here, with no time limit
            return [check_outcome(problem, text, self.sandbox_limits) for problem, text in items]
        futures = [
            self.pool.schedule(check_outcome, (problem, text, self.sandbox_limits), timeout=self.timeout_s)
            for problem, text in items
        ]
        outcomes = []
        for future in futures:
            try:
                outcomes.append(future.result())
            except FutureTimeout:
                self.timeouts += 1
                outcomes.append(Outcome(False, TIMEOUT, None))
        return outcomes

    def close(self) -> None:
        if self.pool is not None:
            self.pool.stop()
            self.pool.join()

    def __enter__(self) -> OutcomeChecker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["TIMEOUT", "VERIFIERS", "Outcome", "OutcomeChecker", "answers_match", "check_outcome"]
