"""The rollout flow: one problem batch as a DAG of Solver -> Verifier -> Corrector -> Verifier ->
Corrector tasks. Each task decodes its turn segment by segment through the process's shared engine;
several rollout flows running at once share its segment batches (the agentic pipeline). The
`rollouts` flow runs batches one after another as its subflows (the rollout side of a split run)."""

from __future__ import annotations

from prefect import flow

from flows.subflows import parent_heartbeat_only
from marsrl_core import workers
from marsrl_core.config import MarsRLConfig, default_config
from marsrl_core.rollout import agent_of_turn
from tasks.rollout import record_batch, rollout_turn


@flow(name="rollout", log_prints=True)
def rollout_flow(config: MarsRLConfig = default_config(), run_id: str = "manual", batch_index: int = 0) -> list[dict[str, int]]:
    # The turns depend on each other, so they run one after another in the flow's own thread (a task
    # runner thread bought nothing and cost ~10% of the decoding time); `wait_for` keeps the DAG's edges.
    previous = record_batch(config, run_id, batch_index, return_state=True)
    states = []
    for turn in range(config.rollout.max_turns):
        previous.result()  # raises if the previous step failed (after its retries)
        task = rollout_turn.with_options(name=f"{agent_of_turn(turn)}-turn{turn}")
        previous = task(config, run_id, batch_index, turn, wait_for=[previous], return_state=True)
        states.append(previous)
    results = [state.result() for state in states]
    workers.store_for(config).mark(run_id, workers.batch_done_event(batch_index))  # a resumed run skips it
    return results


@flow(name="rollouts", log_prints=True)
def rollouts_flow(config: MarsRLConfig = default_config(), run_id: str = "manual", batches: list[int] | None = None,
                  finish: bool = False) -> dict[str, int]:
    """Rollout flows for `batches` (default: all of the run's), one after another, as subflows under one
    heartbeat: the rollout side of a split run (`marsrl rollout`). It stops before the next batch once
    a `stop_requested` run event is recorded; with `finish` it then marks the rollouts finished.
    Returns the number of batches and of rollout stages it ran."""
    from flows.learner import ROLLOUTS_FINISHED

    store = workers.store_for(config)
    workers.start_run(config, run_id)
    done = {"batches": 0, "stages": 0}
    for batch in batches if batches is not None else range(config.data.num_batches):
        if store.has_event(run_id, workers.STOP_REQUESTED):
            break
        with parent_heartbeat_only():
            turns = rollout_flow(config, run_id, batch)
        done["batches"] += 1
        done["stages"] += sum(t["stages"] for t in turns)
    if finish:
        store.mark(run_id, ROLLOUTS_FINISHED)
    return done
