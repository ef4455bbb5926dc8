"""Serve the MarsRL flows as Prefect deployments from this process (`marsrl serve`).

Deployments: `train` on a nightly schedule (cron, configurable), `rollout`, `learner`, `evaluate`, `sft`
(run on demand from the UI with their parameters), and `maintenance` (hourly DuckLake compaction).
Every deployment takes the full pydantic config as a parameter, so the UI shows it as a form.
For the worker path (a process work pool) see `prefect.yaml` beside this file.
"""

from __future__ import annotations

from prefect import serve

from flows.evaluate import evaluate_flow
from flows.learner import learner_flow
from flows.maintenance import maintenance_flow
from flows.rollout import rollout_flow
from flows.sft import sft_flow
from flows.train import train_flow
from marsrl_core.config import MarsRLConfig


def deployments(config: MarsRLConfig, train_cron: str | None = "0 2 * * *", maintenance_cron: str | None = "0 * * * *"):
    params = {"config": config.model_dump(mode="json")}
    return [
        train_flow.to_deployment(
            name="marsrl-train",
            cron=train_cron,
            parameters=params,
            description="MarsRL training run: rollouts and learner concurrently, then evaluation.",
        ),
        rollout_flow.to_deployment(name="marsrl-rollout", parameters=params | {"run_id": "manual", "batch_index": 0}),
        learner_flow.to_deployment(name="marsrl-learner", parameters=params | {"run_id": "manual"}),
        evaluate_flow.to_deployment(name="marsrl-evaluate", parameters=params | {"run_id": "manual"}),
        maintenance_flow.to_deployment(name="marsrl-maintenance", cron=maintenance_cron, parameters=params),
        sft_flow.to_deployment(name="marsrl-sft", parameters=params),
    ]


def serve_all(config: MarsRLConfig, train_cron: str | None = "0 2 * * *", limit: int | None = None) -> None:
    """Serve every deployment until interrupted (blocks)."""
    serve(*deployments(config, train_cron), limit=limit)
