"""Rollout and learner together in one process: pipelined and synchronous loops on the tiny model."""

from __future__ import annotations

import itertools

import pytest

from marsrl_core.agents.problems import Problem
from marsrl_core.agents.roles import TINY_TEMPLATES, Roles
from marsrl_core.config import load_config
from marsrl_core.demo.tiny import build_tiny_model
from marsrl_core.engines.hf import HFEngine
from marsrl_core.learn.learner import Learner
from marsrl_core.learn.pipeline import run_pipelined, run_synchronous
from marsrl_core.rollout.scheduler import RolloutScheduler
from marsrl_core.store import SegmentStore


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), max_position_embeddings=256)


def _setup(tmp_path, folder, **rollout):
    overrides = {
        "num_generations": 4,
        "downstream_generations": 2,
        "segment_tokens": 4,
        "solver_max_tokens": 12,
        "verifier_max_tokens": 8,
        "corrector_max_tokens": 12,
        "problems_per_batch": 2,
        "max_turns": 3,
        "max_staleness": 2,
        **rollout,
    }
    cfg = load_config(
        "tiny",
        None,
        [
            f"store.catalog_url=sqlite:{tmp_path}/lake.sqlite",
            f"store.data_path={tmp_path}/data",
            "learner.groups_per_step=2",
            "learner.downstream_groups_per_step=2",
            "learner.learning_rate=1e-3",
            "learner.warmup_steps=0",
        ]
        + [f"rollout.{k}={v}" for k, v in overrides.items()],
    )
    store = SegmentStore.from_config(cfg.store)
    engine = HFEngine.from_pretrained(folder)
    problems = (
        Problem(f"p{i}", f"{i % 10}+{(i * 3) % 10}", str((i % 10 + i * 3 % 10) % 10)) for i in itertools.count()
    )
    scheduler = RolloutScheduler(
        cfg, store, "run", engine, engine.tokenizer, Roles.from_config(base=TINY_TEMPLATES), problems
    )
    learner = Learner(cfg, store, "run", folder, tmp_path / "ckpt", engine.tokenizer)
    return cfg, store, engine, scheduler, learner


def test_pipelined_loop_trains_while_rollouts_continue(tmp_path, folder):
    _, store, engine, scheduler, learner = _setup(tmp_path, folder)
    result = run_pipelined(scheduler, learner, max_steps=3)
    assert result.steps == 3 and store.latest_version("run")[0] == 3
    # The engine moved to newer versions mid-run, and segments record them.
    versions = set(store.query("SELECT DISTINCT policy_version FROM segments").column("policy_version").to_pylist())
    assert len(versions) >= 2 and engine.policy_version >= 1
    twice = store.query("SELECT count(*) AS n FROM (SELECT sample_id FROM consumptions GROUP BY 1 HAVING count(*) > 1)")
    assert twice.column("n")[0].as_py() == 0
    spans = store.query("SELECT max(policy_version) - min(policy_version) AS s FROM segments GROUP BY sample_id")
    assert max(spans.column("s").to_pylist()) <= 2


def test_synchronous_loop_decodes_whole_batches_before_training(tmp_path, folder):
    _, store, engine, scheduler, learner = _setup(tmp_path, folder)
    result = run_synchronous(scheduler, learner, max_steps=2)
    assert result.steps == 2
    # Every sample decoded under a single version: nothing spans versions in the baseline.
    spans = store.query("SELECT max(policy_version) - min(policy_version) AS s FROM segments GROUP BY sample_id")
    assert max(spans.column("s").to_pylist()) == 0
    # Each consumed sample finished before the first step of its batch was committed.
    late = (
        store.query("""SELECT count(*) AS n FROM consumptions c JOIN rewards r USING (sample_id)
                          JOIN policy_versions v ON v.version = c.learner_step
                          WHERE r.created_at > v.created_at""")
        .column("n")[0]
        .as_py()
    )
    assert late == 0
