"""The learner flow: polls the store, trains as complete groups arrive, publishes versions; stops at
the step budget, or once the rollouts have finished and nothing is left to train on.

Each poll is a direct question to the process's runtime (`work.ready_groups`, one store query every
`poll_s`, backing off while idle, and reused while no commit has changed the lake); a task would
cost 50-200 ms of Prefect bookkeeping each time. A step is a `train-step` task that gets the groups
the poll found as its argument. The step count is read from the runtime's learner after every step,
so a step that failed and was retried (by a rebuilt learner) still counts once. Every
`store.compact_every_steps` versions it compacts the store (a task), so a days-long run's polls do
not slow down with the thousands of small files its commits write. It also stops before its next
step when its process is stopping (the train flow's rollouts were stopped by a signal or failed), so
a stopped `marsrl train` does not wait for the idle timeout. When the policy diverges
(`PolicyDiverged`: a step's update, or a split run's rollouts, found weights or log-probs non-finite
or absurd) it ends Failed with that one line and publishes nothing more. When it ends (not stopped)
with `final`, its newest version is made durable (`Learner.make_durable`) if `learner.save_every`
left it weights-only; a stopped one leaves that to the resume's rollback.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow
from prefect.states import Failed

from flows.params import run_config
from marsrl_core.config import MarsRLConfig, absolute_paths, default_config
from marsrl_core.runtime import events, work
from marsrl_core.runtime.context import runtime
from marsrl_core.timings import timed
from tasks.evaluation import compact
from tasks.learner import train_step
from tasks.logs import say

MAX_IDLE_POLL_S = 1.0  # the longest wait between two polls of an idle learner


def step_line(report: dict) -> str:
    """One log line per learner step: per agent its mean reward, loss, tokens and staleness."""
    parts = []
    for agent, m in report["metrics"].items():
        if "loss" in m:
            parts.append(
                f"{agent} reward {m['reward_mean']:.3f} loss {m['loss']:+.4f} tokens {m['tokens']:.0f} "
                f"staleness {m['staleness_mean']:.1f}"
            )
        elif "groups" in m:  # every group had one reward for all its samples: no gradient
            parts.append(
                f"{agent} reward {m['reward_mean']:.3f}, no gradient ({m['groups']:.0f} groups of equal rewards)"
            )
        if m.get("dropped_stale_samples"):
            parts.append(f"{agent} dropped {m['dropped_stale_samples']:.0f} stale samples")
    return f"learner step {report['step']}: " + "; ".join(parts)


@flow(name="learner", flow_run_name="learner-{run_id}", log_prints=True)
def learner_flow(
    config: MarsRLConfig = default_config(),
    run_id: str = "manual",
    max_steps: int | None = None,
    poll_s: float = 0.2,
    idle_timeout_s: float = 3600.0,
    overrides: dict[str, Any] | None = None,
    final: bool = True,
) -> int:
    config = run_config(config, overrides)  # a few dotted fields changed, e.g. {"learner.max_steps": 3}
    config = absolute_paths(config)  # its checkpoint URIs are recorded: absolute, found from any folder
    rt, budget = runtime(), max_steps or config.learner.max_steps
    store = rt.store(config, lane="learner")
    step = rt.learner(config, run_id).step
    # One process retries a failed step with a learner rebuilt from the last commit; with several ranks the
    # others are inside the failed step's collectives, so the learner fails and is resumed as a whole.
    retries = {"retries": 0} if rt.learner(config, run_id).ranks is not None else {}
    idle_since, finished, wait_s, idle_out = time.monotonic(), False, poll_s, False
    while step < budget and not rt.interrupted(run_id):
        # A flush differs only where no agent has a step's worth, so the rollouts' end is asked only then.
        groups = work.ready_groups(config, run_id)
        if not groups and (finished := store.has_event(run_id, events.ROLLOUTS_FINISHED)):
            groups = work.ready_groups(config, run_id, flush=True)
        if groups:
            with timed("learner.task"):
                report = train_step.with_options(task_run_name=f"train-step-{step + 1}", **retries)(
                    config, run_id, groups, flush=finished
                )
            if report is not None and "diverged" in report:  # one line for the user, no traceback; nothing published
                return Failed(message=report["diverged"])
            step = rt.learner(config, run_id).step
            if report is not None:
                say(step_line(report))
            idle_since, wait_s = time.monotonic(), poll_s
            if config.store.compact_every_steps and step % config.store.compact_every_steps == 0:
                with timed("learner.compact"):
                    compact(config)  # keeps the next polls' file lists short; readers keep their files (retention)
        elif finished:
            break
        elif diverged := store.event_details(run_id, events.DIVERGED):  # the rollouts stopped the run (a split run's)
            return Failed(message=diverged[0])
        elif time.monotonic() - idle_since > idle_timeout_s:
            idle_out = True
            break
        else:  # idle: back off, so a learner waiting for rollouts queries the store less often
            with timed("learner.idle"):
                time.sleep(wait_s)
            wait_s = min(wait_s * 1.5, max(poll_s, MAX_IDLE_POLL_S))
    if rt.interrupted(run_id):  # no checkpoint upload either: a SIGKILL may follow the SIGTERM soon
        say(f"learner stopped at step {step} of {budget}: its process is stopping")
        return step
    if idle_out and idle_timeout_s > 0:  # 0: the synchronous baseline's learner, called after each batch
        say(
            f"learner stopped at step {step} of {budget}: no complete group arrived for {idle_timeout_s:g} s "
            "(its idle timeout) and the rollouts have not finished; run it again to continue"
        )
    elif finished and step < budget:
        say(
            f"learner stopped at step {step} of {budget}: the rollouts finished and no complete group "
            "is left to train on"
        )
    if final:  # the run's result: resumable and logged (`learner.save_every`)
        rt.learner(config, run_id).make_durable()
    rt.learner(config, run_id).log_newest_checkpoint()
    return step
