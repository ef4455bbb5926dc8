"""The admission gate: the learner paces the rollouts (AReaL's producer-side staleness control).

A rollout that runs ahead of a slow or late learner builds a backlog that the learner then trains on
ever older policies. AReaL (Fu et al. 2025, "AReaL: a large-scale asynchronous RL system") bounds it
at the producer: a new rollout may start only while (eta + v + 1) x B exceeds the samples generated
so far plus those running, v being the learner's version and B its batch. Here a learner step takes
up to `groups_per_step` groups of each agent, and the gate applies the rule per agent in groups:

    k new groups of an agent (a problem's Solver group, or a downstream turn's groups) start only while
        started groups - consumed groups + k <= (eta + 1 - lag) x that agent's groups per step

or while fewer than one step's worth (`groups_per_step`) of that agent are started and not consumed,

where started counts the run's groups of that agent (trained, waiting to be trained and still
decoding), consumed those its learner steps took (trained, or dropped as stale), eta is
`learner.max_trained_age` and lag the versions the learner has committed beyond the one the engines
hold (a new sample starts under the engines' version). A problem waits for admission, and a problem's
next turn waits at its stage boundary, until the learner has made room. Every untrained group then
fits in the next eta + 1 - lag steps, so none is trained more than eta versions after the version it
started under, whatever the learner's speed. A late learner (a learner process that starts after the
rollouts) makes the rollouts wait at the first eta + 1 steps' worth.

The learner's version is read from the store at every stage, the counts when the gate would close (at
most every `refresh_s`, and at once when the learner's version has moved since the last read: a step
is what consumes groups), so the gate sees the steps of a learner in another process; in between it
adds the groups its own scheduler created.
A step takes at most `groups_per_step` of an agent, the oldest policy version first, and fewer when another
agent made the step ready: the bound counts the groups per step the run's steps have taken on average
(`per_step`). The one-step floor keeps the learner from waiting on groups that wait on it (a step is
ready once an agent has `groups_per_step` complete groups); where it is above the bound, or where the
steps take fewer of an agent than `per_step`, the learner's side keeps the bound: a step takes along
every complete group that the next step would find older than eta (`learn.groups.ready_groups`). A
group still decoding when it is eta versions old is trained older; the learner's `stale_groups`
handles it.

Deliberate simplification: with several rollout processes for one run each adds only its own groups
between two reads of the store.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from typing import Any


class AdmissionGate:
    """Whether more groups of an agent may start (`room`), from the store's group counts of `run_id`."""

    def __init__(
        self, store: Any, run_id: str, groups_per_step: Mapping[str, int], max_trained_age: int, refresh_s: float = 0.5
    ):
        self.store, self.run_id = store, run_id
        self.groups_per_step = dict(groups_per_step)
        self.max_trained_age = max_trained_age
        self.refresh_s = refresh_s
        self.learner_version = 0  # the learner's committed version, at the last read
        self.started: Counter[str] = Counter()  # the store's started groups, at the last read
        self.consumed: Counter[str] = Counter()  # and its consumed ones
        self._local_at_read: Counter[str] = Counter()  # the scheduler's own stored groups at that read
        self._read_at: float | None = None
        self._version_at_read = 0  # the learner's version when the counts were read
        self.closed_reads = 0  # reads that found the gate closed

    def room(self, agent: str, groups: int, created: Counter[str], stored: Counter[str], engine_version: int) -> bool:
        """Whether `groups` more groups of `agent` may start under `engine_version` (the policy they
        would start with). `created`: the groups this process's scheduler has created so far, per
        agent; `stored`: those of them its appends have stored. Reads the store first if what the gate
        holds says no."""
        if self._open(agent, groups, created, engine_version):
            return True
        recent = self._read_at is not None and time.monotonic() - self._read_at < self.refresh_s
        if recent and self.learner_version == self._version_at_read:
            return False
        self.read(stored)
        if self._open(agent, groups, created, engine_version):
            return True
        self.closed_reads += 1
        return False

    def read_version(self) -> None:
        """Take the learner's committed version from the store (each stage: a group's age counts from
        the version it starts under, so the gate must not think the learner further behind than it
        is; counts read earlier only overstate the backlog, which errs on the side of waiting)."""
        self.use_version(self.store.latest_version(self.run_id))

    def use_version(self, latest: tuple[int, str] | None) -> None:
        """Take the learner's committed version as the store just answered it (`latest_version`)."""
        self.learner_version = latest[0] if latest else 0

    def read(self, stored: Counter[str]) -> None:
        """Take the run's started and consumed group counts from the store, then the learner's version
        (`stored`: the scheduler's own stored groups at this moment, which those counts include). A step
        committed between the two reads makes the version newer than the counts: the gate then errs on
        the side of waiting."""
        counts = self.store.group_counts(self.run_id)
        self.read_version()
        self.started = Counter({agent: c["started"] for agent, c in counts.items()})
        self.consumed = Counter({agent: c["consumed"] for agent, c in counts.items()})
        self._local_at_read = Counter(stored)
        self._read_at, self._version_at_read = time.monotonic(), self.learner_version

    def backlog(self, created: Counter[str]) -> dict[str, int]:
        """Per agent: groups started and not yet consumed, by what the gate knows."""
        since = created - self._local_at_read
        return {agent: self.started[agent] + since[agent] - self.consumed[agent] for agent in self.groups_per_step}

    def _open(self, agent: str, groups: int, created: Counter[str], engine_version: int) -> bool:
        # Counted from the learner's version at the read: a new group is trained within
        # ceil((backlog + 1) / per step) steps of it, and its age is that version plus those steps,
        # minus one, minus the version it starts under (the engines').
        # Below one step's worth of an agent the gate stays open (`groups_per_step`: what makes a step
        # ready), so that the learner can always take its next step: a bound below it would hold every
        # problem at a turn the learner waits for, and neither would move again.
        steps = self.max_trained_age + 1 - (self.learner_version - engine_version)
        if steps <= 0:  # the engines are eta + 1 versions behind: the next weight update comes first
            return False
        backlog = self.backlog(created)[agent]
        return backlog < self.groups_per_step[agent] or backlog + groups <= steps * self.per_step(agent)

    def per_step(self, agent: str) -> float:
        """The groups of `agent` a learner step takes: `groups_per_step`, or fewer, as many as its steps
        have taken on average (a step that another agent made ready takes what of this one is ready)."""
        if self.learner_version == 0:
            return self.groups_per_step[agent]
        return min(self.groups_per_step[agent], max(1.0, self.consumed[agent] / self.learner_version))
