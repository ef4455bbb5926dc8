"""Deployments: a real Prefect server started by the test, the deployments served, a run triggered
through the API (as the UI does). docker-compose.yml is tested in test_stack."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from marsrl_core.config import config_to_yaml
from tests.configs import small_config
from tests.servers import stop_process

ROOT = Path(__file__).parents[1]


@pytest.mark.slow
def test_served_deployment_runs_when_triggered_through_the_api(tmp_path, prefect_server):
    from flows.cli import main as _  # noqa: F401  (import check before spawning)
    from marsrl_core.store import SegmentStore

    api, env = prefect_server
    served = None
    try:
        # The deployments' config is the served one (the small test config, here from a YAML file); the
        # run changes three fields of it, one through a `config` given in part and two through
        # `overrides`, as the UI, the API or `prefect deployment run --params` would.
        cfg = small_config(tmp_path, **{"learner.max_steps": 2, "data.num_batches": 3})
        (tmp_path / "served.yaml").write_text(config_to_yaml(cfg))
        served = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "flows.cli",
                "serve",
                "--cron",
                "0 2 * * *",
                "--config",
                str(tmp_path / "served.yaml"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=tmp_path,
        )
        overrides = {"data.num_batches": 1, "learner.max_steps": 1}
        parameters = {"config": {"rollout": {"max_turns": 2}}, "overrides": overrides, "run_id": "ui-run"}
        state, deployment = asyncio.run(_trigger(api, parameters, served))
        assert state == "COMPLETED"
        assert deployment.schedules  # the train deployment carries its nightly schedule
        # The UI's run form, built from the deployment's schema: the preset is a read-only record of
        # where the served values started.
        form = deployment.parameter_openapi_schema["definitions"]["MarsRLConfig"]["properties"]
        assert "seed" in form and form["preset"]["readOnly"] is True
        assert deployment.parameters["config"]["preset"] == "tiny"
        store = SegmentStore.from_config(cfg.store)
        assert store.count("segments") > 0 and store.latest_version("ui-run")[0] == 1  # the overrides held
        # ... and the rest is the served config: one batch of its 2 problems, not the class defaults' 128
        assert store.count("problems", "ui-run") == cfg.rollout.problems_per_batch == 2
        recorded = store.run_config("ui-run")
        assert recorded["rollout"]["max_turns"] == 2 and recorded["rollout"]["segment_tokens"] == 8
        import mlflow

        client = mlflow.MlflowClient(tracking_uri=cfg.tracking.mlflow_tracking_uri)
        runs = client.search_runs([client.get_experiment_by_name("marsrl").experiment_id])
        assert [r.info.run_name for r in runs] == ["ui-run"]
    finally:
        stop_process(served)


async def _trigger(api: str, parameters: dict, served: subprocess.Popen):
    from prefect.client.orchestration import PrefectClient

    async with PrefectClient(api) as client:
        deadline = time.time() + 120
        while True:  # wait until `marsrl serve` has registered the deployments
            if served.poll() is not None:
                raise AssertionError(f"serve exited: {served.stdout.read()[-3000:]}")
            try:
                deployment = await client.read_deployment_by_name("train/marsrl-train")
                break
            except Exception:
                if time.time() > deadline:
                    raise
                await asyncio.sleep(1)
        run = await client.create_flow_run_from_deployment(deployment.id, parameters=parameters)
        deadline = time.time() + 400
        while time.time() < deadline:
            run = await client.read_flow_run(run.id)
            if run.state and run.state.is_final():
                return run.state.type.value, deployment
            await asyncio.sleep(1)
        raise AssertionError(f"flow run still {run.state.type.value if run.state else None} after 400 s")


def test_the_worker_path_deploys_prefect_yaml_to_a_process_pool_and_a_worker_runs_it(tmp_path, prefect_server):
    """README's worker path with a real server and worker: `prefect deploy` of deployments/prefect.yaml
    (from the repository root, as the README says) into a process work pool, a run of its evaluate
    deployment with a few overrides, and `prefect worker start` running it to completion."""
    from marsrl_core.store import SegmentStore

    api, env = prefect_server
    prefect = [sys.executable, "-m", "prefect"]
    worker = None
    try:

        def prefect_cli(*args: str) -> str:
            done = subprocess.run([*prefect, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            return done.stdout

        prefect_cli("work-pool", "create", "marsrl-process", "--type", "process")
        prefect_cli("--no-prompt", "deploy", "--prefect-file", "deployments/prefect.yaml", "--all")
        listed = prefect_cli("deployment", "ls")
        assert "marsrl-evaluate-pool" in listed and "marsrl-train-pool" in listed
        under = {
            "store.catalog_url": f"sqlite:{tmp_path}/lake.sqlite",
            "store.data_path": f"{tmp_path}/data",
            "output_dir": f"{tmp_path}/out",
            "tracking.mlflow_tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
            "evaluation.num_problems": 2,
            "evaluation.k": 1,
            "evaluation.max_rounds": 1,
        }
        params = json.dumps({"overrides": under, "run_id": "pooled"})
        prefect_cli("deployment", "run", "evaluate/marsrl-evaluate-pool", "--params", params)
        worker = subprocess.Popen(
            [*prefect, "worker", "start", "--pool", "marsrl-process"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
        )
        deadline, recorded = time.time() + 400, None
        while time.time() < deadline:
            if (tmp_path / "lake.sqlite").exists():
                store = SegmentStore(f"sqlite:{tmp_path}/lake.sqlite", f"{tmp_path}/data", create=False)
                recorded = store.evaluation("pooled", "eval")
                store.close()
                if recorded is not None:
                    break
            assert worker.poll() is None, "the worker exited"
            time.sleep(2)
        assert recorded is not None and "solver_acc" in recorded
    finally:
        stop_process(worker)
