"""Rollout tasks: record a batch's problems; decode one agent turn of a batch to its end."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from marsrl_core.config import MarsRLConfig
from marsrl_core.rollout.samples import RolloutInterrupted
from marsrl_core.runtime import work


def _not_interrupted(task, task_run, state) -> bool:
    """Retry a failed turn unless it was interrupted on purpose (its worker is stopping)."""
    return not isinstance(state.data, RolloutInterrupted)


@task(name="record-batch", retries=3, retry_delay_seconds=1, cache_policy=NO_CACHE)
def record_batch(config: MarsRLConfig, run_id: str, batch_index: int) -> int:
    return work.record_batch(config, run_id, batch_index)


@task(
    name="rollout-turn",
    retries=2,
    retry_delay_seconds=1,
    retry_condition_fn=_not_interrupted,
    cache_policy=NO_CACHE,
)
def rollout_turn(config: MarsRLConfig, run_id: str, batch_index: int, turn: int) -> dict[str, int]:
    return work.rollout_turn(config, run_id, batch_index, turn)
