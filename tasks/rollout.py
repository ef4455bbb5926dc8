"""The rollout task: one agent turn of a batch, from its first group's start to its last group's end
(the process's decode loop decodes it)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from marsrl_core.config import MarsRLConfig
from marsrl_core.runtime import work


@task(name="rollout-turn", cache_policy=NO_CACHE)
def rollout_turn(config: MarsRLConfig, run_id: str, batch_index: int, turn: int) -> dict[str, int]:
    """The turn's samples, finished samples and tokens once its last group has finished. Not retried
    here: the decode loop resumes a failed stage from the store itself (`RolloutLoop`)."""
    return work.rollout_turn(config, run_id, batch_index, turn)
