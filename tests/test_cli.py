"""The `marsrl` command end to end on the tiny model: eval, train (as built so far), sql, errors."""

from __future__ import annotations

import json

import pytest

from marsrl_core.cli import main
from marsrl_core.store import SegmentStore
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
