"""Evaluation and maintenance tasks."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from marsrl_core.config import MarsRLConfig
from marsrl_core.runtime import work
from tasks.logs import say


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate(config: MarsRLConfig, run_id: str, label: str, checkpoint: str | None = None) -> dict[str, float]:
    return work.evaluate(config, run_id, label, checkpoint, log=say)


@task(name="compact-store", retries=3, retry_delay_seconds=2, cache_policy=NO_CACHE)
def compact(config: MarsRLConfig) -> dict[str, int]:
    return work.compact(config)
