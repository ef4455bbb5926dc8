"""Learner tasks: one training step on the groups the learner flow found ready."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from marsrl_core.config import MarsRLConfig
from marsrl_core.runtime import work
from marsrl_core.store import TrainableGroup


@task(name="train-step", retries=1, retry_delay_seconds=1, cache_policy=NO_CACHE)
def train_step(
    config: MarsRLConfig, run_id: str, groups: list[TrainableGroup], flush: bool = False
) -> dict[str, Any] | None:
    return work.train_step(config, run_id, groups, flush=flush)
