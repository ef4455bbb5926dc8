"""Outcome checks in a pool of worker processes, each cut at a wall-clock limit: math answers and code
tests, directly and through the rollout scheduler, whose rewards record each check's outcome."""

from __future__ import annotations

import time

import pytest

from marsrl_core.agents.code import CodeTests
from marsrl_core.agents.outcomes import TIMEOUT, OutcomeChecker, check_outcome
from marsrl_core.agents.problems import Problem
from marsrl_core.agents.roles import TINY_TEMPLATES, Roles
from marsrl_core.rollout.scheduler import RolloutScheduler
from marsrl_core.store import SegmentStore
from tests.configs import rollout_config
from tests.scripted import ScriptedEngine

SPIN = "Answer: 9^{9^{9^{9}}}"  # math-verify asks sympy for the number, which holds the interpreter's lock
ADD = Problem(
    "add",
    "Write add(a, b).",
    "",
    verifier="code",
    tests=CodeTests(test="def check(f):\n    assert f(2, 3) == 5\n", entry_point="add"),
)


@pytest.fixture(scope="module")
def checker():
    with OutcomeChecker(workers=2, timeout_s=4.0) as c:
        yield c


def test_math_and_code_checks_run_in_the_workers(checker):
    math = Problem("m", "1+1", "2")
    outcomes = checker.check_many(
        [
            (math, "Answer: 2"),
            (math, "Answer: 3"),
            (math, "no answer here"),
            (ADD, "```python\ndef add(a, b):\n    return a + b\n```"),
            (ADD, "```python\ndef add(a, b):\n    return a * b\n```"),
        ]
    )
    assert [o.correct for o in outcomes] == [True, False, False, True, False]
    assert [o.reason for o in outcomes[:4]] == ["ok", "ok", "no_answer", "ok"]
    assert outcomes[0].parsed == "2" and outcomes[3].parsed == "def add(a, b):"
    assert outcomes[4].reason.startswith("test failed:") and "AssertionError" in outcomes[4].reason


def test_a_spinning_math_answer_is_cut_at_the_limit_and_the_checker_goes_on(checker):
    math = Problem("m", "1+1", "1")
    start = time.monotonic()
    spun, after = checker.check_many([(math, SPIN), (math, "Answer: 1")])
    assert time.monotonic() - start < checker.timeout_s + 3
    assert not spun.correct and spun.reason == TIMEOUT
    assert after.correct  # checked beside it by the other worker
    assert checker.check(math, "Answer: 1").correct  # the killed worker was replaced
    assert checker.timeouts >= 1


def test_a_rollout_records_a_timed_out_check_and_goes_on(tmp_path):
    cfg = rollout_config(tmp_path, {"num_generations": 2, "segment_tokens": 8, "solver_max_tokens": 40, "max_turns": 1})
    store = SegmentStore.from_config(cfg.store)
    problems = [Problem("p0", "0+1", "1"), Problem("p1", "1+1", "2")]
    engine = ScriptedEngine(lambda prompt: SPIN if "0+1" in prompt else "Answer: 2")
    roles = Roles.from_config(base=TINY_TEMPLATES)
    with OutcomeChecker(workers=2, timeout_s=3.0) as checker:
        scheduler = RolloutScheduler(cfg, store, "r", engine, engine.tokenizer, roles, problems, checker=checker)
        start = time.monotonic()
        scheduler.run()
    assert time.monotonic() - start < 60
    rows = store.query(
        "SELECT s.problem_id, r.reward, r.outcome FROM lake.rewards r JOIN lake.samples s USING (run_id, sample_id) "
        "WHERE r.run_id = 'r' ORDER BY s.problem_id"
    ).to_pylist()
    assert [(r["problem_id"], r["reward"], r["outcome"]) for r in rows] == [
        ("p0", 0.0, TIMEOUT),
        ("p0", 0.0, TIMEOUT),
        ("p1", 1.0, "ok"),
        ("p1", 1.0, "ok"),
    ]


def test_a_code_problem_needs_tests_and_a_known_verifier():
    with pytest.raises(ValueError, match="needs tests"):
        check_outcome(Problem("c", "x", "", verifier="code"), "```python\npass\n```")
    with pytest.raises(ValueError, match="verifier='lean'"):
        check_outcome(Problem("c", "x", "", verifier="lean"), "Answer: 1")
    with pytest.raises(ValueError, match="entry_point"):
        CodeTests(test="def check(f): pass")


def test_a_math_check_outside_the_main_thread_logs_no_warning(caplog):
    """math-verify warns ("Timeout is disabled ...") whenever it is given a timeout outside the main thread,
    where its signals cannot work; checks in Prefect's threads pass none, so nothing meaningless shows."""
    import logging
    import threading

    from marsrl_core.agents.outcomes import answers_match

    results = []
    with caplog.at_level(logging.DEBUG):
        thread = threading.Thread(target=lambda: results.append(answers_match("\\frac{1}{2}", "0.5")))
        thread.start()
        thread.join()
    assert results == [True]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
