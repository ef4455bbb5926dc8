"""Resuming a rollout after a crash: its state rebuilt from the store.

Finished samples keep their rewards (they are judged again from their stored text), unfinished ones
continue from their stored prefix, nothing stored is decoded again. A problem whose samples have all
finished is closed unless it still owes a downstream turn (or, with shared rewards, its rewards).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from marsrl_core.agents.problems import Problem
from marsrl_core.agents.roles import CORRECTOR, WRONG
from marsrl_core.config import RolloutConfig
from marsrl_core.rollout.samples import ProblemState, Sample, agent_of_turn

if TYPE_CHECKING:
    from marsrl_core.rollout.scheduler import RolloutScheduler


def restore(scheduler: RolloutScheduler, problems_by_id: dict[str, Problem], batch: int | None = None) -> int:
    """Rebuild `scheduler`'s state for the problems in `problems_by_id` (of batch `batch`) from its
    store; returns how many samples were restored."""
    rows = scheduler.store.samples_of_problems(scheduler.run_id, list(problems_by_id))
    if not rows:
        return 0
    stored = scheduler.store.load_samples(scheduler.run_id, [r["sample_id"] for r in rows])
    by_id: dict[str, Sample] = {}
    finished: list[Sample] = []
    for r in rows:
        problem = problems_by_id[r["problem_id"]]
        st = stored[r["sample_id"]]
        sample = Sample(
            r["sample_id"],
            problem,
            r["agent"],
            r["turn"],
            r["group_id"],
            st.prompt_tokens.tolist(),
            scheduler.rc.max_tokens(r["agent"]),
            by_id.get(r["parent_sample_id"]),
        )
        if sample.parent is not None:
            sample.parent.children.append(sample)
        sample.token_ids = st.token_ids.tolist()
        sample.versions = st.versions.tolist()
        sample.segments = st.num_segments
        if st.finish_reason in ("stop", "budget"):
            sample.finish = st.finish_reason
            finished.append(sample)
        by_id[sample.sample_id] = sample
        state = scheduler.states.setdefault(problem.problem_id, ProblemState(problem, batch=batch))
        state.turns.setdefault(sample.turn, []).append(sample)
    scheduler.judge_finished(finished)  # in turn order: a Verifier's judged solution comes before it
    rewarded = {r["sample_id"] for r in rows if r["rewarded"]}
    for state in scheduler.states.values():
        if state.problem.problem_id not in problems_by_id:
            continue
        samples = [s for t in state.turns.values() for s in t]
        if all(s.finish for s in samples) and _is_closed(scheduler.rc, state, rewarded):
            state.done = True
    return len(by_id)


def _is_closed(rc: RolloutConfig, state: ProblemState, rewarded: set[str]) -> bool:
    """A fully finished problem is done unless it still owes a downstream turn (or shared rewards)."""
    samples = [s for t in state.turns.values() for s in t]
    if rc.reward_mode == "shared":
        return all(s.sample_id in rewarded for s in samples)
    last = max(state.turns)
    if last + 1 >= rc.max_turns:
        return True
    if agent_of_turn(last + 1) == CORRECTOR:
        return not any(v.judgement.parsed == WRONG for v in state.turns[last])
    return False
