"""A small configuration for end-to-end tests (tiny model, short budgets, one or two batches)."""

from __future__ import annotations

from pathlib import Path

import yaml

from marsrl_core.config import MarsRLConfig, load_config


def _under(tmp_path) -> dict[str, str]:
    """Overrides that put a run's store, outputs and MLflow database under `tmp_path`."""
    return {
        "store.catalog_url": f"sqlite:{tmp_path}/lake.sqlite",
        "store.data_path": f"{tmp_path}/data",
        "output_dir": f"{tmp_path}/out",
        "tracking.mlflow_tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
    }


def assert_exactly_once(store, run_id: str) -> None:
    """Every exactly-once invariant of the run holds (`marsrl check`): nothing stored, rewarded or
    consumed twice, no segment missing."""
    broken = {name: count for name, count in store.invariants(run_id).items() if count}
    assert not broken, f"run {run_id}: broken store invariants {broken}"


def set_args(tmp_path, **extra) -> list[str]:
    """`--set` options for a `marsrl` command: store and outputs under `tmp_path`, then `extra` (dotted keys)."""
    overrides = {key: value for key, value in _under(tmp_path).items() if not key.startswith("tracking.")}
    return [arg for key, value in {**overrides, **extra}.items() for arg in ("--set", f"{key}={value}")]


def rollout_config(tmp_path, base: dict, **rollout) -> MarsRLConfig:
    """The tiny preset with its store under `tmp_path` and the `rollout` section's `base` fields, then
    `rollout` (field=value), over them."""
    store = [f"store.catalog_url=sqlite:{tmp_path}/lake.sqlite", f"store.data_path={tmp_path}/data"]
    return load_config("tiny", None, store + [f"rollout.{k}={v}" for k, v in {**base, **rollout}.items()])


def small_config(tmp_path, **extra) -> MarsRLConfig:
    """Everything under `tmp_path`; `extra` overrides dotted keys. One group per agent per step (the
    downstream count is pinned too: override both to change the step's size)."""
    overrides = {
        **_under(tmp_path),
        "rollout.num_generations": 4,
        "rollout.downstream_generations": 2,
        "rollout.problems_per_batch": 2,
        "rollout.segment_tokens": 8,
        "rollout.solver_max_tokens": 16,
        "rollout.verifier_max_tokens": 16,
        "rollout.corrector_max_tokens": 16,
        "rollout.max_turns": 3,
        "data.num_batches": 2,
        "learner.groups_per_step": 1,
        "learner.downstream_groups_per_step": 1,
        "learner.max_steps": 2,
        "evaluation.num_problems": 2,
        "evaluation.k": 1,
        "evaluation.max_rounds": 1,
        "sft.enabled": False,
        **extra,
    }
    return load_config("tiny", None, [f"{k}={v}" for k, v in overrides.items()])


def process_config_file(tmp_path, name: str, **sections) -> Path:
    """A YAML file for `marsrl` subprocesses: everything under `tmp_path`, short budgets, three turns;
    `sections` (data, learner, ...) are added as given."""
    config = {
        "store": {"catalog_url": f"sqlite:{tmp_path}/lake.sqlite", "data_path": f"{tmp_path}/data"},
        "output_dir": f"{tmp_path}/out",
        "tracking": {"mlflow_tracking_uri": f"sqlite:///{tmp_path}/mlflow.db"},
        "rollout": {
            "num_generations": 4,
            "downstream_generations": 2,
            "problems_per_batch": 2,
            "segment_tokens": 8,
            "solver_max_tokens": 24,
            "verifier_max_tokens": 16,
            "corrector_max_tokens": 24,
            "max_turns": 3,
        },
        **sections,
    }
    path = Path(tmp_path) / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


# The CI learning test's short run (tests/test_learning.py; its margins are measured over seeds by
# benchmarks/learning_spread.py): the tiny preset from its committed warm start, 50 learner steps on up to 20
# batches, evaluated before and after on 512 held-out problems x 2 samples (the make train evaluation).
LEARNING_RUN = {"learner.max_steps": 50, "data.num_batches": 20, "evaluation.num_problems": 512, "evaluation.k": 2}


def learning_config(tmp_path, seed: int = 0, extra: list[str] | None = None) -> MarsRLConfig:
    """The short learning run under `tmp_path`, with `seed` for RL sampling and the held-out problems
    (the warm start stays the committed one of the tiny preset with `extra`, made with the preset's own
    seed: `data.verifier=code` has its own); `extra` overrides (`key=value`) come last."""
    from marsrl_core.demo.sft import COMMITTED, find_warm_start

    folder = find_warm_start(load_config("tiny", None, list(extra or [])))
    if folder is None or folder.parent != COMMITTED:
        raise RuntimeError(
            f"no committed warm start for the tiny preset with {extra or 'no overrides'} in {COMMITTED} (make it "
            "with `marsrl sft --set output_dir=demo/warm-starts` and those overrides)"
        )
    overrides = {**_under(tmp_path), "model.path": str(folder), "seed": seed, **LEARNING_RUN}
    return load_config("tiny", None, [f"{k}={v}" for k, v in overrides.items()] + list(extra or []))
