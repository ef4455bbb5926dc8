"""The maintenance flow: DuckLake compaction (merge small files, expire snapshots)."""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.params import run_config
from marsrl_core.config import MarsRLConfig, default_config
from tasks.evaluation import compact
from tasks.logs import say


@flow(name="maintenance", log_prints=True)
def maintenance_flow(
    config: MarsRLConfig = default_config(), overrides: dict[str, Any] | None = None
) -> dict[str, int]:
    result = compact(run_config(config, overrides))
    say(f"data files {result['files_before']} -> {result['files_after']}")
    return result
