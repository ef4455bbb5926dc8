"""The sft flow: warm-start the policy on demonstrations for all three roles (cached by config,
so a second run with the same `model`, `roles`, `data`, `sft` and `seed` returns at once)."""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.params import run_config
from marsrl_core.config import MarsRLConfig, default_config
from tasks.logs import say
from tasks.sft import warm_start


@flow(name="sft", log_prints=True)
def sft_flow(config: MarsRLConfig = default_config(), overrides: dict[str, Any] | None = None) -> str:
    folder = warm_start(run_config(config, overrides))
    say(f"warm start: {folder}")
    return folder
