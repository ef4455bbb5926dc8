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
    assert "evaluation solver: 3 outputs to decode" in out and "evaluation corrector: done" in out  # not a terminal
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


def _project_store(root) -> SegmentStore:
    """A store where the default config puts it: `marsrl/lake.sqlite` under the project folder `root`."""
    root.mkdir(parents=True, exist_ok=True)
    store = SegmentStore(f"sqlite:{root}/marsrl/lake.sqlite", f"{root}/marsrl/lake_data/")
    store.create_run("run-a", {})
    store.append("run-a", [SampleRow("s1", "p", "solver", 0, "g", 1, [1, 2])], [], [RewardRow("s1", 1.0)])
    store.commit_step("run-a", 1, {"solver": ["s1"]}, "ckpt/v1")
    return store


def test_sql_finds_the_projects_store_from_a_subfolder_or_says_how_to_point_at_it(tmp_path, monkeypatch, capsys):
    _project_store(tmp_path / "project")
    (tmp_path / "project" / "notebooks" / "deep").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "project" / "notebooks" / "deep")
    assert main(["sql", "SELECT count(*) AS consumed FROM consumptions WHERE run_id = 'run-a'"]) == 0
    assert "│ 1 " in capsys.readouterr().out
    assert main(["compact"]) == 0  # maintenance finds it the same way
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["sql", "SELECT 1"]) == 2
    err = capsys.readouterr().err
    assert "no such store in" in err and "--set store.catalog_url=sqlite:" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "elsewhere" / "marsrl").exists()  # nothing created where none was


def test_the_sql_banner_examples_run_against_the_newest_run(tmp_path):
    from marsrl_core.store.console import banner

    store = _project_store(tmp_path)
    text = banner(store)
    assert "train_step_metrics" in text and "WHERE run_id = 'run-a'" in text
    examples = [line.strip().rstrip(";") for line in text.splitlines() if line.startswith("  SELECT")]
    assert len(examples) >= 5
    for sql in examples:  # each example is valid SQL over the schema (the tables may be empty)
        store.query(sql)


def test_the_sql_prompt_keeps_a_history_that_the_up_arrow_recalls(tmp_path):
    """Through a real terminal (a pty): one session runs a query; the next recalls it with the up arrow."""
    import os
    import pty
    import select
    import subprocess
    import sys
    import time

    _project_store(tmp_path)
    history = tmp_path / "history"
    env = {**os.environ, "MARSRL_SQL_HISTORY": str(history), "TERM": "xterm"}

    def session(keys: list[bytes], expect: bytes) -> bytes:
        leader, follower = pty.openpty()
        proc = subprocess.Popen(
            [sys.executable, "-m", "marsrl_core.cli", "sql"],
            cwd=tmp_path,
            env=env,
            stdin=follower,
            stdout=follower,
            stderr=follower,
        )
        os.close(follower)
        seen, deadline, pending = b"", time.monotonic() + 60, list(keys)
        while time.monotonic() < deadline and proc.poll() is None:
            if select.select([leader], [], [], 0.2)[0]:
                try:
                    seen += os.read(leader, 65536)
                except OSError:
                    break
            if pending and seen.endswith(b"marsrl> "):
                os.write(leader, pending.pop(0))
                seen += b"<sent>"
        proc.wait(timeout=30)
        os.close(leader)
        assert expect in seen, seen[-2000:]
        return seen

    session([b"SELECT 40 + 2 AS answer\r", b"\x04"], b"42")
    assert "SELECT 40 + 2 AS answer" in history.read_text()
    session([b"\x1b[A\r", b"\x04"], b"42")  # up arrow, then Enter: the last session's query again


def test_each_commands_help_lists_its_settings_with_defaults_and_an_example(capsys):
    from flows.cli import main as marsrl

    for command, setting in (
        ("eval", "evaluation.dataset = None"),
        ("sql", "store.catalog_url = sqlite:"),
        ("train", "learner.max_steps = 50"),
        ("learn", "learner.nproc = 1"),
    ):
        with pytest.raises(SystemExit) as exit_:
            marsrl([command, "--help"])
        out = capsys.readouterr().out
        assert exit_.value.code == 0 and setting in out and f"example:\n  marsrl {command}" in out, command


QUIET_CHECK = """
import logging, sys
from marsrl_core.cli import set_engine_verbosity
set_engine_verbosity(sys.argv[1] == "-v")
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging, init_logger
configure_logging(LoggingConfig())  # what a vLLM engine does as it starts
init_logger("vllm.startup").info("vllm-info-line")
import mlflow  # noqa: F401
logging.getLogger("mlflow.store.db.utils").info("mlflow-info-line")
"""


def test_vllm_and_mlflow_info_lines_show_only_with_v(tmp_path):
    import os
    import subprocess
    import sys

    pytest.importorskip("vllm")
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_LOGGING_LEVEL", "MLFLOW_LOGGING_LEVEL")}
    shown = {}
    for flag in ("-q", "-v"):
        run = subprocess.run([sys.executable, "-c", QUIET_CHECK, flag], env=env, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-2000:]
        shown[flag] = {line for line in ("vllm-info-line", "mlflow-info-line") if line in run.stdout + run.stderr}
    assert shown == {"-q": set(), "-v": {"vllm-info-line", "mlflow-info-line"}}
