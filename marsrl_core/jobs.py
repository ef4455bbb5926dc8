"""The main job behind `make train` / `marsrl train`, as far as the system is built today.

Today it prepares a run: it validates the config, opens the DuckLake store, records the run and the
synthetic demo problems, and prints what the store holds. Rollouts, the learner and evaluation are
added by later work (see README, "Status"); this module then composes them.
"""

from __future__ import annotations

import uuid

from rich.console import Console

from marsrl_core.config import MarsRLConfig
from marsrl_core.store import SegmentStore
from marsrl_core.synthetic import make_problems


def train(cfg: MarsRLConfig, console: Console | None = None, num_problems: int = 64) -> str:
    """Prepare a training run in the store; returns its run id."""
    console = console or Console()
    run_id = f"{cfg.run_name}-{uuid.uuid4().hex[:8]}"
    store = SegmentStore.from_config(cfg.store)
    store.create_run(run_id, cfg.model_dump(mode="json"))
    added = store.add_problems(run_id, make_problems(num_problems, cfg.seed))
    console.print(f"run [bold]{run_id}[/bold]: {added} synthetic problems recorded in {cfg.store.catalog_url}")
    console.print("rollouts, learner and evaluation are not built yet (see README, Status); "
                  f"inspect the run with: marsrl sql \"SELECT * FROM problems WHERE run_id = '{run_id}' LIMIT 5\"")
    return run_id
