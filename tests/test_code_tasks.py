"""Code tasks end to end: HumanEval converted to code rows, loaded as problems, checked in the
sandbox through the worker pool (reference programs pass, broken ones fail); bad code rows are
rejected with their reason; the code roles' prompts."""

from __future__ import annotations

import json

import pytest

from marsrl_core.agents.humaneval import humaneval_rows, write_rows
from marsrl_core.agents.outcomes import OutcomeChecker
from marsrl_core.agents.problems import load_problems
from marsrl_core.agents.roles import CODE_TEMPLATES, CORRECTOR, SOLVER, VERIFIER, Roles

SAMPLE = slice(0, None, 14)  # 12 of the 164 in CI; benchmarks/code_checks.py runs all


@pytest.fixture(scope="module")
def humaneval(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "humaneval.jsonl"
    assert write_rows(humaneval_rows(), out) == 164
    loaded = load_problems(out)
    assert loaded.rejected == [] and len(loaded.problems) == 164
    return loaded.problems


def fenced(program: str) -> str:
    return f"The program:\n```python\n{program}```\n"


def test_humaneval_reference_programs_pass_and_broken_ones_fail(humaneval):
    problems = humaneval[SAMPLE]
    assert all(p.verifier == "code" and p.tests.entry_point for p in problems)
    with OutcomeChecker(workers=2, timeout_s=60) as checker:
        right = checker.check_many([(p, fenced(p.answer)) for p in problems])
        broken = checker.check_many([(p, fenced(p.prompt + "    return None\n")) for p in problems])
    assert [o.reason for o in right] == ["ok"] * len(problems)
    assert not any(o.correct for o in broken)
    assert all(o.reason.startswith("test failed:") for o in broken)


def test_code_rows_load_with_tests_or_cases_and_bad_ones_are_rejected(tmp_path):
    rows = [
        {
            "qid": "t",
            "query": "Write f.",
            "verifier": "code",
            "tests": "def check(c):\n    assert c(1) == 2\n",
            "entry_point": "f",
        },
        {
            "qid": "c",
            "query": "Double the input.",
            "verifier": "code",
            "cases": [{"input": "2\n", "output": "4"}],
            "time_limit_s": 3,
        },
        {"qid": "m", "query": "1+1", "ans_box": "2"},
        {"qid": "no-tests", "query": "Write g.", "verifier": "code"},
        {"qid": "no-entry", "query": "Write g.", "verifier": "code", "tests": "def check(c): pass"},
        {"qid": "bad-cases", "query": "Write g.", "verifier": "code", "cases": [{"input": 1}]},
        {
            "qid": "bad-limit",
            "query": "Write g.",
            "verifier": "code",
            "cases": [{"input": "", "output": ""}],
            "time_limit_s": -1,
        },
        {"qid": "lean", "query": "Prove it.", "ans_box": "x", "verifier": "lean"},
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    loaded = load_problems(path)
    assert [(p.problem_id, p.verifier) for p in loaded.problems] == [("t", "code"), ("c", "code"), ("m", "math")]
    assert loaded.problems[1].tests.cases == (("2\n", "4"),) and loaded.problems[1].tests.time_limit_s == 3
    reasons = [r.reason for r in loaded.rejected]
    assert reasons == [
        "a code row needs 'tests' (with 'entry_point') or 'cases'",
        "'tests' needs 'entry_point': the name of the function it checks",
        '\'cases\' must be a non-empty list of {"input": text, "output": text}',
        "'time_limit_s' must be a number of seconds in (0, 600], got -1",
        "verifier='lean': expected 'math' or 'code'",
    ]
    as_code = load_problems(path, verifier="code")  # the dataset's default: a row without tests is rejected
    assert "m" not in [p.problem_id for p in as_code.problems]


def test_code_roles_ask_for_a_fenced_program_and_a_verdict():
    roles = Roles.from_config(base=CODE_TEMPLATES)
    solver = roles.prompt_text(SOLVER, "def f(x):")
    assert "```python" in solver and "def f(x):" in solver
    verifier = roles.prompt_text(VERIFIER, "def f(x):", "```python\ndef f(x): return x\n```")
    assert verifier.rstrip().endswith("Correctness: Correct or Wrong")
    assert "Bug report:\nno" in roles.prompt_text(CORRECTOR, "def f(x):", "prog", "no")


def test_marsrl_eval_on_humaneval_with_a_random_qwen3_runs_end_to_end(tmp_path, tmp_path_factory, capsys):
    from marsrl_core.cli import main
    from marsrl_core.store import SegmentStore
    from tests.configs import set_args
    from tests.qwen3 import build_qwen3

    data = tmp_path / "humaneval.jsonl"
    assert main(["data", "humaneval", str(data)]) == 0
    budgets = {
        "rollout.segment_tokens": 8,
        "rollout.solver_max_tokens": 16,
        "rollout.verifier_max_tokens": 8,
        "rollout.corrector_max_tokens": 8,
    }
    args = set_args(
        tmp_path,
        **{
            "model.path": build_qwen3(tmp_path_factory.mktemp("qwen3") / "model"),
            "evaluation.dataset": data,
            "evaluation.num_problems": 2,
            "evaluation.k": 2,
            "evaluation.max_rounds": 1,
            "evaluation.verifier": "code",
            "roles.templates": "code",
            "outcome.workers": 2,
            **budgets,
        },
    )
    assert main(["eval", *args]) == 0
    assert "outputs cut by their budget: solver" in capsys.readouterr().out
    store = SegmentStore(f"sqlite:{tmp_path}/lake.sqlite", f"{tmp_path}/data")
    [row] = store.query("SELECT metrics_json, dataset FROM evaluations").to_pylist()
    metrics = json.loads(row["metrics_json"])
    assert row["dataset"] == str(data) and metrics["problems"] == 2
    assert metrics["solver_acc"] == 0.0 and metrics["vc_acc"] == 0.0  # random weights write no program


def test_the_synthetic_code_task_checks_its_one_line_function_in_the_sandbox():
    """The demo task's code form: a right solution's function passes the problem's test, a wrong total or
    a function that does not run fails it, an `Answer:` line is no program; its demonstrations are all in
    the code form, and the Verifier's report reads a code solution as it reads an arithmetic one."""
    import random

    from marsrl_core.demo.synthetic import (
        correct_solution,
        demonstrations,
        make_problems,
        stated_answer,
        verifier_report,
    )

    problems = make_problems(6, seed=3, code=True)
    assert all(p.verifier == "code" and p.tests.entry_point == "f" for p in problems)
    right = [correct_solution(p.prompt, code=True) for p in problems]
    wrong = [r.replace(f"return {stated_answer(r)}", f"return {(int(stated_answer(r)) + 1) % 10}") for r in right]
    with OutcomeChecker(workers=1, timeout_s=60) as checker:
        outcomes = checker.check_many(
            [(p, r) for p, r in zip(problems, right)]
            + [(p, w) for p, w in zip(problems, wrong)]
            + [(problems[0], right[0].replace("return", "retrun")), (problems[0], correct_solution(problems[0].prompt))]
        )
    assert [o.correct for o in outcomes] == [True] * 6 + [False] * 6 + [False, False]
    assert outcomes[-1].reason == "no_answer" and outcomes[-2].reason.startswith("test failed:")
    assert all(verifier_report(r, p.prompt).endswith("Correctness: Correct") for p, r in zip(problems, right))
    assert all(verifier_report(w, p.prompt).endswith("Correctness: Wrong") for p, w in zip(problems, wrong))
    demos = demonstrations(
        problems, random.Random(0), solver_error=0.15, verdict_flip=0.25, repair_failure=0.4, code=True
    )
    targets = [target for role, _, target in demos if role in ("solver", "corrector")]
    assert len(targets) == 12 and all(t.endswith("\n```") and "```python\ndef f():return " in t for t in targets)
