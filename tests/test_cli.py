"""The `marsrl` command end to end on the tiny model: eval, train (as built so far), sql, errors."""

from __future__ import annotations

import json

import pytest

from marsrl_core.cli import main
from marsrl_core.store import RewardRow, SampleRow, SegmentStore
from tests.configs import set_args
from tests.test_problems import _aime


@pytest.fixture
def where(tmp_path):
    return set_args(tmp_path, **{"evaluation.k": 1, "evaluation.num_problems": 3, "evaluation.max_rounds": 2})


def test_eval_on_aime_records_metrics_and_rejects_oversized_prompts(where, tmp_path, capsys):
    code = main(["eval", *where, "--set", f"evaluation.dataset={_aime()}", "--set", "model.max_prompt_tokens=250"])
    assert code == 0
    out = capsys.readouterr().out
    assert "Solver accuracy" in out and "V-C system accuracy" in out
    store = SegmentStore(f"sqlite:{tmp_path}/lake.sqlite", f"{tmp_path}/data")
    [row] = store.query("SELECT metrics_json, dataset FROM evaluations").to_pylist()
    metrics = json.loads(row["metrics_json"])
    assert metrics["problems"] == 3 and 0.0 <= metrics["solver_acc"] <= 1.0
    rejected = store.query("SELECT reason FROM rejected_inputs").column("reason").to_pylist()
    assert rejected and all("over the input limit of 250" in r for r in rejected)


def test_user_errors_exit_2_with_a_clear_line(where, tmp_path, capsys):
    assert main(["eval", *where, "--set", f"model.path={tmp_path}/no-model"]) == 2
    assert "model.path=" in capsys.readouterr().err
    assert main(["eval", *where, "--set", f"evaluation.dataset={tmp_path}/none.jsonl"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["sql", "--set", f"store.catalog_url=sqlite:{tmp_path}/absent.sqlite", "SELECT 1"]) == 2
    assert "no such store" in capsys.readouterr().err
    assert main(["eval", *where, "--set", "engine.name=openai"]) == 2
    assert "engine.base_url: required" in capsys.readouterr().err


def test_sql_interactive_prompt_reports_errors_and_goes_on(where, monkeypatch, capsys):
    assert main(["eval", *where]) == 0
    lines = iter(["SELECT count(*) AS n FROM evaluations", "SELECT * FROM no_such_table", "SELECT 41 + 1 AS x"])

    def fake_input(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)
    capsys.readouterr()
    assert main(["sql", *where]) == 0
    out = capsys.readouterr().out
    assert "│ 1 " in out and "error" in out and "42" in out


def test_the_sql_console_is_read_only_and_reports_a_bad_query_in_one_line(where, tmp_path, capsys):
    store = SegmentStore(f"sqlite:{tmp_path}/lake.sqlite", f"{tmp_path}/data")
    store.create_run("r", {})
    store.append("r", [SampleRow("s1", "p", "solver", 0, "g", 1, [1, 2])], [], [RewardRow("s1", 1.0)])
    store.commit_step("r", 1, {"solver": ["s1"]}, "ckpt/v1")
    capsys.readouterr()
    writes = [
        "DELETE FROM consumptions WHERE learner_step = 1",
        "INSERT INTO policy_versions VALUES ('r', 999, 'fake', NULL, now())",
        "DROP TABLE runs",
        f"ATTACH 'ducklake:sqlite:{tmp_path}/lake.sqlite' AS again (DATA_PATH '{tmp_path}/data/')",
        "COPY runs TO 'runs.csv'",
    ]
    for sql in writes:
        assert main(["sql", *where, sql]) == 2, sql
        err = capsys.readouterr().err
        assert "read-only" in err and "statements are refused" in err and len(err.strip().splitlines()) == 1
    assert store.count("consumptions", "r") == 1 and store.latest_version("r") == (1, "ckpt/v1")
    for sql, message in (("SELEC 1", "Parser Error"), ("SELECT * FROM no_such_table", "no_such_table")):
        assert main(["sql", *where, sql]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert main(["sql", *where, "SELECT count(*) AS n FROM consumptions"]) == 0
    assert "1" in capsys.readouterr().out
