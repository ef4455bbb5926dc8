"""Learner tasks: one training step on ready groups (or None when not enough are ready)."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from marsrl_core.config import MarsRLConfig
from marsrl_core.runtime import workers


@task(name="train-step", retries=1, retry_delay_seconds=1, cache_policy=NO_CACHE)
def train_step(config: MarsRLConfig, run_id: str, flush: bool = False) -> dict[str, Any] | None:
    return workers.train_step(config, run_id, flush=flush, tracker=workers.tracker_for(config, run_id))
