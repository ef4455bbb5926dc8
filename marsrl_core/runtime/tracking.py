"""MLflow tracking (imported lazily, so the library works without starting MLflow).

One MLflow run per training run, found again by its `marsrl.run_id` tag: a resumed run continues the
MLflow run it began (the resume is recorded on it as the `marsrl.resumes` tag and a `resumed` metric
at the learner step it resumed from), and the run ends FINISHED, FAILED or KILLED with the training
run (`close`). The config is flattened into params. Per step and agent the
learner's metrics are logged as `<agent>/<metric>` with `step`; each published checkpoint is logged
as artifacts under `checkpoints/v<step>`, registered as a version of the registered model
(`tracking.registered_model_name`), and the alias `newest` points at it (MLflow reserves `latest`).

The tracking URI is `MLFLOW_TRACKING_URI` when set, else `tracking.mlflow_tracking_uri`
(default `sqlite:///mlflow.db`). With a local SQLite tracking store, a new experiment keeps its
artifacts in `mlruns/` beside the database file (MLflow's own default is `./mlruns` in whatever
folder the process runs in).

Deliberate simplification: every committed version is registered, so the alias is the newest
version, not a separately judged "best" one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

NEWEST_ALIAS = "newest"
RUN_TAG = "marsrl.run_id"  # the training run an MLflow run belongs to
RESUMES_TAG = "marsrl.resumes"  # how many times it was resumed


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}" if prefix else key, inner, out)
    else:
        out[prefix] = value
    return out


def tracking_uri(configured: str) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI", configured)


def artifact_location(uri: str) -> str | None:
    """`mlruns/` beside the database of a local SQLite tracking URI (`sqlite:///relative.db` or
    `sqlite:////absolute.db`), as a file URI; None (the server's default) for any other store."""
    if not uri.startswith("sqlite:///"):
        return None
    database = Path(uri.removeprefix("sqlite:///"))
    return (database.resolve().parent / "mlruns").as_uri()


class Tracker:
    """An MLflow run, written through `MlflowClient` with its run id (never the thread-local "active
    run"), so the learner thread, flows and tasks can all log to it."""

    def __init__(self, tracking_config: Any, run_name: str, params: dict[str, Any]):
        from mlflow import MlflowClient

        uri = tracking_uri(tracking_config.mlflow_tracking_uri)
        self.client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        self.model_name = tracking_config.registered_model_name
        experiment = self.client.get_experiment_by_name(tracking_config.experiment_name)
        experiment_id = (
            experiment.experiment_id
            if experiment
            else self.client.create_experiment(
                tracking_config.experiment_name, artifact_location=artifact_location(uri)
            )
        )
        found = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{run_name}'", max_results=1
        )
        self.resumed = bool(found)
        if found:
            self.run = found[0]
            self.run_id = self.run.info.run_id
            resumes = int(self.run.data.tags.get(RESUMES_TAG, "0")) + 1
            self.client.set_tag(self.run_id, RESUMES_TAG, str(resumes))
            self.client.update_run(self.run_id, status="RUNNING")
            return
        self.run = self.client.create_run(experiment_id, run_name=run_name, tags={RUN_TAG: run_name})
        self.run_id = self.run.info.run_id
        from mlflow.entities import Param

        flat = [Param(k, str(v)[:500]) for k, v in _flatten("", params, {}).items()]
        for start in range(0, len(flat), 100):
            self.client.log_batch(self.run_id, params=flat[start : start + 100])

    def log_step(self, step: int, metrics: dict[str, dict[str, float]]) -> None:
        flat = {f"{agent}/{name}": float(value) for agent, m in metrics.items() for name, value in m.items()}
        self.log_metrics(flat, step)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step or 0) for k, v in metrics.items()]
        for start in range(0, len(batch), 500):
            self.client.log_batch(self.run_id, metrics=batch[start : start + 500])

    def log_checkpoint(self, folder: Path, version: int) -> str:
        """Log a checkpoint folder as artifacts and point the `newest` alias at it."""
        path = f"checkpoints/v{version}"
        self.client.log_artifacts(self.run_id, str(folder), artifact_path=path)
        source = f"{self.run.info.artifact_uri}/{path}"
        try:
            self.client.get_registered_model(self.model_name)
        except Exception:
            self.client.create_registered_model(self.model_name)
        model_version = self.client.create_model_version(self.model_name, source=source, run_id=self.run_id)
        self.client.set_registered_model_alias(self.model_name, NEWEST_ALIAS, model_version.version)
        return source

    def log_figure(self, figure: Any, name: str) -> None:
        self.client.log_figure(self.run_id, figure, name)

    def close(self, status: str = "FINISHED") -> None:
        """End the MLflow run: FINISHED, FAILED or KILLED."""
        self.client.set_terminated(self.run_id, status=status)
