"""The rollout flow: one problem batch as Solver, Verifier and Corrector tasks, one per turn. The
decoding happens in the process's decode loop for the run (`rollout/loop.py`), which every batch in
flight feeds: each stage decodes a segment of every unfinished sample of every batch at once, and a
problem's next agent starts at the first stage boundary after its own inputs are complete.

A turn's task is the span of its turn in the batch: it is submitted when the turn's first group
starts and ends when its last group has finished, returning the turn's samples and tokens. Turns
overlap (a problem's Verifier decodes while another problem's Solver is still going), so the batch's
tasks overlap in Prefect's timeline; they carry no dependency edge, since Prefect draws one only for
a task that waits for its upstream to end. A turn no problem reaches has no task.

`run_batches` runs a run's batches as subflows, `batches_in_flight` plus `PREPARED_AHEAD` at a time:
the decode loop admits waiting problems, oldest batch first, as room frees
(`rollout.problems_per_batch` x `batches_in_flight` problems in flight) and as the learner's pace
allows (the admission gate), so the next batch's Solvers start the moment an earlier problem ends
and its Prefect set-up (about half a second: `benchmarks/prefect_overhead.py`) overlaps decoding
where the batches in flight take longer than that. The `train` flow and the `rollouts` flow (the
rollout side of a split run) both use it. Subflows run in threads of their own with the calling
flow's context (no wrapper task), and are created one at a time: on the local server's SQLite,
concurrent writes conflict and the client retries the losing request after 2 s.

When the run's learner has its steps (`stop`), the problems not yet admitted are dropped and those
in flight finish the samples they are decoding but start no next turn (nothing more of them would be
trained). When the calling flow stops (a signal, Ctrl-C, a batch
that failed), the decode loop stops at its next stage boundary (`Runtime.interrupt`): a stop takes
one stage, and a resume continues from the stored segments. A decode that finds the policy diverged
(`PolicyDiverged`) ends the batches in flight Failed with that one line.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from prefect import flow
from prefect.exceptions import FailedRun
from prefect.states import Failed
from prefect.task_runners import ThreadPoolTaskRunner

from flows.params import run_config
from flows.subflows import in_thread, keep_in_flight, parent_heartbeat_only
from marsrl_core.config import MarsRLConfig, absolute_paths, default_config
from marsrl_core.divergence import PolicyDiverged
from marsrl_core.rollout.samples import agent_of_turn
from marsrl_core.runtime import events, work
from marsrl_core.runtime.context import runtime
from tasks.rollout import rollout_turn

PREPARED_AHEAD = 1  # rollout subflows started beyond `batches_in_flight`: their problems wait in the loop
MAX_TURNS = 5


@flow(
    name="rollout",
    flow_run_name="rollout-batch-{batch_index}",
    log_prints=True,
    task_runner=ThreadPoolTaskRunner(max_workers=MAX_TURNS),
)
def rollout_flow(
    config: MarsRLConfig = default_config(),
    run_id: str = "manual",
    batch_index: int = 0,
    overrides: dict[str, Any] | None = None,
) -> list[dict[str, int]]:
    """Decode one batch; each turn that starts is a task, from its first group's start to its last
    group's end. Returns the turns' samples, finished samples and tokens."""
    config = run_config(config, overrides)
    recorded = work.record_batch(config, run_id, batch_index)  # its problems, in the store before any sample
    turns = []
    try:
        work.start_batch(config, run_id, batch_index, recorded)
        for turn in range(config.rollout.max_turns):
            if not work.turn_starts(config, run_id, batch_index, turn):
                break  # no problem of the batch reached this turn, so none reaches a later one
            task = rollout_turn.with_options(name=f"{agent_of_turn(turn)}-turn{turn}")
            turns.append(task.submit(config, run_id, batch_index, turn))
    except PolicyDiverged as err:  # the decode loop ended on it: one line, no traceback
        return Failed(message=str(err))
    results = [future.result() for future in turns]  # raises if a turn failed
    if diverged := [r["diverged"] for r in results if "diverged" in r]:
        return Failed(message=diverged[0])
    work.end_batch(config, run_id, batch_index)
    return results


def _rollout_subflow(config: MarsRLConfig, run_id: str, batch_index: int) -> int:
    """The batch's rollout flow as a subflow; the samples it decoded.

    Called for its state: a subflow called for its value registers that value in the calling flow's
    context (`run_results`, for dependency tracking), and a long-running calling flow would keep
    one entry per batch, each with a copy of the subflow's state, for as long as it runs."""
    with parent_heartbeat_only():
        turns = rollout_flow(config, run_id, batch_index, return_state=True).result()
    return sum(turn["samples"] for turn in turns)


def run_batches(
    config: MarsRLConfig, run_id: str, batches: Iterable[int], stop: Callable[[], bool] = lambda: False
) -> dict[str, int]:
    """Rollout flows for `batches`, in order, as subflows of the calling flow (each in a thread of its
    own), `rollout.batches_in_flight` + `PREPARED_AHEAD` at a time (see `keep_in_flight`). Once `stop()`
    holds, no batch starts, the problems not yet admitted are dropped and those in flight start no next
    turn. Returns how many batches ran and the samples they decoded."""
    limit = config.rollout.batches_in_flight + PREPARED_AHEAD
    loop = work.rollout_loop(config, run_id)
    loop.stop_when(stop)

    def submit(batch: int) -> Future:
        future = in_thread(pool, _rollout_subflow, config, run_id, batch)
        # One subflow run is created at a time: on the local server's SQLite, concurrent creations
        # conflict, and each conflict costs the client a retry after 2 s (HTTP 503).
        while not (loop.joined(batch) or future.done()):
            time.sleep(0.01)
        return future

    done = {"batches": 0, "samples": 0}
    with ThreadPoolExecutor(limit) as pool:
        runtime().clear_interrupt(run_id)  # an earlier call for this run in this process may have been stopped
        try:
            for samples in keep_in_flight(batches, limit, submit, stop):
                done["batches"] += 1
                done["samples"] += samples
        except BaseException:
            # A signal (Prefect raises SIGTERM as `TerminationSignal` here), Ctrl-C or a failed batch:
            # the decode loop stops at its next stage instead of decoding to its end, and a learner of
            # the run in this process stops before its next step; what was decoded is stored for a resume.
            runtime().interrupt(run_id)
            raise
    return done


@flow(name="rollouts", log_prints=True)
def rollouts_flow(
    config: MarsRLConfig = default_config(),
    run_id: str = "manual",
    batches: list[int] | None = None,
    finish: bool = False,
) -> dict[str, int]:
    """Rollout flows for `batches` (default: all of the run's), `batches_in_flight` at a time, as
    subflows under one heartbeat: the rollout side of a split run (`marsrl rollout`). Once a
    `stop_requested` run event is recorded, or the run's learner has all its steps, it starts no new
    batch; with `finish` it then marks the rollouts finished. Returns the number of batches and the
    samples they decoded."""
    config = absolute_paths(config)  # recorded so: a resume from another folder finds the run's files
    store = runtime().store(config)
    work.start_run(config, run_id)
    todo = batches if batches is not None else range(config.data.num_batches)

    def stop() -> bool:
        latest = store.latest_version(run_id)
        learned = latest is not None and latest[0] >= config.learner.max_steps
        return learned or store.has_event(run_id, events.STOP_REQUESTED) or store.has_event(run_id, events.DIVERGED)

    try:
        done = run_batches(config, run_id, todo, stop=stop)
    except FailedRun as err:  # a batch found the policy diverged: one line, no traceback
        return Failed(message=str(err))
    finally:
        runtime().end_checker(run_id)  # the outcome checks' worker processes end with the rollouts
    if diverged := store.event_details(run_id, events.DIVERGED):  # the learner stopped the run
        return Failed(message=diverged[0])
    if finish:
        store.mark(run_id, events.ROLLOUTS_FINISHED)
    return done
