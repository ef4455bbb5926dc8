"""The rollout flow: one problem batch as a DAG of Solver -> Verifier -> Corrector -> Verifier ->
Corrector tasks. Each task decodes its turn segment by segment through the process's shared engine;
several rollout flows running at once share its segment batches (the agentic pipeline).
`run_batches` runs a run's batches as subflows, `batches_in_flight` decoding at a time (batch k's
Verifiers decode beside batch k+1's Solvers); the `train` flow and the `rollouts` flow (the rollout side
of a split run) both use it.

Prefect's bookkeeping for a batch (its subflow run, the tracking task run, state changes: ~100 ms
against a local server) would otherwise sit between one batch's end and the next one's first
segment. So `run_batches` starts one subflow more than `batches_in_flight` ahead of time, and a
process-wide decode slot per run (`DecodeSlots`) holds it back from decoding until a slot frees:
its set-up overlaps the decoding of the batches in flight, and a finished batch's tear-down overlaps
the next one's decoding. Each subflow runs in a thread of its own with the calling flow's context
(no wrapper task), and they are created one at a time: on the local server's SQLite, concurrent
writes conflict and the client retries the losing request after 2 s (HTTP 503).

When the calling flow stops (a signal, Ctrl-C, a batch that failed), the batches in flight stop at
their next stage boundary (`Runtime.interrupt`): a stop takes one stage, not the rest of
the batches, and a resume continues from their stored segments.

Deliberate simplification: the slots live in the process that runs the subflows (as the engine does);
a rollout flow run on its own (a deployment run of one batch) decodes without waiting for one."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from prefect import flow

from flows.params import run_config
from flows.slots import DecodeSlots, keep_in_flight
from flows.subflows import in_thread, parent_heartbeat_only
from marsrl_core.config import MarsRLConfig, absolute_paths, default_config
from marsrl_core.rollout.samples import agent_of_turn
from marsrl_core.runtime import events, work
from marsrl_core.runtime.context import runtime
from tasks.rollout import record_batch, rollout_turn

PREPARED_AHEAD = 1  # rollout subflows started beyond `batches_in_flight`, waiting for a decode slot


@flow(name="rollout", flow_run_name="rollout-batch-{batch_index}", log_prints=True)
def rollout_flow(
    config: MarsRLConfig = default_config(),
    run_id: str = "manual",
    batch_index: int = 0,
    overrides: dict[str, Any] | None = None,
) -> list[dict[str, int]] | None:
    """Decode one batch, turn by turn; None when the run was asked to stop before the batch had a slot."""
    config = run_config(config, overrides)
    with DecodeSlots.hold(run_id, batch_index) as go:
        return _decode_batch(config, run_id, batch_index) if go else None


def _decode_batch(config: MarsRLConfig, run_id: str, batch_index: int) -> list[dict[str, int]]:
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
    work.mark_batch_done(config, run_id, batch_index)  # a resumed run skips it
    return results


def _rollout_subflow(config: MarsRLConfig, run_id: str, batch_index: int) -> int | None:
    """The batch's rollout flow as a subflow; the rollout stages it ran (None: it did not decode).

    Called for its state: a subflow called for its value registers that value in the calling flow's
    context (`run_results`, for dependency tracking), and a long-running calling flow would keep
    one entry per batch, each with a copy of the subflow's state, for as long as it runs."""
    with parent_heartbeat_only():
        turns = rollout_flow(config, run_id, batch_index, return_state=True).result()
    return None if turns is None else sum(turn["stages"] for turn in turns)


def run_batches(
    config: MarsRLConfig, run_id: str, batches: Iterable[int], stop: Callable[[], bool] = lambda: False
) -> dict[str, int]:
    """Rollout flows for `batches`, in order, as subflows of the calling flow (each in a thread of its
    own): `rollout.batches_in_flight` of them decoding at a time and `PREPARED_AHEAD` more set up and
    waiting for a decode slot; see `keep_in_flight` and `DecodeSlots`. Returns how many batches decoded
    and the rollout stages they ran (a batch prepared ahead that a stop request kept from decoding
    does not count)."""
    limit = config.rollout.batches_in_flight

    def submit(batch: int) -> Future:
        slots.queue(batch)  # before the subflow starts: batches take their slots in this order
        future = in_thread(pool, _rollout_subflow, config, run_id, batch)
        # One subflow run is created at a time: on the local server's SQLite, concurrent creations
        # conflict, and each conflict costs the client a retry after 2 s (HTTP 503).
        slots.wait_until_started(batch, future)
        return future

    done = {"batches": 0, "stages": 0}
    with DecodeSlots.open(run_id, limit, stop) as slots, ThreadPoolExecutor(limit + PREPARED_AHEAD) as pool:
        runtime().clear_interrupt(run_id)  # an earlier call for this run in this process may have been stopped
        try:
            for stages in keep_in_flight(batches, limit + PREPARED_AHEAD, submit, stop):
                if stages is not None:
                    done["batches"] += 1
                    done["stages"] += stages
        except BaseException:
            # A signal (Prefect raises SIGTERM as `TerminationSignal` here), Ctrl-C or a failed batch:
            # the batches in flight stop at their next stage instead of decoding to their end, those
            # waiting for a slot do not start, and a learner of the run in this process stops before its
            # next step; what they decoded is stored for a resume.
            runtime().interrupt(run_id)
            slots.close()
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
    `stop_requested` run event is recorded it starts no new batch (those running finish); with `finish`
    it then marks the rollouts finished. Returns the number of batches and of rollout stages it ran."""
    config = absolute_paths(config)  # recorded so: a resume from another folder finds the run's files
    store = runtime().store(config)
    work.start_run(config, run_id)
    todo = batches if batches is not None else range(config.data.num_batches)
    done = run_batches(config, run_id, todo, stop=lambda: store.has_event(run_id, events.STOP_REQUESTED))
    if finish:
        store.mark(run_id, events.ROLLOUTS_FINISHED)
    return done
