"""Parsing real-looking agent outputs, and prompt building."""

from __future__ import annotations

import pytest

from marsrl_core.agents.roles import (
    CORRECT,
    TINY_TEMPLATES,
    VERIFIER,
    WRONG,
    Roles,
    parse_answer,
    parse_bug_report,
    parse_verdict,
    strip_thinking,
)
from marsrl_core.demo.tiny import build_tiny_tokenizer


@pytest.mark.parametrize(
    "text, verdict",
    [
        ("Findings:\n- none\nCorrectness: Correct", CORRECT),
        ("Findings:\n- step 2 is off\nCorrectness: Wrong", WRONG),
        ("The solution is incorrect.\nCorrectness: Incorrect", WRONG),  # naive 'correct' in text would say Correct
        ("**Correctness**: **Correct**", CORRECT),
        ("Correctness: not correct, the sum is wrong", WRONG),
        ("Correctness: $\\boxed{\\text{Wrong}}$", WRONG),
        ("Correctness: Correct (no errors found)", CORRECT),
        ("correctness - wrong", WRONG),
        ("Correctness: Correct\n...on reflection...\nCorrectness: Wrong", WRONG),  # the last field counts
        ("<think>Correctness: Wrong</think>Correctness: Correct", CORRECT),  # reasoning is not the verdict
        ("The solution looks correct to me.", None),  # no field: undefined, not a guess
        ("Correctness: maybe", None),
        ("", None),
    ],
)
def test_verdicts(text, verdict):
    assert parse_verdict(text) == verdict


@pytest.mark.parametrize(
    "text, answer",
    [
        ("so the total is \\boxed{204}.", "204"),
        ("first \\boxed{3} then, fixing it, \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("nested \\boxed{\\frac{a+b\\sqrt{c}}{d}} done", "\\frac{a+b\\sqrt{c}}{d}"),
        ("angle \\boxed{336^\\circ}", "336^\\circ"),
        ("<think>maybe \\boxed{7}</think>The answer is \\boxed{8}", "8"),
        ("3+5=8;8+9=7;7+4=1;Answer: 1", "1"),
        ("Final answer: $42$.", "42"),
        ("cut off \\boxed{12", None),
        ("<think>I think it is \\boxed{5} but", None),  # unfinished thinking only
        ("no answer here", None),
    ],
)
def test_answers(text, answer):
    assert parse_answer(text) == answer


def test_bug_report_is_text_before_the_verdict():
    text = "<think>hmm</think>Final verdict: step 2 is wrong.\nFindings:\n- 8+9=7 ok\nCorrectness: Wrong"
    assert parse_bug_report(text) == "Final verdict: step 2 is wrong.\nFindings:\n- 8+9=7 ok"


def test_strip_thinking_variants():
    assert strip_thinking("<think>a</think> b") == "b"
    assert strip_thinking("reasoning without opening tag</think>\nfinal") == "final"
    assert strip_thinking("<think>never closed") == ""


def test_prompts_plain_and_chat_template(tmp_path):
    roles = Roles.from_config(base=TINY_TEMPLATES)
    tok = build_tiny_tokenizer()
    assert roles.prompt(tok, VERIFIER, "1+2", "<think>x</think>1+2=3;Answer: 3") == "V|1+2|1+2=3;Answer: 3|"
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    assert roles.prompt(tok, "solver", "1+2") == "<user>S|1+2|<assistant>"
    custom = tmp_path / "solver.txt"
    custom.write_text("Q:{problem}")
    assert Roles.from_config({"solver": f"@{custom}"}).prompt_text("solver", "7") == "Q:7"
    with pytest.raises(ValueError, match="no such file"):
        Roles.from_config({"solver": "@/nope.txt"})
    default = Roles.from_config()
    assert "Correctness: Correct or Wrong" in default.prompt_text(VERIFIER, "p", "s")
    assert "may itself be wrong" in default.prompt_text("corrector", "p", "s", "r")
