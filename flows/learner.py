"""The learner flow: polls the store, trains as complete groups arrive, publishes versions; stops at
the step budget, or once the rollouts have finished and nothing is left to train on. Every
`store.compact_every_steps` versions it compacts the store (a task), so a days-long run's polls do not
slow down with the thousands of small files its commits write. It also stops before its next step
when its process is stopping (`workers.interrupt`: the train flow's rollouts were stopped by a signal
or failed), so a stopped `marsrl train` does not wait for the idle timeout."""

from __future__ import annotations

import time

from prefect import flow

from marsrl_core.config import MarsRLConfig, default_config
from marsrl_core.runtime import workers
from tasks.evaluation import compact
from tasks.learner import train_step

ROLLOUTS_FINISHED = "rollouts_finished"
MAX_IDLE_POLL_S = 1.0  # the longest wait between two polls of an idle learner


@flow(name="learner", log_prints=True)
def learner_flow(
    config: MarsRLConfig = default_config(),
    run_id: str = "manual",
    max_steps: int | None = None,
    poll_s: float = 0.2,
    idle_timeout_s: float = 3600.0,
) -> int:
    budget = max_steps or config.learner.max_steps
    learner = workers.learner_for(config, run_id, workers.tracker_for(config, run_id))
    idle_since, finished, wait_s = time.monotonic(), False, poll_s
    while learner.step < budget and not workers.interrupted(run_id):
        finished = workers.store_for(config).has_event(run_id, ROLLOUTS_FINISHED)
        if workers.groups_ready(config, run_id, flush=finished):
            train_step(config, run_id, flush=finished)
            idle_since, wait_s = time.monotonic(), poll_s
            if config.store.compact_every_steps and learner.step % config.store.compact_every_steps == 0:
                compact(config)  # keeps the next polls' file lists short; readers keep their files (retention)
        elif finished or time.monotonic() - idle_since > idle_timeout_s:
            break
        else:  # idle: back off, so a learner waiting for rollouts queries the store less often
            time.sleep(wait_s)
            wait_s = min(wait_s * 1.5, max(poll_s, MAX_IDLE_POLL_S))
    if workers.interrupted(run_id):  # no checkpoint upload either: a SIGKILL may follow the SIGTERM soon
        print(f"learner stopped at step {learner.step} of {budget}: its process is stopping")
        return learner.step
    if finished and learner.step < budget:
        print(
            f"learner stopped at step {learner.step} of {budget}: the rollouts finished and no complete group "
            "is left to train on"
        )
    learner.log_newest_checkpoint()
    return learner.step
