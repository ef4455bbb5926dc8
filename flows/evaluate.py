"""The evaluate flow: Solver, Verifier, Corrector and V-C metrics of a policy, into store and MLflow,
and as a Markdown artifact (`marsrl-<run>-<label>`) on the run's page in the Prefect UI."""

from __future__ import annotations

import re
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from flows.params import run_config
from marsrl_core.config import MarsRLConfig, default_config
from marsrl_core.runtime.report import report_markdown
from tasks.evaluation import evaluate


@flow(name="evaluate", flow_run_name="evaluate-{run_id}-{label}", log_prints=True)
def evaluate_flow(
    config: MarsRLConfig = default_config(),
    run_id: str = "manual",
    label: str = "eval",
    checkpoint: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> dict:
    metrics = evaluate(run_config(config, overrides), run_id, label, checkpoint)
    create_markdown_artifact(
        key=artifact_key(f"{run_id}-{label}"),
        markdown=report_markdown(run_id, {label: metrics}),
        description=f"MarsRL run {run_id}: evaluation {label!r}",
    )
    return metrics


def artifact_key(run_id: str) -> str:
    """The Prefect artifact key of a run's results (lowercase letters, digits and dashes)."""
    return "marsrl-" + re.sub(r"[^a-z0-9-]+", "-", run_id.lower()).strip("-")
