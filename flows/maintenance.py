"""The maintenance flow: DuckLake compaction (merge small files, expire snapshots)."""

from __future__ import annotations

from prefect import flow

from marsrl_core.config import MarsRLConfig, default_config
from tasks.evaluation import compact


@flow(name="maintenance", log_prints=True)
def maintenance_flow(config: MarsRLConfig = default_config()) -> dict[str, int]:
    result = compact(config)
    print(f"data files {result['files_before']} -> {result['files_after']}")
    return result
