"""Which complete groups a learner step takes: the learner's poll of the store."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from marsrl_core.config import AGENTS
from marsrl_core.store import TrainableGroup

if TYPE_CHECKING:
    from marsrl_core.learn.learner import Learner


def ready_groups(learner: Learner, flush: bool = False) -> list[TrainableGroup]:
    """Up to `groups_per_step` complete groups per agent (`downstream_groups_per_step` for the Verifier
    and the Corrector); empty unless some agent has that many ready
    (or `flush`, at the end of a run, when any ready group counts). Groups older than the learner's
    `max_trained_age` come along flagged `stale` (with `stale_groups='drop'` the step drops them) but
    never make a step ready, except at `flush` when no fresh group is left: the run's data is all there
    is, so up to a step's count of them per agent (the newest) are trained on rather than ending the
    run short of its steps.

    A step also takes, beyond its count, every complete group that is due: one the next step would find
    older than `max_trained_age` (the poll returns them past its limit). So a group complete by the step
    at which it is `max_trained_age` versions old is trained at that age at most, however many of its
    agent the admission gate let start at once (its one-step floor) or how few of that agent the steps
    before took.

    With `learner.stale_groups='correct'` stale groups are trained on (with decoupled PPO's correction):
    a step takes an agent's fresh groups first, then fills its count with stale ones, the newest first;
    the other stale groups wait for a later step."""
    per_agent, bound = learner.cfg.learner.groups_per_step_by_agent(), learner.cfg.learner.max_trained_age
    by_agent = learner.store.trainable_groups_by_agent(
        learner.run_id, AGENTS, limit=per_agent, min_version=None if bound is None else learner.step - bound
    )
    if learner.cfg.learner.stale_groups == "correct":
        return _with_stale(by_agent, per_agent, flush)
    fresh = {agent: [g for g in groups if not g.stale] for agent, groups in by_agent.items()}
    if flush and not any(fresh.values()):
        return [replace(g, stale=False) for agent, groups in by_agent.items() for g in groups[-per_agent[agent] :]]
    if not flush and all(len(groups) < per_agent[agent] for agent, groups in fresh.items()):
        return []
    return [g for groups in by_agent.values() for g in groups]


def _with_stale(
    by_agent: dict[str, list[TrainableGroup]], per_agent: dict[str, int], flush: bool
) -> list[TrainableGroup]:
    chosen = {}
    for agent, groups in by_agent.items():
        fresh = [g for g in groups if not g.stale]  # the step's count, or more where more are due
        stale = sorted((g for g in groups if g.stale), key=lambda g: g.oldest_version, reverse=True)
        chosen[agent] = (fresh + stale)[: max(per_agent[agent], len(fresh))]
    if not flush and all(len(groups) < per_agent[agent] for agent, groups in chosen.items()):
        return []
    return [g for groups in chosen.values() for g in groups]
