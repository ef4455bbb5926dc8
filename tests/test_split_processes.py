"""Rollout and learner as two OS processes (as a Prefect worker runs deployments), one store between them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from marsrl_core.store import SegmentStore
from tests.configs import assert_exactly_once, process_config_file


@pytest.mark.slow
def test_rollout_and_learner_processes_meet_only_through_the_store(tmp_path):
    # The gate with max_trained_age 1 lets the rollout process decode two steps' worth under the warm
    # start; the third step's groups wait for the learner's versions, so the rollout process has to pick
    # them up from the store (with the default 4, the three steps' groups all decode under version 0).
    learner = {
        "groups_per_step": 2,
        "downstream_groups_per_step": 2,
        "max_steps": 3,
        "learning_rate": 1e-3,
        "max_trained_age": 1,
    }
    path = process_config_file(tmp_path, "split", data={"num_batches": 12}, learner=learner | {"warmup_steps": 0})

    # Each process runs Prefect in ephemeral mode with its own database (two processes writing one
    # ephemeral SQLite database lock each other out; a shared deployment uses a Prefect server instead).
    def env(name):
        return {**os.environ, "PREFECT_LOGGING_LEVEL": "WARNING", "PREFECT_HOME": str(tmp_path / f"prefect-{name}")}

    marsrl = [sys.executable, "-m", "flows.cli"]
    learner = subprocess.Popen(
        [*marsrl, "learn", "--config", str(path), "--run-id", "split", "--idle-timeout", "240"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env("learner"),
    )
    rollout = subprocess.run(
        [*marsrl, "rollout", "--config", str(path), "--run-id", "split", "--finish"],
        capture_output=True,
        text=True,
        env=env("rollout"),
        timeout=600,
    )
    assert rollout.returncode == 0, rollout.stdout[-3000:] + rollout.stderr[-3000:]
    out, _ = learner.communicate(timeout=600)
    assert learner.returncode == 0, out[-3000:]
    store = SegmentStore(f"sqlite:{tmp_path}/lake.sqlite", f"{tmp_path}/data")
    assert store.latest_version("split")[0] == 3  # versions advanced to the step budget
    # The rollout process starts no batch once the learner has its steps (at most the 12 batches' 24
    # problems are recorded); whatever it admitted, it decoded to the end.
    assert 0 < store.count("problems", "split") <= 24
    assert store.count("rewards", "split") == store.count("samples", "split")
    assert_exactly_once(store, "split")
    # Every committed checkpoint is whole, and segments were decoded under more than one version only if the
    # rollout process picked the learner's checkpoints up from the store.
    versions = store.query("SELECT DISTINCT policy_version FROM segments").column("policy_version").to_pylist()
    print("policy versions seen by the rollout process:", sorted(versions))
    assert max(versions) >= 1
