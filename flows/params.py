"""The config a flow runs with, from its `config` and `overrides` parameters.

A run started from the Prefect UI, the API or `prefect deployment run --params` changes a few settings
of its deployment's config in either of two ways, and both keep the rest of the deployment's config:
- `overrides`: dotted keys, `{"overrides": {"learner.max_steps": 3}}` (`with_overrides`);
- a `config` given in part, `{"config": {"learner": {"max_steps": 3}}}`: Prefect replaces the whole
  parameter and pydantic fills what is missing with the class defaults, so the fields it was given are
  merged over the deployment's own `config` instead (`merged_over`).
A whole `config` replaces the deployment's config; outside a deployment a `config` is taken as it is.
"""

from __future__ import annotations

from typing import Any

from prefect import get_client
from prefect.context import FlowRunContext

from marsrl_core.config import MarsRLConfig, given_in_part, merged_over, with_overrides


def run_config(config: MarsRLConfig, overrides: dict[str, Any] | None) -> MarsRLConfig:
    """The flow's config: a `config` given in part merged over its deployment's, then `overrides`."""
    if (deployment_id := _deployment_id()) is not None and given_in_part(config):
        with get_client(sync_client=True) as client:
            served = client.read_deployment(deployment_id).parameters.get("config")
        if served is not None:
            config = merged_over(served, config)
    return with_overrides(config, overrides)


def _deployment_id() -> Any:
    """The deployment this flow run was started from, as its run records it (no API call): None outside
    one, and in a subflow, whose config its parent passes on whole."""
    context = FlowRunContext.get()
    return None if context is None or context.flow_run is None else context.flow_run.deployment_id
