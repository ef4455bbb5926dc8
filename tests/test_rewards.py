"""Decoupled and shared rewards, answer checking, and counting unparsable output."""

from __future__ import annotations

import pytest

from marsrl_core.rewards import RewardTally, answers_match, judge, shared_rewards


@pytest.mark.parametrize(
    "predicted, reference, same",
    [("336^\\circ", "336", True), ("\\frac{1}{2}", "0.5", True), ("\\dfrac{3}{4}", "3/4", True),
     ("2\\sqrt{2}", "\\sqrt{8}", True), ("007", "7", True), ("5", "6", False), (None, "6", False),
     ("\\frac{1}{3}", "0.33", False)],
)
def test_answers_match(predicted, reference, same):
    assert answers_match(predicted, reference) is same


def test_decoupled_rewards_table():
    ref = "4"
    right, wrong, junk = "7+5=2;2+9=1;1+3=4;Answer: 4", "7+5=2;2+9=1;1+3=5;Answer: 5", "7+5="
    # Solver and Corrector: their own answer.
    assert [judge(a, t, reference=ref).reward for a in ("solver", "corrector") for t in (right, wrong, junk)] == \
        [1, 0, 0, 1, 0, 0]
    # Verifier: verdict against the truth of the solution it judged.
    table = [(True, "Correctness: Correct", 1), (True, "Correctness: Wrong", 0),
             (False, "Correctness: Wrong", 1), (False, "Correctness: Correct", 0), (False, "no verdict", 0)]
    for truth, text, reward in table:
        assert judge("verifier", text, reference=ref, judged_solution_correct=truth).reward == reward
    assert judge("solver", right, reference=ref, truncated=True).outcome == "truncated"
    assert judge("solver", right, reference=ref, truncated=True, truncated_reward=-1).reward == -1


def test_shared_rewards_give_every_turn_the_final_outcome():
    ok = judge("solver", "Answer: 4", reference="4")
    bad = judge("solver", "Answer: 3", reference="4")
    v = judge("verifier", "Correctness: Wrong", reference="4", judged_solution_correct=False)
    # Solver wrong, verifier right to flag it, corrector fixes it: everyone gets 1 (the final outcome).
    assert shared_rewards([("solver", bad), ("verifier", v), ("corrector", ok)]) == [1.0, 1.0, 1.0]
    # Corrector breaks it: the verifier's correct flag earns 0 under shared rewards (decoupled: 1).
    assert shared_rewards([("solver", bad), ("verifier", v), ("corrector", bad)]) == [0.0, 0.0, 0.0]
    assert v.reward == 1.0
    with pytest.raises(ValueError):
        shared_rewards([("verifier", v)])


def test_unparsable_output_is_counted_per_agent():
    tally = RewardTally()
    for agent, text in [("solver", "blah"), ("solver", "Answer: 4"), ("verifier", "hmm"), ("corrector", "")]:
        j = judge(agent, text, reference="4", judged_solution_correct=True)
        assert j.reward == 0 or j.outcome == "ok"
        tally.add(agent, j)
    assert (tally.unparsable("solver"), tally.unparsable("verifier"), tally.unparsable("corrector")) == (1, 1, 1)
