"""A rollout's samples: one agent's output for one prompt, linked to the sample it is about (its
parent) and to the samples made from it (its children), and the shared trajectory reward over them.

A trajectory unrolls Solver -> Verifier -> Corrector -> Verifier -> Corrector; turn t is played by
`agent_of_turn(t)`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from marsrl_core.agents.problems import Problem
from marsrl_core.agents.rewards import Judgement
from marsrl_core.agents.roles import CORRECTOR, SOLVER, VERIFIER
from marsrl_core.store import RewardRow, SampleRow


class RolloutInterrupted(Exception):
    """A turn stopped at a stage boundary because its worker is stopping (a signal); its samples are
    stored and a resume continues them."""


class RolloutBehindStore(Exception):
    """A stage's rows were not stored because some of its keys already were: the turn's state lacked
    something the store holds (it decoded a stored segment again). Nothing of the stage was written;
    a retry of the turn resumes from the store."""


def agent_of_turn(turn: int) -> str:
    return SOLVER if turn == 0 else (VERIFIER if turn % 2 == 1 else CORRECTOR)


@dataclass(eq=False)
class Sample:
    sample_id: str
    problem: Problem
    agent: str
    turn: int
    group_id: str
    prompt_ids: list[int]
    max_tokens: int
    parent: Sample | None = None
    token_ids: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    segments: int = 0
    finish: str | None = None  # "stop" or "budget" once finished
    text: str = ""
    judgement: Judgement | None = None
    children: list[Sample] = field(default_factory=list)

    @property
    def start_version(self) -> int | None:
        return self.versions[0] if self.versions else None

    @property
    def solution(self) -> Sample:
        """The solution this sample is about: itself for Solver/Corrector, the judged one for a Verifier."""
        return self if self.agent != VERIFIER else self.parent


@dataclass
class ProblemState:
    problem: Problem
    turns: dict[int, list[Sample]] = field(default_factory=dict)
    done: bool = False
    batch: int | None = None


@dataclass
class BatchProgress:
    """One batch as its scheduler holds it: per turn the samples started, finished and their tokens, and
    where each problem still in flight stands (its current turn, and whether that turn has finished)."""

    waiting: int = 0  # problems not admitted yet
    dropped: int = 0  # problems dropped unadmitted or cut short at the gate (the run stopped)
    problems: int = 0  # admitted
    done_problems: int = 0
    samples: Counter = field(default_factory=Counter)  # turn -> samples started
    finished: Counter = field(default_factory=Counter)  # turn -> samples finished
    tokens: Counter = field(default_factory=Counter)  # turn -> tokens decoded
    open_turns: list[tuple[int, bool]] = field(default_factory=list)  # (current turn, all of it finished)

    @classmethod
    def of(cls, states: list[ProblemState], waiting: int, dropped: int) -> BatchProgress:
        """The progress of a batch whose admitted problems are `states`."""
        progress = cls(waiting=waiting, dropped=dropped, problems=len(states))
        for st in states:
            progress.done_problems += st.done
            for turn, samples in st.turns.items():
                progress.add(turn, samples)
            if not st.done:
                current = max(st.turns, default=-1)
                progress.open_turns.append((current, all(s.finish for s in st.turns.get(current, ()))))
        return progress

    def add(self, turn: int, samples: list[Sample]) -> None:
        self.samples[turn] += len(samples)
        self.finished[turn] += sum(s.finish is not None for s in samples)
        self.tokens[turn] += sum(len(s.token_ids) for s in samples)

    def started(self, turn: int) -> bool:
        return self.samples[turn] > 0

    def final(self, turn: int) -> bool:
        """No problem of the batch can still start or decode a sample of `turn`."""
        return not self.waiting and all(c > turn or (c == turn and done) for c, done in self.open_turns)

    @property
    def ended(self) -> bool:
        """Nothing of the batch waits or decodes any more."""
        return not self.waiting and self.done_problems == self.problems

    @property
    def complete(self) -> bool:
        """Every problem of the batch admitted and done."""
        return self.ended and not self.dropped


@dataclass
class StageReport:
    """What one rollout stage did."""

    tokens: int = 0  # decoded
    decoded: int = 0  # samples that decoded a segment
    finished: int = 0  # samples that finished
    new_samples: int = 0  # samples started (new problems' Solver groups and downstream groups)
    admitted: int = 0  # new problems


def sample_row(s: Sample, rc: Any) -> SampleRow:
    """The store's row for a new sample (`rc`: the rollout config, for its group's size)."""
    size = rc.num_generations if s.turn == 0 else rc.downstream_generations
    parent = s.parent.sample_id if s.parent else None
    return SampleRow(s.sample_id, s.problem.problem_id, s.agent, s.turn, s.group_id, size, s.prompt_ids, parent)


def reward_row(s: Sample, reward: float) -> RewardRow:
    """The store's row for a finished sample's reward and what was read from it."""
    j = s.judgement
    return RewardRow(s.sample_id, reward, j.correct, j.outcome, j.parsed, s.text)


def shared_outcome(sample: Sample) -> float:
    """The shared reward (the ablation baseline) of `sample`: the mean final outcome of the
    trajectories through it (1 if the trajectory's last solution is right)."""
    if sample.children:
        return sum(shared_outcome(c) for c in sample.children) / len(sample.children)
    return 1.0 if sample.solution.judgement.correct else 0.0
