"""Training loops that couple the rollout scheduler and the learner in one process.

- `pipelined` (MarsRL): the learner runs in its own thread, querying the store for complete groups
  after each rollout stage's append (not on a timer: a query scans the run, and the two threads share
  the CPU) and training on them as soon as `groups_per_step` of some agent are ready, while the scheduler
  keeps decoding segments; each new version is offered to the scheduler, which applies it at a stage
  boundary within the staleness bound. torch releases the GIL in its kernels, so both use the CPU.
- `synchronous` (the baseline): decode a whole batch of trajectories to their end, then train on
  everything it produced, then update the engine, and repeat.

Both stop after `max_steps` learner steps. They meet only through the store (groups, consumptions,
versions) and the offered weights, exactly as separate rollout and learner processes do.

Deliberate simplification: one learner thread; the rollout is the calling thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from marsrl_core.config import AGENTS
from marsrl_core.learn.learner import Learner, StepReport
from marsrl_core.rollout.scheduler import RolloutScheduler
from marsrl_core.store import TrainableGroup


@dataclass
class LoopResult:
    steps: int = 0
    wall_clock_s: float = 0.0
    stages: int = 0
    learner_busy_s: float = 0.0
    rollout_busy_s: float = 0.0
    reports: list[StepReport] = field(default_factory=list)

    @property
    def learner_utilisation(self) -> float:
        return self.learner_busy_s / self.wall_clock_s if self.wall_clock_s else 0.0

    @property
    def rollout_utilisation(self) -> float:
        return self.rollout_busy_s / self.wall_clock_s if self.wall_clock_s else 0.0


def ready_groups(learner: Learner, flush: bool = False) -> list[TrainableGroup]:
    """Up to `groups_per_step` complete groups per agent (`downstream_groups_per_step` for the Verifier
    and the Corrector); empty unless some agent has that many ready
    (or `flush`, at the end of a run, when any ready group counts). Groups older than the learner's
    `max_staleness` come along flagged `stale` (the step drops them) but never make a step ready,
    except at `flush` when no fresh group is left: the run's data is all there is, so up to a step's
    count of them per agent (the newest) are trained on rather than ending the run short of its steps."""
    per_agent, bound = learner.cfg.learner.groups_per_step_by_agent(), learner.cfg.learner.max_staleness
    by_agent = learner.store.trainable_groups_by_agent(
        learner.run_id, AGENTS, limit=per_agent, min_version=None if bound is None else learner.step - bound
    )
    fresh = {agent: [g for g in groups if not g.stale] for agent, groups in by_agent.items()}
    if flush and not any(fresh.values()):
        return [replace(g, stale=False) for agent, groups in by_agent.items() for g in groups[-per_agent[agent] :]]
    if not flush and all(len(groups) < per_agent[agent] for agent, groups in fresh.items()):
        return []
    return [g for groups in by_agent.values() for g in groups]


def _offer(scheduler: RolloutScheduler, learner: Learner, report: StepReport) -> None:
    """Offer a copy of the new weights (the learner keeps training its own), one copy per policy."""
    copies: dict[str, dict] = {}
    for agent in AGENTS:
        name = learner.policy_name(agent)
        if name not in copies:
            copies[name] = {k: v.clone() for k, v in learner.state_dict(agent).items()}
    scheduler.offer_weights(report.step, {agent: copies[learner.policy_name(agent)] for agent in AGENTS})


def run_pipelined(
    scheduler: RolloutScheduler, learner: Learner, max_steps: int, on_step: Callable[[StepReport], None] | None = None
) -> LoopResult:
    result = LoopResult()
    rollout_done = threading.Event()
    stage_appended = threading.Event()  # new rewards can only appear when a stage has appended
    failure: list[BaseException] = []

    def learn() -> None:
        try:
            while learner.step < max_steps:
                stage_appended.clear()  # cleared before the query: an append after it wakes the wait below
                groups = ready_groups(learner, flush=rollout_done.is_set())
                if not groups:
                    if rollout_done.is_set():
                        return
                    stage_appended.wait(timeout=1.0)
                    continue
                start = time.perf_counter()
                report = learner.train_step(groups)
                _offer(scheduler, learner, report)
                result.learner_busy_s += time.perf_counter() - start
                result.reports.append(report)
                if on_step:
                    on_step(report)
        except BaseException as err:  # surfaced in the calling thread
            failure.append(err)

    start = time.perf_counter()
    thread = threading.Thread(target=learn, name="marsrl-learner", daemon=True)
    thread.start()
    try:
        while thread.is_alive() and not scheduler.finished():
            t = time.perf_counter()
            scheduler.stage()
            stage_appended.set()
            result.rollout_busy_s += time.perf_counter() - t
            result.stages += 1
    finally:
        rollout_done.set()
        stage_appended.set()
        thread.join()
    if failure:
        raise failure[0]
    result.steps = learner.step
    result.wall_clock_s = time.perf_counter() - start
    return result


def run_synchronous(
    scheduler: RolloutScheduler, learner: Learner, max_steps: int, on_step: Callable[[StepReport], None] | None = None
) -> LoopResult:
    result = LoopResult()
    scheduler.synchronous = True  # admit a new batch only when the previous one has fully ended
    start = time.perf_counter()
    while learner.step < max_steps and not scheduler.finished():
        t = time.perf_counter()
        scheduler.stage()  # admits a batch (only when idle, in synchronous mode)
        while scheduler.active_problems:
            scheduler.stage()
            result.stages += 1
        result.rollout_busy_s += time.perf_counter() - t
        result.stages += 1
        t = time.perf_counter()
        while learner.step < max_steps:
            groups = ready_groups(learner, flush=True)
            if not groups:
                break
            report = learner.train_step(groups)
            result.reports.append(report)
            if on_step:
                on_step(report)
        if result.reports:
            _offer(scheduler, learner, result.reports[-1])
        result.learner_busy_s += time.perf_counter() - t
    result.steps = learner.step
    result.wall_clock_s = time.perf_counter() - start
    return result
