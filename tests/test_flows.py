"""Prefect flows under a real temporary Prefect server (prefect_test_harness), on the tiny model."""

from __future__ import annotations

import pytest
from prefect.testing.utilities import prefect_test_harness

from marsrl_core.config import load_config


@pytest.fixture(scope="session", autouse=True)
def prefect_server():
    with prefect_test_harness(server_startup_timeout=120):
        yield


def small_config(tmp_path, **extra):
    overrides = {
        "store.catalog_url": f"sqlite:{tmp_path}/lake.sqlite", "store.data_path": f"{tmp_path}/data",
        "output_dir": f"{tmp_path}/out", "tracking.mlflow_tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
        "rollout.num_generations": 4, "rollout.downstream_generations": 2, "rollout.problems_per_batch": 2,
        "rollout.segment_tokens": 8, "rollout.solver_max_tokens": 16, "rollout.verifier_max_tokens": 16,
        "rollout.corrector_max_tokens": 16, "rollout.max_turns": 3, "data.num_batches": 2,
        "learner.groups_per_step": 1, "learner.max_steps": 2, "evaluation.num_problems": 2, "evaluation.k": 1,
        "evaluation.max_rounds": 1, **extra}
    return load_config("tiny", None, [f"{k}={v}" for k, v in overrides.items()])


def test_rollout_flow_is_a_dag_of_agent_turns(tmp_path):
    from flows.rollout import rollout_flow
    from marsrl_core.store import SegmentStore

    cfg = small_config(tmp_path)
    results = rollout_flow(cfg, "r1", 0)
    assert len(results) == 3 and results[0]["finished"] == 2 * 4
    store = SegmentStore.from_config(cfg.store)
    turns = store.query("SELECT turn, count(*) AS n FROM samples GROUP BY 1 ORDER BY 1").to_pylist()
    assert turns[0] == {"turn": 0, "n": 8} and turns[1]["n"] == 2 * 2 * 2
    assert store.count("rewards", "r1") == store.count("samples", "r1")


def test_train_flow_runs_rollouts_and_learner_and_evaluates(tmp_path):
    import mlflow

    from flows.train import train_flow
    from marsrl_core.store import SegmentStore

    cfg = small_config(tmp_path)
    result = train_flow(cfg, "t1")
    assert result["learner_steps"] == 2 and "solver_acc" in result["after"] and "vc_acc" in result["before"]
    store = SegmentStore.from_config(cfg.store)
    assert store.latest_version("t1")[0] == 2
    assert store.count("problems", "t1") == 4
    labels = store.query("SELECT label FROM evaluations WHERE run_id = 't1'").column("label").to_pylist()
    assert sorted(labels) == ["after", "before"]
    client = mlflow.MlflowClient(tracking_uri=cfg.tracking.mlflow_tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("marsrl").experiment_id])
    assert any(r.info.run_name == "t1" and "solver/reward_mean" in r.data.metrics for r in runs)


def test_marsrl_train_command_prints_the_before_after_table(tmp_path, capsys):
    from flows.cli import main

    cfg = small_config(tmp_path)
    sets = [f"--set={k}" for k in (f"store.catalog_url={cfg.store.catalog_url}", f"store.data_path={cfg.store.data_path}",
            f"output_dir={cfg.output_dir}", f"tracking.mlflow_tracking_uri={cfg.tracking.mlflow_tracking_uri}")]
    small = [f"--set={k}={v}" for k, v in {"rollout.num_generations": 4, "rollout.downstream_generations": 2,
             "rollout.problems_per_batch": 2, "rollout.segment_tokens": 8, "rollout.solver_max_tokens": 16,
             "rollout.verifier_max_tokens": 16, "rollout.corrector_max_tokens": 16, "rollout.max_turns": 2,
             "data.num_batches": 1, "learner.groups_per_step": 1, "learner.max_steps": 1,
             "evaluation.num_problems": 2, "evaluation.k": 1, "evaluation.max_rounds": 1}.items()]
    assert main(["train", *sets, *small, "--run-id", "cli-run"]) == 0
    out = capsys.readouterr().out
    assert "cli-run" in out and "Solver accuracy" in out and "before" in out and "after" in out


def test_marsrl_core_never_imports_prefect():
    from pathlib import Path

    core = Path(__file__).parents[1] / "marsrl_core"
    offenders = [p.name for p in core.rglob("*.py")
                 if any(line.strip().startswith(("import prefect", "from prefect", "from flows", "import flows",
                                                 "from tasks", "import tasks"))
                        for line in p.read_text().splitlines())]
    assert offenders == []


def test_sft_flow_warm_starts_and_reuses_the_cache(tmp_path):
    from pathlib import Path

    from flows.sft import sft_flow

    cfg = small_config(tmp_path)
    folder = Path(sft_flow(cfg, steps=5, batch_size=4, num_problems=10))
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    assert Path(sft_flow(cfg, steps=5, batch_size=4, num_problems=10)) == folder
