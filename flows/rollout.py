"""The rollout flow: one problem batch as a DAG of Solver -> Verifier -> Corrector -> Verifier ->
Corrector tasks. Each task decodes its turn segment by segment through the process's shared engine;
several rollout flows running at once share its segment batches (the agentic pipeline)."""

from __future__ import annotations

from prefect import flow

from marsrl_core import workers
from marsrl_core.config import MarsRLConfig, default_config
from marsrl_core.rollout import agent_of_turn
from tasks.rollout import record_batch, rollout_turn


@flow(name="rollout", log_prints=True)
def rollout_flow(config: MarsRLConfig = default_config(), run_id: str = "manual", batch_index: int = 0) -> list[dict[str, int]]:
    recorded = record_batch.submit(config, run_id, batch_index)
    previous = recorded
    futures = []
    for turn in range(config.rollout.max_turns):
        task = rollout_turn.with_options(name=f"{agent_of_turn(turn)}-turn{turn}")
        previous = task.submit(config, run_id, batch_index, turn, wait_for=[previous])
        futures.append(previous)
    results = [f.result() for f in futures]
    workers.store_for(config).mark(run_id, workers.batch_done_event(batch_index))  # a resumed run skips it
    return results
