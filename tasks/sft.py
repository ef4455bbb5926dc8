"""The SFT task: one call into `marsrl_core.demo.sft`."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from marsrl_core.config import MarsRLConfig
from marsrl_core.demo import sft
from marsrl_core.policy import policy_folder, roles_from_config


@task(name="sft-warm-start", cache_policy=NO_CACHE)
def warm_start(config: MarsRLConfig) -> str:
    def progress(step: int, loss: float) -> None:
        if step % 250 == 0 or step == config.sft.max_steps - 1:
            print(f"sft step {step + 1}/{config.sft.max_steps}: loss {loss:.3f}")

    return str(sft.warm_start(config, policy_folder(config), roles_from_config(config), progress=progress))
