"""The train flow: rollout flows (one per problem batch, `batches_in_flight` at a time) and the
learner flow run concurrently, meeting only through the store; then an evaluation of the result.
With `sft.enabled` (the tiny preset) the policy is first warm-started by the sft flow (cached).
With `rollout.synchronous` (the ablation baseline) batches are decoded whole, one at a time, and the
learner trains on each batch before the next one starts. With `learner.nproc` > 1 the learner runs as
a `marsrl learn` process group of that many ranks beside the rollouts. The per-agent reward curves go
to MLflow.

Run again with the same `run_id` (`marsrl train --resume RUN`), it continues a killed run: an
evaluation already recorded is not repeated, finished batches are skipped, an unfinished batch resumes
from its stored samples, and the learner from its last committed version. A run whose learner has all
its steps decodes and trains nothing more (`already_finished` in the result); only a missing
evaluation after training is made. Stopped (SIGTERM, Ctrl-C) or failed, it stops its rollouts at
their next stage and its learner before its next step. When the policy diverges (`PolicyDiverged`)
it ends Failed with that one line, having published nothing non-finite."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.exceptions import FailedRun
from prefect.settings import get_current_settings
from prefect.states import Failed

from flows.evaluate import artifact_key, evaluate_flow
from flows.learner import learner_flow
from flows.params import run_config
from flows.rollout import rollout_flow, run_batches
from flows.sft import sft_flow
from flows.subflows import in_thread, parent_heartbeat_only
from marsrl_core.config import MarsRLConfig, absolute_paths, config_to_yaml, default_config
from marsrl_core.devices import learner_gpus
from marsrl_core.runtime import events, work
from marsrl_core.runtime.context import runtime
from marsrl_core.runtime.report import report_markdown
from tasks.logs import say


def _learner_subflow(config: MarsRLConfig, run_id: str) -> int:
    with parent_heartbeat_only():
        return learner_flow(config, run_id)


@flow(name="train", log_prints=True)
def train_flow(
    config: MarsRLConfig = default_config(),
    run_id: str | None = None,
    evaluate_before: bool = True,
    evaluate_after: bool = True,
    overrides: dict[str, Any] | None = None,
) -> dict:
    config = run_config(config, overrides)  # a few dotted fields changed, e.g. {"learner.max_steps": 3}
    config = absolute_paths(config)  # recorded so: a resume from another folder finds the run's files
    work.check_inputs(config)  # a bad dataset fails now, not after the warm start and the first evaluation
    if config.sft.enabled and config.model.path is None:  # warm start first (cached); a resumed run has its path
        config = config.model_copy(update={"model": config.model.model_copy(update={"path": sft_flow(config)})})
    run_id = run_id or f"{config.run_name}-{uuid.uuid4().hex[:8]}"
    rt = runtime()
    rt.clear_interrupt(run_id)  # an earlier run of this id in this process may have been stopped
    work.start_run(config, run_id)
    rt.tracker(config, run_id)  # the MLflow run (a resumed run's own) starts before the evaluation it records
    try:
        result = _train(config, run_id, evaluate_before, evaluate_after)
    except FailedRun as err:  # the policy diverged: the run ends Failed with its one line, no traceback
        rt.end_tracker(run_id, "FAILED")
        return Failed(message=str(err))
    except BaseException as err:  # a failure, or a stop (a signal, Ctrl-C): the MLflow run ends so too
        rt.end_tracker(run_id, "FAILED" if isinstance(err, Exception) else "KILLED")
        raise
    finally:
        rt.end_checker(run_id)  # the outcome checks' worker processes end with the run
    rt.end_tracker(run_id, "FINISHED")
    return result


def _train(config: MarsRLConfig, run_id: str, evaluate_before: bool, evaluate_after: bool) -> dict:
    rt = runtime()
    store = rt.store(config)
    result: dict = {"run_id": run_id}
    latest = store.latest_version(run_id)
    if latest is not None and latest[0] >= config.learner.max_steps:
        say(f"run {run_id} has all its {config.learner.max_steps} learner steps: nothing left to decode or train")
        result.update(already_finished=True, learner_steps=latest[0], before=store.evaluation(run_id, "before"))
        if evaluate_after:
            result["after"] = store.evaluation(run_id, "after") or evaluate_flow(config, run_id, "after", latest[1])
        return {k: v for k, v in result.items() if v is not None}
    if evaluate_before:
        result["before"] = store.evaluation(run_id, "before") or evaluate_flow(config, run_id, "before")
    start = time.perf_counter()
    done = store.events(run_id, events.BATCH_DONE)
    pending = [b for b in range(config.data.num_batches) if events.batch_done(b) not in done]
    if config.rollout.synchronous:  # the baseline: whole batches decoded, then trained on, in turn
        for batch in pending:
            with parent_heartbeat_only():
                rollout_flow(config, run_id, batch)
                steps = learner_flow(config, run_id, idle_timeout_s=0.0, final=False)
            if steps >= config.learner.max_steps:  # as the pipelined path: no batch the learner will not use
                break
        store.mark(run_id, events.ROLLOUTS_FINISHED)
        result["learner_steps"] = steps = learner_flow(config, run_id)
    elif config.learner.nproc > 1:  # the learner's ranks in a process group of their own, beside the rollouts
        result["learner_steps"] = steps = _train_beside_learner_process(config, run_id, pending)
    else:
        if store.latest_version(run_id) is not None:
            # A resumed run's learner is built before any rollout: its resume voids the versions after the
            # last durable one, and the engines start from what remains.
            rt.learner(config, run_id)
        # A new run's learner is built in the learner flow while the first batches decode (the engines
        # load first or after it, `Runtime`); the admission gate holds those batches to what its first
        # steps can train (`rollout/gate.py`).
        with ThreadPoolExecutor(1) as pool:
            learner = in_thread(pool, _learner_subflow, config, run_id)
            try:
                # Once the learner has its steps (or failed), no more batches start.
                run_batches(config, run_id, pending, stop=learner.done)
                # A learner that failed stopped the batches early: the rollouts are not finished, and a
                # resumed run must still decode the rest (its learner would stop on the mark).
                learner_failed = learner.done() and learner.exception() is not None
                if not learner_failed and not store.has_event(run_id, events.ROLLOUTS_FINISHED):
                    store.mark(run_id, events.ROLLOUTS_FINISHED)
                result["learner_steps"] = steps = learner.result()
            except BaseException:  # a signal or a failure: the learner stops before its next step, not at its timeout
                rt.interrupt(run_id)
                raise
    result["train_wall_clock_s"] = time.perf_counter() - start
    result["samples"] = work.sample_accounting(config, run_id)
    result["rollout"] = work.rollout_stats(config, run_id)
    curves = work.log_reward_curves(config, run_id)
    timeline = work.log_timeline(config, run_id)
    if evaluate_after and steps:
        latest = store.latest_version(run_id)
        result["after"] = store.evaluation(run_id, "after") or evaluate_flow(config, run_id, "after", latest[1])
    reports = {label: result[label] for label in ("before", "after") if result.get(label)}
    create_markdown_artifact(  # the run's page in the Prefect UI shows its results
        key=artifact_key(run_id),
        markdown=report_markdown(run_id, reports, curves, timeline),
        description=f"MarsRL run {run_id}: evaluation before and after training, reward curves",
    )
    return result


def learner_prefect_env() -> dict[str, str]:
    """The learner process reports to this process's Prefect API. Where none is configured (Prefect's
    temporary server in this process, as when `train_flow` is called from Python), the learner
    process starts a temporary server of its own: its flow run is on that server, not beside the
    rollouts'."""
    url = get_current_settings().api.url
    return {"PREFECT_API_URL": str(url)} if url else {}


def _train_beside_learner_process(config: MarsRLConfig, run_id: str, pending: list[int]) -> int:
    """The rollouts here, the learner as `marsrl learn` on `learner.nproc` ranks (its output goes to this
    process's), reporting to the same Prefect API (`learner_prefect_env`); they meet through the store
    and the checkpoints.
    Returns the learner's last committed step. A learner whose ranks start later than an in-process one
    leaves the first rollouts' groups older when it begins (past `learner.max_trained_age`, they are handled
    as `learner.stale_groups` says)."""
    store = runtime().store(config)
    path = Path(config.output_dir) / "runs" / f"{run_id}-learner.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config_to_yaml(config))
    env = os.environ | learner_prefect_env()
    if gpus := learner_gpus(config.learner.nproc, config.model.device):
        env["CUDA_VISIBLE_DEVICES"] = gpus  # the ranks on the last GPUs, the engine here on the first
    command = [sys.executable, "-m", "flows.cli", "learn", "--config", str(path), "--run-id", run_id]
    learner = subprocess.Popen(command, env=env)
    try:
        run_batches(config, run_id, pending, stop=lambda: learner.poll() is not None)
        if learner.poll() in (None, 0) and not store.has_event(run_id, events.ROLLOUTS_FINISHED):
            store.mark(run_id, events.ROLLOUTS_FINISHED)
        if code := learner.wait():
            if diverged := store.event_details(run_id, events.DIVERGED):
                raise FailedRun(diverged[0])  # the learner said why in one line: so does this run
            raise RuntimeError(
                f"run {run_id}: the learner process ({config.learner.nproc} ranks) exited with status {code} "
                f"(its output is above); `marsrl train --resume {run_id}` continues from its last commit"
            )
    except BaseException:
        learner.terminate()  # torch.distributed.run passes the signal on to the ranks
        learner.wait(timeout=120)
        raise
    latest = store.latest_version(run_id)
    return latest[0] if latest else 0
