"""What a decode stage does with its outputs before storing them: finished texts judged (their rewards
and what was parsed), and every segment's log-probs checked for a diverged policy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from marsrl_core.agents.outcomes import OutcomeChecker
from marsrl_core.agents.roles import CORRECTOR, SOLVER, VERIFIER
from marsrl_core.divergence import PolicyDiverged
from marsrl_core.rollout.samples import Sample
from marsrl_core.store import SegmentRow


def judge_samples(
    samples: list[Sample],
    tokenizer: Any,
    judge: Callable[..., Any],
    checker: OutcomeChecker | None,
    truncated_reward: float,
) -> None:
    """Decode finished samples' texts and judge them with `judge` (`agents.rewards.judge`'s signature):
    the Solver and Corrector outputs checked side by side by `checker` when there is one."""
    for sample in samples:
        sample.text = tokenizer.decode(sample.token_ids, skip_special_tokens=True)
    outcomes: dict[str, Any] = {}
    if checker is not None:
        checked = [s for s in samples if s.agent in (SOLVER, CORRECTOR) and s.finish != "budget"]
        results = checker.check_many([(s.problem, s.text) for s in checked])
        outcomes = {s.sample_id: o for s, o in zip(checked, results)}
    for sample in samples:
        judged = sample.parent.solution.judgement.correct if sample.agent == VERIFIER else None
        sample.judgement = judge(
            sample.agent,
            sample.text,
            problem=sample.problem,
            judged_solution_correct=judged,
            truncated=sample.finish == "budget",
            truncated_reward=truncated_reward,
            outcome=outcomes.get(sample.sample_id),
        )


def check_logprobs(segments: list[SegmentRow], samples: list[Sample]) -> None:
    """Non-finite log-probs from the engine mean the weights it decoded with are unusable: the run
    stops (`PolicyDiverged`) before anything of the stage is stored."""
    for segment, sample in zip(segments, samples):
        if not np.isfinite(np.asarray(segment.logprobs, dtype=np.float64)).all():
            raise PolicyDiverged(
                f"rollout: a {sample.agent} output decoded under policy version {segment.policy_version} has "
                "non-finite log-probs, so that version's weights are unusable; the run stops and nothing of this "
                "stage was stored: look at learner.learning_rate and learner.max_weight_abs"
            )
