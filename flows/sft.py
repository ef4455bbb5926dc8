"""The sft flow: warm-start the policy on demonstrations for all three roles (cached by config)."""

from __future__ import annotations

from prefect import flow

from marsrl_core.config import MarsRLConfig, default_config
from tasks.sft import warm_start


@flow(name="sft", log_prints=True)
def sft_flow(config: MarsRLConfig = default_config(), steps: int = 3000, batch_size: int = 64,
             learning_rate: float = 3e-3, num_problems: int = 4000) -> str:
    folder = warm_start(config, steps, batch_size, learning_rate, num_problems)
    print(f"warm start: {folder}")
    return folder
