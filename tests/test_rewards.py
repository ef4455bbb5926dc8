"""Decoupled and shared rewards and answer checking."""

from __future__ import annotations

import pytest

from marsrl_core.agents.rewards import answers_match, judge


@pytest.mark.parametrize(
    "predicted, reference, same",
    [
        ("336^\\circ", "336", True),
        ("\\frac{1}{2}", "0.5", True),
        ("\\dfrac{3}{4}", "3/4", True),
        ("2\\sqrt{2}", "\\sqrt{8}", True),
        ("007", "7", True),
        ("5", "6", False),
        (None, "6", False),
        ("\\frac{1}{3}", "0.33", False),
    ],
)
def test_answers_match(predicted, reference, same):
    assert answers_match(predicted, reference) is same


def test_decoupled_rewards_table():
    ref = "4"
    right, wrong, junk = "7+5=2;2+9=1;1+3=4;Answer: 4", "7+5=2;2+9=1;1+3=5;Answer: 5", "7+5="
    # Solver and Corrector: their own answer.
    assert [judge(a, t, problem=ref).reward for a in ("solver", "corrector") for t in (right, wrong, junk)] == [
        1,
        0,
        0,
        1,
        0,
        0,
    ]
    # Verifier: verdict against the truth of the solution it judged.
    table = [
        (True, "Correctness: Correct", 1),
        (True, "Correctness: Wrong", 0),
        (False, "Correctness: Wrong", 1),
        (False, "Correctness: Correct", 0),
        (False, "no verdict", 0),
    ]
    for truth, text, reward in table:
        assert judge("verifier", text, problem=ref, judged_solution_correct=truth).reward == reward
    assert judge("solver", right, problem=ref, truncated=True).outcome == "truncated"
    assert judge("solver", right, problem=ref, truncated=True, truncated_reward=-1).reward == -1


def test_shared_reward_gives_every_turn_the_final_outcome_of_its_trajectories():
    from marsrl_core.agents.problems import Problem
    from marsrl_core.rollout.samples import Sample, shared_outcome

    problem = Problem("p", "1+3", "4", "test")

    def sample(agent, turn, parent, text):
        s = Sample(f"{agent}-{turn}-{text}", problem, agent, turn, "g", [], 8, parent)
        s.judgement = judge(
            agent,
            text,
            problem=problem,
            judged_solution_correct=None if agent != "verifier" else parent.solution.judgement.correct,
        )
        if parent is not None:
            parent.children.append(s)
        return s

    solver = sample("solver", 0, None, "Answer: 3")
    flag = sample("verifier", 1, solver, "Correctness: Wrong")
    fixed = sample("corrector", 2, flag, "Answer: 4")
    broken = sample("corrector", 2, flag, "Answer: 5")
    # One trajectory fixed, one broken: the turns they share get the mean outcome; each Corrector its own.
    assert [shared_outcome(s) for s in (solver, flag, fixed, broken)] == [0.5, 0.5, 1.0, 0.0]
    assert flag.judgement.reward == 1.0  # decoupled: the Verifier was right to flag the solution
    lone = sample("solver", 0, None, "Answer: 4")  # a trajectory that ends at the Solver
    assert shared_outcome(lone) == 1.0
