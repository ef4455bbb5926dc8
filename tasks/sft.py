"""The SFT task: one call into `marsrl_core.sft`."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from marsrl_core import sft
from marsrl_core.config import MarsRLConfig


@task(name="sft-warm-start", cache_policy=NO_CACHE)
def warm_start(config: MarsRLConfig, steps: int, batch_size: int, learning_rate: float, num_problems: int) -> str:
    return str(sft.warm_start(config, steps=steps, batch_size=batch_size, learning_rate=learning_rate,
                              num_problems=num_problems))
