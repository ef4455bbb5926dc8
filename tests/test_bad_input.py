"""Bad input, end to end, through the public entry points: one table, one row per kind of bad input.

Each row feeds its input through the `marsrl` command (dataset files, config values, model folders)
and states what must come back: a clear error naming the input (exit status 2, one line, no traceback),
or, for bad rows inside a usable dataset, the rows skipped and recorded in the store while the good
rows are still evaluated. Model outputs with no verdict or answer go through the rollout scheduler:
they get a defined reward (0) and are counted in the store (`rewards_per_agent.unparsable`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flows.cli import main
from marsrl_core.agents.problems import Problem
from marsrl_core.agents.roles import TINY_TEMPLATES, Roles
from marsrl_core.config import load_config
from marsrl_core.demo.tiny import build_tiny_model
from marsrl_core.rollout.scheduler import RolloutScheduler
from marsrl_core.store import SegmentStore
from tests.configs import process_config_file, set_args
from tests.scripted import ScriptedEngine

GOOD = json.dumps({"query": "1+2", "ans_box": "3"})


def _jsonl(lines: list[bytes]):
    def make(tmp: Path) -> list[str]:
        path = tmp / "problems.jsonl"
        path.write_bytes(b"\n".join(lines) + b"\n")
        return ["--set", f"evaluation.dataset={path}"]

    return make


def _model(edit):
    """A tiny model folder, changed by `edit(folder)` before it is given as model.path."""

    def make(tmp: Path) -> list[str]:
        folder = build_tiny_model(tmp / "model", hidden_size=64, num_heads=2)
        edit(folder)
        return ["--set", f"model.path={folder}"]

    return make


def _cut_short(folder: Path) -> None:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def _pickle_only(folder: Path) -> None:
    torch.save({}, folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()


def _no_pad_token(folder: Path) -> None:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = folder / name
        if path.exists():
            data = json.loads(path.read_text())
            data.pop("pad_token", None)
            path.write_text(json.dumps(data))


# (name, setup -> extra CLI args, exit status, text the message must contain, rows rejected and recorded)
CASES = [
    ("malformed dataset rows", _jsonl([b"{not json", GOOD.encode()]), 0, None, {"line 1": "invalid JSON"}),
    (
        "missing answers",
        _jsonl([json.dumps({"query": "1+2"}).encode(), GOOD.encode()]),
        0,
        None,
        {"line 1": "missing field(s) 'ans_box'"},
    ),
    (
        "oversized prompts",
        _jsonl([json.dumps({"query": "1+" * 400 + "1", "ans_box": "1"}).encode(), GOOD.encode()]),
        0,
        None,
        {"line 1": "over the input limit"},
    ),
    (
        "non-UTF-8 bytes",
        _jsonl([b'{"query": "\xff\xfe", "ans_box": "1"}', GOOD.encode()]),
        0,
        None,
        {"line 1": "not UTF-8"},
    ),
    ("empty dataset", _jsonl([]), 2, "no usable problems (empty)", {}),
    (
        "config with invalid values",
        lambda tmp: ["--set", "rollout.segment_tokens=0"],
        2,
        "rollout.segment_tokens=0",
        {},
    ),
    (
        "config naming an unknown field",
        lambda tmp: ["--set", "learner.learning_rat=1e-3"],
        2,
        "learner.learning_rat",
        {},
    ),
    ("missing model folder", lambda tmp: ["--set", f"model.path={tmp}/nowhere"], 2, "nowhere", {}),
    ("checkpoint folder cut short", _model(_cut_short), 2, "model.safetensors", {}),
    ("pickle-only checkpoint (refused)", _model(_pickle_only), 2, "pickle checkpoints are refused", {}),
    ("tokenizer without a pad token (pads with EOS)", _model(_no_pad_token), 0, None, {}),
]


@pytest.mark.parametrize("name,setup,status,message,rejected", CASES, ids=[c[0] for c in CASES])
def test_bad_input_through_the_marsrl_command(tmp_path, capsys, name, setup, status, message, rejected):
    small = {
        "evaluation.num_problems": 2,
        "evaluation.k": 1,
        "evaluation.max_rounds": 1,
        "model.max_prompt_tokens": 256,
    }
    store_args = set_args(tmp_path, **small)
    code = main(["eval", *store_args, *setup(tmp_path)])
    captured = capsys.readouterr()
    assert code == status, captured.err[-2000:]
    if status:
        assert captured.err.startswith("error: ") and message in captured.err
        assert "Traceback" not in captured.err and len(captured.err.strip().splitlines()) == 1
        return
    assert "Solver accuracy" in captured.out  # the good rows were evaluated
    store = SegmentStore(f"sqlite:{tmp_path}/lake.sqlite", f"{tmp_path}/data", create=False)
    rows = store.query("SELECT location, reason FROM rejected_inputs").to_pylist()
    assert {r["location"]: r["reason"] for r in rows}.keys() == rejected.keys()
    for row in rows:
        assert rejected[row["location"]] in row["reason"]
    assert store.count("evaluations") == 1


def test_model_outputs_without_verdict_or_answer_get_zero_reward_and_are_counted(tmp_path):
    cfg = load_config(
        "tiny",
        None,
        [
            f"store.catalog_url=sqlite:{tmp_path}/lake.sqlite",
            f"store.data_path={tmp_path}/data",
            "rollout.num_generations=2",
            "rollout.downstream_generations=2",
            "rollout.segment_tokens=8",
            "rollout.problems_per_batch=2",
            "rollout.max_turns=2",
        ],
    )
    store = SegmentStore.from_config(cfg.store)
    engine = ScriptedEngine(lambda prompt: "I am not sure." if prompt.startswith("S|") else "looks fine to me")
    problems = [Problem(f"p{i}", f"{i}+1", str(i + 1)) for i in range(2)]
    scheduler = RolloutScheduler(
        cfg, store, "garbage", engine, engine.tokenizer, Roles.from_config(base=TINY_TEMPLATES), iter(problems)
    )
    scheduler.run()
    rewards = store.query(
        "SELECT s.agent, r.reward, r.outcome FROM rewards r JOIN samples s USING (sample_id)"
    ).to_pylist()
    assert {r["agent"] for r in rewards} == {"solver", "verifier"}
    assert all(r["reward"] == 0.0 for r in rewards)
    assert {r["outcome"] for r in rewards if r["agent"] == "solver"} == {"no_answer"}
    assert {r["outcome"] for r in rewards if r["agent"] == "verifier"} == {"no_verdict"}
    counted = store.query(
        "SELECT agent, sum(unparsable) AS n, sum(samples) AS total FROM rewards_per_agent GROUP BY agent ORDER BY agent"
    ).to_pylist()
    assert [(c["agent"], c["n"]) for c in counted] == [("solver", 4), ("verifier", 8)]
    assert all(c["n"] == c["total"] for c in counted)


@pytest.mark.parametrize("content", [None, '{"query": "no answer"}\n{"query": "bad \\ud800", "ans_box": "1"}\n'])
def test_marsrl_train_refuses_an_unusable_training_file_before_any_work(tmp_path, capsys, content):
    """A missing training file, or one with no good row (here a row without its answer and one that is
    not valid Unicode), fails `marsrl train` with one line before the run is recorded or evaluated."""
    data = tmp_path / "train.jsonl"
    if content is not None:
        data.write_text(content)
    args = set_args(tmp_path, **{"data.train_dataset": data, "sft.enabled": False})
    assert main(["train", *args, "--results", ""]) == 2
    err = capsys.readouterr().err
    assert str(data) in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert ("no such file" if content is None else "no usable problems") in err
    assert not (tmp_path / "lake.sqlite").exists()  # no store opened, no run recorded, nothing evaluated


@pytest.mark.slow
def test_a_resume_from_a_corrupt_checkpoint_fails_in_one_line_naming_the_file(tmp_path):
    """A run's last committed checkpoint cut short: `marsrl train --resume` exits 2 with one line that
    names the file, before any flow starts (no traceback)."""
    path = process_config_file(
        tmp_path, "corrupt", learner={"max_steps": 1}, evaluation={"num_problems": 2, "k": 1}, sft={"enabled": False}
    )
    env = {**os.environ, "PREFECT_LOGGING_LEVEL": "WARNING", "PREFECT_HOME": str(tmp_path / "prefect")}
    marsrl = [sys.executable, "-m", "flows.cli", "train", "--config", str(path), "--results", ""]
    first = subprocess.run([*marsrl, "--run-id", "c"], env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    (weights,) = (tmp_path / "out").rglob("v1/policy/model.safetensors")
    state = weights.parent.parent / "trainer_state.safetensors"
    for cut in (state, weights):  # the trainer state (optimizer, RNG), then the weights
        whole = cut.read_bytes()
        cut.write_bytes(whole[:1000])
        resumed = subprocess.run([*marsrl, "--resume", "c"], env=env, capture_output=True, text=True, timeout=600)
        assert resumed.returncode == 2, resumed.stdout[-2000:] + resumed.stderr[-2000:]
        errors = [line for line in resumed.stderr.splitlines() if line.strip()]
        assert len(errors) == 1 and errors[0].startswith("error: ") and str(cut) in errors[0], resumed.stderr
        cut.write_bytes(whole)


def test_evaluation_skips_and_records_a_prompt_that_does_not_fit_the_context(tmp_path, capsys):
    """A problem whose Solver prompt fits `model.max_prompt_tokens` but not the model's context with the
    Solver's budget: `marsrl eval` leaves that branch out, counts it in the report, records it (agent
    and problem) among the rejected inputs, and evaluates the rest."""
    folder = build_tiny_model(tmp_path / "model", hidden_size=64, num_heads=2, max_position_embeddings=256)
    dataset = tmp_path / "problems.jsonl"
    dataset.write_text(GOOD + "\n" + json.dumps({"query": "1+" * 80 + "1", "ans_box": "81"}) + "\n")
    small = {"evaluation.num_problems": 2, "evaluation.k": 1, "evaluation.max_rounds": 1}
    args = set_args(tmp_path, **small, **{"model.max_prompt_tokens": 256, "rollout.solver_max_tokens": 96})
    code = main(["eval", *args, "--set", f"model.path={folder}", "--set", f"evaluation.dataset={dataset}"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-2000:]
    assert "prompts skipped as too long: solver" in captured.out
    store = SegmentStore(f"sqlite:{tmp_path}/lake.sqlite", f"{tmp_path}/data", create=False)
    (row,) = store.query("SELECT source, location, reason FROM rejected_inputs").to_pylist()
    assert row["source"].startswith("evaluation:") and row["location"].endswith(": solver")
    assert "solver prompt of" in row["reason"] and "exceeds the engine context of 256" in row["reason"]
    (recorded,) = store.query("SELECT metrics_json FROM evaluations").column("metrics_json").to_pylist()
    assert json.loads(recorded)["skipped_solver"] == 1.0


@pytest.mark.slow
def test_a_learning_rate_that_blows_the_weights_up_stops_the_run_in_one_line(tmp_path):
    """`--set learner.learning_rate=1e30`: the first step's update leaves weights of ~1e30. The run stops
    there with one line naming the step, the parameter and the setting, exit 1, no traceback; no version
    is published, the other processes of the run can see why (a `diverged` run event)."""
    from marsrl_core.runtime.events import DIVERGED

    # The tiny preset from its committed warm start: its first groups' rewards differ, so step 1 updates.
    settings = {"learner.max_steps": 3, "data.num_batches": 3, "evaluation.num_problems": 2, "evaluation.k": 1}
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    command = [sys.executable, "-m", "flows.cli", "train", "--run-id", "lr", "--results", ""]
    command += set_args(tmp_path, **settings, **{"learner.learning_rate": "1e30"})
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    output = run.stdout + run.stderr
    assert run.returncode == 1, output[-3000:]
    assert "Traceback" not in output and "| ERROR" not in output, output[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, run.stderr[-3000:]
    assert re.match(
        r"error: learner step 1: the update made policy's parameter \S+ \S+ in absolute value "
        r"\(past learner.max_weight_abs = 10000\); .* look at learner.learning_rate \(1e\+30\)$",
        errors[0],
    ), errors[0]
    store = SegmentStore(f"sqlite:{tmp_path}/lake.sqlite", f"{tmp_path}/data")
    assert store.latest_version("lr") is None
    assert store.event_details("lr", DIVERGED) == [errors[0].removeprefix("error: ")]
