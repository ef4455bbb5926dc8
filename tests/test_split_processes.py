"""Rollout and learner as two OS processes (as a Prefect worker runs deployments), one store between them:
a SQLite catalog beside them, or a PostgreSQL one (the cluster shape, the learner's lease an advisory
lock)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from marsrl_core.config import AGENTS
from marsrl_core.store import SegmentStore
from tests.configs import assert_exactly_once, process_config_file

CATALOGS = ("sqlite", "postgres")  # the split run on a SQLite and on a PostgreSQL catalog (conftest)


@pytest.mark.slow
def test_rollout_and_learner_processes_meet_only_through_the_store(tmp_path, store_paths):
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
    catalog, data = store_paths
    store_section = {"catalog_url": catalog, "data_path": data}
    path = process_config_file(
        tmp_path, "split", data={"num_batches": 12}, learner=learner | {"warmup_steps": 0}, store=store_section
    )

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
    store = SegmentStore(catalog, data)
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


def _start(command, env, crash=None):
    """`command` as a process with `env` (its output kept), SIGKILLed at crash point `crash` if given."""
    env = {"PREFECT_LOGGING_LEVEL": "WARNING", **env}
    env.pop("MARSRL_CRASH_AT", None)
    if crash:
        env["MARSRL_CRASH_AT"] = crash
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("catalog_kind", ["postgres"])
def test_split_processes_on_postgres_survive_sigkills_of_each(tmp_path, store_paths, prefect_server):
    """The cluster shape on one machine: one Prefect server, one PostgreSQL catalog, `marsrl rollout`
    and `marsrl learn` as separate processes. The learner is SIGKILLed mid-step (its second update
    applied in memory, not committed) and then mid-checkpoint (half-way through writing the first
    checkpoint its successor writes); the rollout process before its fourth store append (a segment
    decoded, not stored) and again before its second. Each is restarted as soon as it died, while the
    other runs. The run ends with exactly its step budget, nothing stored, rewarded or trained twice,
    and every committed checkpoint loads."""
    from transformers import AutoModelForCausalLM

    _, prefect_env = prefect_server
    catalog, data = store_paths
    steps = 4
    learner_section = {"groups_per_step": 2, "downstream_groups_per_step": 2, "max_steps": steps, "warmup_steps": 0}
    path = process_config_file(
        tmp_path,
        "faults",
        data={"num_batches": 16},
        learner=learner_section
        | {"learning_rate": 1e-3, "max_trained_age": 1, "save_every": 1, "save_total_limit": None},
        store={"catalog_url": catalog, "data_path": data},
    )
    marsrl = [sys.executable, "-m", "flows.cli"]
    commands = {
        "learner": [*marsrl, "learn", "--config", str(path), "--run-id", "faults", "--idle-timeout", "240"],
        "rollout": [*marsrl, "rollout", "--config", str(path), "--run-id", "faults", "--finish"],
    }
    crashes = {
        "learner": ["learner.update:2", "checkpoint.write:1", None],
        "rollout": ["rollout.append:4", "rollout.append:2", None],
    }
    running = {name: _start(commands[name], prefect_env, crashes[name].pop(0)) for name in commands}
    kills, deadline = [], time.monotonic() + 900
    while running:
        assert time.monotonic() < deadline, f"still running: {sorted(running)}"
        for name, proc in list(running.items()):
            if proc.poll() is None:
                continue
            out = proc.stdout.read()
            if proc.returncode == -9 and crashes[name]:  # killed at its crash point: restarted at once
                kills.append(name)
                running[name] = _start(commands[name], prefect_env, crashes[name].pop(0))
            else:
                assert proc.returncode == 0 and not crashes[name], f"{name} {proc.returncode}: {out[-3000:]}"
                del running[name]
        time.sleep(0.2)
    assert sorted(kills) == ["learner", "learner", "rollout", "rollout"]

    store = SegmentStore(catalog, data)
    versions = store.query(
        "SELECT version, checkpoint_uri FROM policy_versions WHERE run_id = 'faults' ORDER BY version"
    ).to_pylist()
    assert [v["version"] for v in versions] == list(range(1, steps + 1))
    assert store.count("rewards", "faults") == store.count("samples", "faults")
    assert_exactly_once(store, "faults")
    for row in versions:
        AutoModelForCausalLM.from_pretrained(f"{row['checkpoint_uri']}/policy")


@pytest.mark.slow
@pytest.mark.parametrize("catalog_kind", ["postgres"])
def test_a_learner_waits_for_rollouts_and_trains_what_finished_rollouts_left(tmp_path, store_paths, prefect_server):
    """A learner started while no rollout runs waits for groups and, at its idle timeout, says so and
    ends; one started after the rollouts finished trains what they left and ends without waiting."""
    _, prefect_env = prefect_server
    prefect_env = {**prefect_env, "PREFECT_LOGGING_LEVEL": "INFO"}  # the learner's own lines (`say`) show
    catalog, data = store_paths
    learner_section = {"groups_per_step": 2, "downstream_groups_per_step": 2, "max_steps": 50, "warmup_steps": 0}
    path = process_config_file(
        tmp_path, "late", learner=learner_section, store={"catalog_url": catalog, "data_path": data}
    )
    marsrl = [sys.executable, "-m", "flows.cli"]
    learn = [*marsrl, "learn", "--config", str(path), "--run-id", "late"]

    early = _start([*learn, "--idle-timeout", "5"], prefect_env)
    out, _ = early.communicate(timeout=300)
    assert early.returncode == 0, out[-3000:]
    assert "learner stopped at step 0 of 50: no complete group arrived for 5 s (its idle timeout)" in out
    store = SegmentStore(catalog, data)
    assert store.latest_version("late") is None

    rollout = _start(
        [*marsrl, "rollout", "--config", str(path), "--run-id", "late", "--batches", "0", "1", "--finish"], prefect_env
    )
    out, _ = rollout.communicate(timeout=600)
    assert rollout.returncode == 0, out[-3000:]
    start = time.monotonic()
    late = _start([*learn, "--idle-timeout", "600"], prefect_env)
    out, _ = late.communicate(timeout=600)
    assert late.returncode == 0, out[-3000:]
    assert time.monotonic() - start < 300  # it ended when nothing was left, not at its idle timeout
    trained = store.latest_version("late")[0]
    assert 1 <= trained < 50 and f"learner stopped at step {trained} of 50: the rollouts finished" in out
    assert_exactly_once(store, "late")
    # Every complete group the two batches left was trained on (or dropped as too old): none is left.
    left = store.trainable_groups_by_agent("late", AGENTS, limit={a: 100 for a in AGENTS}, min_version=None)
    assert not any(left.values()), left
