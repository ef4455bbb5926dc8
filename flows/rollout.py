"""The rollout flow: one problem batch as a DAG of Solver -> Verifier -> Corrector -> Verifier ->
Corrector tasks. Each task decodes its turn segment by segment through the process's shared engine;
several rollout flows running at once share its segment batches (the agentic pipeline).
`run_batches` runs a run's batches as subflows, `batches_in_flight` at a time (batch k's Verifiers
decode beside batch k+1's Solvers); the `train` flow and the `rollouts` flow (the rollout side of a
split run) both use it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import ThreadPoolTaskRunner

from flows.subflows import parent_heartbeat_only
from marsrl_core import workers
from marsrl_core.config import MarsRLConfig, default_config
from marsrl_core.rollout import agent_of_turn
from tasks.rollout import record_batch, rollout_turn

T = TypeVar("T")


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
    workers.mark_batch_done(config, run_id, batch_index)  # a resumed run skips it
    return results


@task(name="run-rollout-flow", cache_policy=NO_CACHE)
def _rollout_batch(config: MarsRLConfig, run_id: str, batch_index: int) -> list[dict[str, int]]:
    with parent_heartbeat_only():
        return rollout_flow(config, run_id, batch_index)


def keep_in_flight(items: Iterable[T], limit: int, submit: Callable[[T], Any],
                   stop: Callable[[], bool] = lambda: False) -> list[Any]:
    """`submit(item)` for each item in order, at most `limit` unfinished at a time; the oldest is awaited
    (`.result()` of what `submit` returned: a Prefect or a `concurrent.futures` future) before the next
    starts. `stop` is asked before each new item; once it says so, those running finish and no more
    start. Returns the finished items' results, in order."""
    pending, running, finished = list(items), [], []
    while pending or running:
        if pending and stop():
            pending.clear()
        while pending and len(running) < limit:
            running.append(submit(pending.pop(0)))
        if running:
            finished.append(running.pop(0).result())
    return finished


def run_batches(config: MarsRLConfig, run_id: str, batches: Iterable[int],
                stop: Callable[[], bool] = lambda: False) -> list[list[dict[str, int]]]:
    """Rollout flows for `batches`, in order, `rollout.batches_in_flight` at a time, as subflows of the
    calling flow (submitted to its task runner, which needs that many workers); see `keep_in_flight`.
    Returns each finished batch's turn results, in order."""
    return keep_in_flight(batches, config.rollout.batches_in_flight,
                          lambda batch: _rollout_batch.submit(config, run_id, batch), stop)


@flow(name="rollouts", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=8))
def rollouts_flow(config: MarsRLConfig = default_config(), run_id: str = "manual", batches: list[int] | None = None,
                  finish: bool = False) -> dict[str, int]:
    """Rollout flows for `batches` (default: all of the run's), `batches_in_flight` at a time, as
    subflows under one heartbeat: the rollout side of a split run (`marsrl rollout`). Once a
    `stop_requested` run event is recorded it starts no new batch (those running finish); with `finish`
    it then marks the rollouts finished. Returns the number of batches and of rollout stages it ran."""
    from flows.learner import ROLLOUTS_FINISHED

    store = workers.store_for(config)
    workers.start_run(config, run_id)
    todo = batches if batches is not None else range(config.data.num_batches)
    results = run_batches(config, run_id, todo, stop=lambda: store.has_event(run_id, workers.STOP_REQUESTED))
    if finish:
        store.mark(run_id, ROLLOUTS_FINISHED)
    return {"batches": len(results), "stages": sum(t["stages"] for turns in results for t in turns)}
