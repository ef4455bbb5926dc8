"""Grouped agentic rollouts decoded in segments: the MarsRL pipeline scheduler.

A trajectory unrolls Solver -> Verifier -> Corrector -> Verifier -> Corrector (`max_turns` <= 5).
Per problem the Solver samples a group of `num_generations`; once every group of a turn of that
problem has finished, the next agent selects inputs among its outputs and samples a group of
`downstream_generations` for each (`turns.py`); with no Verifier output saying `Wrong` there is no
Corrector turn, and the trajectory ends.

Problems arrive in batches (`add_problems`) and wait for admission. The scheduler runs in stages. A stage
1. applies a newer policy version if one was offered and no in-flight sample would then span more
   than `max_version_span` versions (otherwise it waits and admits nothing, so the old samples drain);
2. admits waiting problems, oldest first, up to `problems_per_batch` x `batches_in_flight` in flight
   (the synchronous baseline: one batch, when the previous one has ended), while the admission gate
   (`gate.py`: the learner's pace) has room for a Solver group;
3. decodes one segment (`segment_tokens`, capped by each agent's remaining budget) for every
   unfinished sample of every problem in one engine batch;
4. rewards what finished (decoupled: at once; shared: when the problem's trajectories end), creates
   the downstream groups whose inputs are now complete (a turn waits while the gate has no room for
   its agent), and appends new samples, segments and rewards to the store in one transaction.
So a problem's next agent starts at the first stage boundary after its own inputs are complete,
whatever the rest of its batch is doing (`turn_barrier=True` instead holds a batch's problems until
the whole batch has finished its turn: the rule the simulator compares against). Outputs cut by their
budget are `budget`-finished and rewarded `truncated_reward`. Shared reward (the ablation baseline): a
turn's reward is the mean final outcome of the trajectories through it.

`add_problems` (and `resume`) rebuild the state of problems the store holds already (after a crash):
finished samples keep their rewards, unfinished ones continue from their stored prefix, nothing
stored is decoded again. A stage whose rows the store holds already (its state was behind the store)
writes nothing and raises `RolloutBehindStore`; a new scheduler resumed from the store continues.
`batch_progress(b)` tells, per turn, what of batch `b` has started and finished.

Deliberate simplifications: a downstream turn waits for all groups of the previous turn of the same
problem (not just one group); prompts that do not fit the engine's context with their budget are
rejected and recorded, and that branch ends.
"""

from __future__ import annotations

import random
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from marsrl_core.agents.outcomes import OutcomeChecker
from marsrl_core.agents.problems import Problem
from marsrl_core.agents.rewards import judge as judge_output
from marsrl_core.agents.roles import CORRECTOR, SOLVER, VERIFIER, Roles
from marsrl_core.config import MarsRLConfig
from marsrl_core.divergence import PolicyDiverged
from marsrl_core.faults import crash_point
from marsrl_core.rollout.resume import restore
from marsrl_core.rollout.samples import (
    BatchProgress,
    ProblemState,
    RolloutBehindStore,
    Sample,
    StageReport,
    agent_of_turn,
    reward_row,
    sample_row,
    shared_outcome,
)
from marsrl_core.rollout.segments import decode_segment
from marsrl_core.rollout.turns import batches_on_their_turn, has_next_turn, next_turn_inputs
from marsrl_core.rollout.weights import WeightChannel
from marsrl_core.store import Rejection, RewardRow, SegmentRow, Store
from marsrl_core.timings import timed


class RolloutScheduler:
    def __init__(
        self,
        cfg: MarsRLConfig,
        store: Store,
        run_id: str,
        engine: Any,
        tokenizer: Any,
        roles: Roles,
        problems: Iterable[Problem] = (),
        *,
        seed: int = 0,
        weights: WeightChannel | None = None,
        gate: Any = None,
        judge: Callable[..., Any] = judge_output,
        checker: OutcomeChecker | None = None,
        turn_barrier: bool = False,
        new_group_id: Callable[[], str] = lambda: uuid.uuid4().hex,
    ):
        """`engine`: one engine for all agents (shared policy) or a dict agent -> engine (per-agent).
        `problems`: problems waiting for admission (more arrive with `add_problems`).
        `weights`: where newer policy versions come from (`WeightChannel`: polled before every stage);
        None: only what `offer_weights` offers.
        `gate`: asked before each admission (`AdmissionGate.admits`); None admits up to the limit.
        `judge`: how a finished output is judged (`agents.rewards.judge`'s signature).
        `checker`: checks the finished Solver and Corrector outputs of a stage side by side, each
        time-limited (`agents.outcomes.OutcomeChecker`); None: `judge` checks each in this thread.
        `turn_barrier`: hold each batch's problems at every turn until the whole batch has finished it.
        `new_group_id`: a new group's id (its samples are `<group id>-<i>`, their sampling seeds drawn
        from those): a uuid, unique across processes and restarts."""
        self.cfg, self.rc = cfg, cfg.rollout
        self.store, self.run_id = store, run_id
        self.engines = engine if isinstance(engine, dict) else {a: engine for a in (SOLVER, VERIFIER, CORRECTOR)}
        self.engine = self.engines[SOLVER]
        self.tokenizer, self.roles = tokenizer, roles
        self.waiting: deque[tuple[int | None, Problem]] = deque((None, p) for p in problems)
        self.rng = random.Random(seed)
        self.seed = seed
        self.states: dict[str, ProblemState] = {}
        self.weights = weights if weights is not None else WeightChannel()
        self.context = getattr(self.engine, "max_positions", None) or getattr(self.engine, "max_model_len", None)
        self.stats = {"stages": 0, "deferred_updates": 0, "rejected_prompts": 0, "gated_stages": 0, "held_turns": 0}
        self.started_groups: Counter[str] = Counter()  # groups this scheduler created, per agent
        self.stored_groups: Counter[str] = Counter()  # and those of them its appends stored
        self.dropped: Counter[int | None] = Counter()  # problems dropped unadmitted or cut short, per batch
        self.draining = False  # stopping: no admission and no next turn
        self.synchronous = self.rc.synchronous
        self.gate = gate
        self.judge = judge
        self.checker = checker
        self.turn_barrier = turn_barrier
        self.new_group_id = new_group_id

    # ------------------------------------------------------------------ policy versions
    @property
    def version(self) -> int:
        return self.engine.policy_version

    @property
    def pending(self) -> tuple[int, Any] | None:
        """The newest policy offered and not yet applied: (version, weights), or None."""
        return self.weights.pending

    def offer_weights(self, version: int, weights: Any) -> None:
        """A newer policy (weights, or a dict agent -> weights); applied at the next stage boundary the
        version-span bound allows. Safe to call from another thread (the learner's)."""
        self.weights.offer(version, weights)

    def _apply_pending(self) -> bool:
        """Apply an offered policy unless an in-flight sample would then span too many versions (False)."""
        oldest = min((s.start_version for s in self.in_flight() if s.start_version is not None), default=None)
        applied = self.weights.apply(self.engines, self.version, oldest, self.rc.max_version_span)
        if not applied:
            self.stats["deferred_updates"] += 1
        return applied

    # ------------------------------------------------------------------ state
    def release(self) -> None:
        """Unlink the samples (parents and children refer to each other), so that dropping the scheduler
        frees them at once, not at the collector's next full pass; the scheduler is not used afterwards."""
        for batch in {st.batch for st in self.states.values()}:
            self.forget_batch(batch)
        self.waiting.clear()

    def in_flight(self) -> list[Sample]:
        return [
            s for st in self.states.values() if not st.done for t in st.turns.values() for s in t if s.finish is None
        ]

    @property
    def active_problems(self) -> int:
        return sum(not st.done for st in self.states.values())

    def finished(self) -> bool:
        """No problem in flight and none waiting for admission."""
        return self.active_problems == 0 and not self.waiting

    def add_problems(self, problems: Iterable[Problem], batch: int | None = None, resume: bool = True) -> int:
        """Problems of batch `batch`: those the store holds already are resumed from it (`resume`; False
        for problems known to have nothing stored), the others wait for admission, in order. Returns how
        many stored samples were restored."""
        problems = list(problems)
        restored = self.resume({p.problem_id: p for p in problems}, batch) if resume else 0
        self.waiting.extend((batch, p) for p in problems if p.problem_id not in self.states)
        return restored

    def forget_batch(self, batch: int | None) -> None:
        """Let go of batch `batch`'s problems (its flow is done with them)."""
        for problem_id in [pid for pid, st in self.states.items() if st.batch == batch]:
            for samples in self.states.pop(problem_id).turns.values():
                for sample in samples:
                    sample.children.clear()
        self.waiting = deque((b, p) for b, p in self.waiting if b != batch)

    def drop_waiting(self) -> int:
        """A stopping run: forget the problems not admitted; those admitted finish the samples they
        decode but start no next turn. Returns how many problems were dropped or cut short so far."""
        self.draining = True
        self.dropped.update(batch for batch, _ in self.waiting)
        self.waiting.clear()
        return sum(self.dropped.values())

    def batch_progress(self, batch: int | None) -> BatchProgress:
        """What of batch `batch` has started and finished, per turn (see `BatchProgress`)."""
        waiting = sum(b == batch for b, _ in self.waiting)
        return BatchProgress.of([st for st in self.states.values() if st.batch == batch], waiting, self.dropped[batch])

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _new_group(
        self,
        problem: Problem,
        turn: int,
        size: int,
        prompt_text: str,
        parent: Sample | None,
        rejected: list[Rejection],
    ) -> list[Sample]:
        agent = agent_of_turn(turn)
        prompt_ids = self._encode(prompt_text)
        budget = self.rc.max_tokens(agent)
        if self.context is not None and len(prompt_ids) + budget > self.context:
            self.stats["rejected_prompts"] += 1
            rejected.append(
                Rejection(
                    f"rollout:{problem.problem_id}",
                    f"turn {turn}",
                    f"{agent} prompt of {len(prompt_ids)} tokens + budget {budget} exceeds the engine "
                    f"context of {self.context}",
                    prompt_text[:500],
                )
            )
            return []
        group_id = self.new_group_id()
        self.started_groups[agent] += 1
        samples = [
            Sample(f"{group_id}-{i}", problem, agent, turn, group_id, prompt_ids, budget, parent) for i in range(size)
        ]
        if parent is not None:
            parent.children.extend(samples)
        return samples

    def _admit(self, rejected) -> list[Sample]:
        created: list[Sample] = []
        if self.synchronous and self.active_problems:  # the baseline admits a new batch only when idle
            return []
        limit = self.rc.problems_per_batch * (1 if self.synchronous else self.rc.batches_in_flight)
        while self.waiting and self.active_problems < limit:
            batch, problem = self.waiting[0]
            if problem.problem_id in self.states:  # admitted before a resume
                self.waiting.popleft()
                continue
            if self.gate is not None and not self.gate.room(
                SOLVER, 1, self.started_groups, self.stored_groups, self.version
            ):
                self.stats["gated_stages"] += 1
                break
            self.waiting.popleft()
            state = ProblemState(problem, batch=batch)
            self.states[problem.problem_id] = state
            group = self._new_group(
                problem,
                0,
                self.rc.num_generations,
                self.roles.prompt(self.tokenizer, SOLVER, problem.prompt),
                None,
                rejected,
            )
            state.turns[0] = group
            state.done = not group
            created += group
        return created

    # ------------------------------------------------------------------ one stage
    def stage(self) -> StageReport:
        report = StageReport()
        self.stats["stages"] += 1
        rejected: list[Rejection] = []
        created: list[Sample] = []
        with timed("rollout.weights"):
            latest = self.weights.poll(self.version)  # one store query for the engines and the gate
            if self.gate is not None and self.weights.store is self.gate.store:
                self.gate.use_version(latest)
            elif self.gate is not None:
                self.gate.read_version()
            applied = self._apply_pending()
        if applied:
            with timed("rollout.admit"):
                created = self._admit(rejected)
            report.admitted = len({s.problem.problem_id for s in created})
        active = self.in_flight()
        segments: list[SegmentRow] = []  # one per in-flight sample (`segments.decode_segment`)
        rewards: list[RewardRow] = []
        if active:
            report.decoded = len(active)
            with timed("rollout.decode"):
                segments = decode_segment(self.engines, active, self.rc, self.seed)
            _check_logprobs(segments, active)
            report.tokens += sum(len(segment.token_ids) for segment in segments)
            finished = [sample for sample in active if sample.finish]
            with timed("rollout.rewards"):
                self.judge_finished(finished)
            report.finished += len(finished)
            if self.rc.reward_mode == "decoupled":
                rewards += [reward_row(sample, sample.judgement.reward) for sample in finished]
        held = batches_on_their_turn(self.states.values()) if self.turn_barrier else set()
        for state in self.states.values():
            if not state.done and state.batch not in held:
                with timed("rollout.advance"):
                    created += self._advance(state, rejected, rewards)
        report.new_samples = len(created)
        crash_point("rollout.append")
        with timed("rollout.store_write"):
            stored = self.store.append(self.run_id, [sample_row(s, self.rc) for s in created], segments, rewards)
        if stored.written:
            self.stored_groups.update(agent for agent, _ in {(s.agent, s.group_id) for s in created})
        else:
            raise RolloutBehindStore(
                f"run {self.run_id!r}: a stage found rows it decoded stored already ({stored.describe()}); "
                "nothing of it was written, and a retry of the turn resumes from the store"
            )
        if rejected:
            self.store.reject(self.run_id, rejected)
        return report

    def judge_finished(self, samples: list[Sample]) -> None:
        """Decode finished samples' texts and judge them (their rewards and what was parsed): the Solver
        and Corrector outputs checked side by side by `checker` when there is one."""
        for sample in samples:
            sample.text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        outcomes: dict[str, Any] = {}
        if self.checker is not None:
            checked = [s for s in samples if s.agent in (SOLVER, CORRECTOR) and s.finish != "budget"]
            results = self.checker.check_many([(s.problem, s.text) for s in checked])
            outcomes = {s.sample_id: o for s, o in zip(checked, results)}
        for sample in samples:
            judged = sample.parent.solution.judgement.correct if sample.agent == VERIFIER else None
            sample.judgement = self.judge(
                sample.agent,
                sample.text,
                problem=sample.problem,
                judged_solution_correct=judged,
                truncated=sample.finish == "budget",
                truncated_reward=self.rc.truncated_reward,
                outcome=outcomes.get(sample.sample_id),
            )

    def _advance(self, state: ProblemState, rejected, rewards: list[RewardRow]) -> list[Sample]:
        """Create the next turn's groups once the current turn has finished; close the problem when done."""
        turn = max(state.turns)
        current = state.turns[turn]
        if any(s.finish is None for s in current):
            return []
        created: list[Sample] = []
        if turn + 1 < self.rc.max_turns and has_next_turn(turn + 1, current):
            agent, room = agent_of_turn(turn + 1), self.rc.select_inputs
            if self.draining:  # the run is stopping: the trajectory ends here, and its batch counts as cut short
                self.dropped[state.batch] += 1
            elif self.gate is None or self.gate.room(
                agent, room, self.started_groups, self.stored_groups, self.version
            ):
                created = self._downstream(state, turn + 1, current, rejected)
            else:
                self.stats["held_turns"] += 1  # the learner has not caught up with this agent: next stage
                return []
        if created:
            state.turns[turn + 1] = created
            return created
        state.done = True
        if self.rc.reward_mode == "shared":
            for samples in state.turns.values():
                rewards += [reward_row(s, shared_outcome(s)) for s in samples]
        return []

    def _downstream(self, state: ProblemState, turn: int, upstream: list[Sample], rejected) -> list[Sample]:
        created: list[Sample] = []
        for pick, text in next_turn_inputs(
            state.problem, turn, upstream, self.rc, self.roles, self.tokenizer, self.rng
        ):
            created += self._new_group(state.problem, turn, self.rc.downstream_generations, text, pick, rejected)
        return created

    # ------------------------------------------------------------------ driving
    def run(self, max_stages: int | None = None) -> list[StageReport]:
        """Run stages until every problem is done and none is waiting."""
        reports = []
        while not self.finished() and (max_stages is None or len(reports) < max_stages):
            reports.append(self.stage())
        return reports

    # ------------------------------------------------------------------ resume
    def resume(self, problems_by_id: dict[str, Problem], batch: int | None = None) -> int:
        """Rebuild the state of the problems in `problems_by_id` (of batch `batch`) from the store
        (`resume.restore`); returns how many samples were restored."""
        return restore(self, problems_by_id, batch)


def _check_logprobs(segments: list[SegmentRow], samples: list[Sample]) -> None:
    """Non-finite log-probs from the engine mean the weights it decoded with are unusable: the run
    stops (`PolicyDiverged`) before anything of the stage is stored."""
    for segment, sample in zip(segments, samples):
        if not np.isfinite(np.asarray(segment.logprobs, dtype=np.float64)).all():
            raise PolicyDiverged(
                f"rollout: a {sample.agent} output decoded under policy version {segment.policy_version} has "
                "non-finite log-probs, so that version's weights are unusable; the run stops and nothing of this "
                "stage was stored: look at learner.learning_rate and learner.max_weight_abs"
            )
