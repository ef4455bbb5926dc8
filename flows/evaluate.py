"""The evaluate flow: Solver, Verifier, Corrector and V-C metrics of a policy, into store and MLflow."""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.params import run_config
from marsrl_core.config import MarsRLConfig, default_config
from tasks.evaluation import evaluate


@flow(name="evaluate", log_prints=True)
def evaluate_flow(
    config: MarsRLConfig = default_config(),
    run_id: str = "manual",
    label: str = "eval",
    checkpoint: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> dict:
    return evaluate(run_config(config, overrides), run_id, label, checkpoint)
