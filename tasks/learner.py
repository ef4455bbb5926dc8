"""Learner tasks: one training step on the groups the learner flow found ready."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from marsrl_core.config import MarsRLConfig
from marsrl_core.runtime import work
from marsrl_core.store import TrainableGroup


def _retry_unless_failed_again(task: Any, task_run: Any, state: Any) -> bool:
    """Retry a failed step once, not one that already failed before a step went past it (its retry
    would roll back to the same durable version and fail there again: `work.StepFailedAgain`)."""
    return not isinstance(state.data, work.StepFailedAgain)


@task(
    name="train-step",
    retries=1,
    retry_delay_seconds=1,
    retry_condition_fn=_retry_unless_failed_again,
    cache_policy=NO_CACHE,
)
def train_step(
    config: MarsRLConfig, run_id: str, groups: list[TrainableGroup], flush: bool = False
) -> dict[str, Any] | None:
    return work.train_step(config, run_id, groups, flush=flush)
