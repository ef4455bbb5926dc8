"""The V-C loop driven by a scripted engine whose outputs the test chooses."""

from __future__ import annotations

import itertools

import pytest

from marsrl_core.agents.reasoning import run_vc_loop
from marsrl_core.agents.roles import TINY_TEMPLATES, Roles
from marsrl_core.engines.base import SamplingParams, TextGenerator
from tests.scripted import ScriptedEngine

# The tiny Corrector template shows only problem and report; this one adds the previous solution, so the
# test sees everything the loop passes to a Corrector.
ROLES = Roles.from_config({"corrector": "C|{problem}|{solution}|{report}|"}, base=TINY_TEMPLATES)
BUDGET = {"solver": 64, "verifier": 64, "corrector": 64}


def _run(script, problems=("1+2",), **kwargs):
    engine = ScriptedEngine(script)
    gen = TextGenerator(engine, engine.tokenizer, segment_tokens=5, sampling=SamplingParams(temperature=0))
    kwargs.setdefault("max_tokens", BUDGET)
    return run_vc_loop(gen, ROLES, list(problems), **kwargs), engine


def test_accepts_after_consecutive_correct_verdicts():
    def script(prompt):
        if prompt.startswith("S|"):
            return "Answer: 3"
        return "Correctness: Correct"

    [[result]], engine = _run(script, accept_after=4, max_rounds=10)
    assert result.accepted and result.rounds == 4 and result.answer == "3"
    assert result.verdicts == ["Correct"] * 4
    assert sum(c.startswith("V|") for c in engine.calls) == 4


def test_wrong_verdict_triggers_a_correction_and_resets_the_streak():
    verdicts = itertools.chain(["Correct", "Wrong"], itertools.repeat("Correct"))

    def script(prompt):
        if prompt.startswith("S|"):
            return "Answer: 9"
        if prompt.startswith("V|"):
            return f"step bad\nCorrectness: {next(verdicts)}"
        assert prompt == "C|1+2|Answer: 9|step bad|"  # problem, previous solution, bug report
        return "Answer: 3"

    [[result]], _ = _run(script, accept_after=2, max_rounds=10)
    assert result.accepted and result.answer == "3"
    assert result.verdicts == ["Correct", "Wrong", "Correct", "Correct"]
    assert [c.text for c in result.candidates] == ["Answer: 9", "Answer: 3"]


def test_round_limit_and_fallback_to_most_often_correct():
    # Solution A gets Correct, then Wrong -> B gets Wrong -> C gets Wrong... A keeps the most votes.
    verdicts = iter(["Correct", "Wrong", "Wrong", "Wrong", "Wrong"])
    fixes = iter(["Answer: 5", "Answer: 6", "Answer: 7", "Answer: 8"])

    def script(prompt):
        if prompt.startswith("S|"):
            return "Answer: 3"
        if prompt.startswith("V|"):
            return f"Correctness: {next(verdicts)}"
        return next(fixes)

    [[result]], engine = _run(script, accept_after=4, max_rounds=5)
    assert not result.accepted and result.rounds == 5
    assert result.answer == "3"
    assert sum(c.startswith("V|") for c in engine.calls) == 5
    # No correction after the last round's verdict.
    assert sum(c.startswith("C|") for c in engine.calls) == 3


def test_unparsable_verdicts_never_accept_and_workers_are_independent():
    def script(prompt):
        if prompt.startswith("S|"):
            return "Answer: 1"
        if prompt.startswith("V|"):
            return "I am not sure"
        return "Answer: 2"

    results, _ = _run(script, problems=("1+2", "4+4"), workers=3, accept_after=1, max_rounds=3)
    assert [len(r) for r in results] == [3, 3]
    assert all(not w.accepted and w.verdicts == [None] * 3 for r in results for w in r)
    assert {w.worker for w in results[1]} == {0, 1, 2}


def test_invalid_loop_settings():
    with pytest.raises(ValueError, match="accept_after=0"):
        _run(lambda p: "", accept_after=0)
