"""The three agents' prompts and the parsing of what they write.

- Prompt templates for Solver, Verifier and Corrector (Python `str.format` with `{problem}`,
  `{solution}`, `{report}`), configurable by string or file. The defaults follow the public V-C
  pipeline: the Verifier ends with a findings list and a last field `Correctness: Correct|Wrong`; the
  Corrector sees problem, previous solution and bug report, and is told the report may be wrong.
- Messages go through the tokenizer's chat template when it has one, else the text is the prompt
  (the tiny demo model has none).
- Parsing is robust to real model output: `<think>` blocks are stripped, the verdict is read from the
  last `Correctness:` field with whole words (so "incorrect" is Wrong, not Correct), the answer from the
  last balanced `\\boxed{...}` or the last `Answer:` line. No parsable verdict/answer is `None`, a
  defined outcome the reward counts, never an exception.

Deliberate simplification: one user turn per prompt (no system message, no multi-turn history).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SOLVER, VERIFIER, CORRECTOR = "solver", "verifier", "corrector"
CORRECT, WRONG = "Correct", "Wrong"

DEFAULT_TEMPLATES = {
    SOLVER: (
        "Solve the following problem. Reason step by step, then give the final answer as "
        "\\boxed{{answer}}.\n\nProblem:\n{problem}"
    ),
    VERIFIER: (
        "You are a careful verifier. Check the solution below step by step. Do not solve the problem "
        "from scratch unless needed; look for errors in each step.\n\n"
        "Problem:\n{problem}\n\nSolution:\n{solution}\n\n"
        "Write your report in this format:\n"
        "Final verdict: one sentence.\n"
        "Findings:\n- <each issue found, with the step it occurs in; 'none' if there are none>\n"
        "Correctness: Correct or Wrong"
    ),
    CORRECTOR: (
        "Below are a problem, a previous solution, and a bug report about that solution. The bug report "
        "may itself be wrong: check it before acting on it. Write a complete corrected solution and give "
        "the final answer as \\boxed{{answer}}.\n\n"
        "Problem:\n{problem}\n\nPrevious solution:\n{solution}\n\nBug report:\n{report}"
    ),
}

# Code tasks (`data.verifier=code`): the answer is a program in the output's last fenced Python block,
# checked against the task's tests in the sandbox (`agents/code.py`).
CODE_TEMPLATES = {
    SOLVER: (
        "Solve the following programming task in Python. Reason step by step, then give the complete "
        "program (imports, the requested function and any helpers) in one fenced block at the end:\n"
        "```python\n<your program>\n```\n\nTask:\n{problem}"
    ),
    VERIFIER: (
        "You are a careful code reviewer. Check the program below against the task: trace it on the "
        "task's examples and on edge cases, and look for wrong logic, unhandled inputs and errors. Do not "
        "rewrite it.\n\nTask:\n{problem}\n\nProgram:\n{solution}\n\n"
        "Write your report in this format:\n"
        "Final verdict: one sentence.\n"
        "Findings:\n- <each bug found, with the line it occurs in; 'none' if there are none>\n"
        "Correctness: Correct or Wrong"
    ),
    CORRECTOR: (
        "Below are a programming task, a previous program, and a bug report about that program. The bug "
        "report may itself be wrong: check it before acting on it. Give the complete corrected program in "
        "one fenced block at the end:\n```python\n<your program>\n```\n\n"
        "Task:\n{problem}\n\nPrevious program:\n{solution}\n\nBug report:\n{report}"
    ),
}

# Templates of the tiny demo model: short, character-level, one tag per role.
TINY_TEMPLATES = {
    SOLVER: "S|{problem}|",
    VERIFIER: "V|{problem}|{solution}|",
    CORRECTOR: "C|{problem}|{report}|",  # the report holds the steps up to the first wrong one
}


def load_template(value: str) -> str:
    """A template given inline, or `@path/to/file.txt` to read it from a file."""
    if value.startswith("@"):
        path = Path(value[1:])
        if not path.is_file():
            raise ValueError(f"template file {str(path)!r}: no such file")
        return path.read_text(encoding="utf-8")
    return value


@dataclass(frozen=True)
class Roles:
    """The prompt templates of the three agents."""

    templates: dict[str, str]

    @classmethod
    def from_config(cls, overrides: dict[str, str | None] | None = None, base: dict[str, str] | None = None) -> Roles:
        templates = dict(base or DEFAULT_TEMPLATES)
        for role, value in (overrides or {}).items():
            if value:
                templates[role] = load_template(value)
        return cls(templates)

    def prompt_text(self, role: str, problem: str, solution: str = "", report: str = "") -> str:
        if role not in self.templates:
            raise ValueError(f"role={role!r}: expected one of {sorted(self.templates)}")
        return self.templates[role].format(
            problem=problem, solution=strip_thinking(solution), report=strip_thinking(report)
        )

    def prompt(self, tokenizer: Any, role: str, problem: str, solution: str = "", report: str = "") -> str:
        """The full prompt string for `role`, through the chat template when the tokenizer has one."""
        text = self.prompt_text(role, problem, solution, report)
        if tokenizer is not None and getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        return text


_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)


def strip_thinking(text: str) -> str:
    """Drop reasoning: `<think>…</think>` blocks, a leading block whose `<think>` the chat template
    opened (only `</think>` appears), and an unclosed block (the whole text was thinking)."""
    text = _THINK_BLOCK.sub("", text)
    if "</think>" in text.lower():
        text = re.split(r"</think>", text, flags=re.IGNORECASE)[-1]
    open_at = text.lower().find("<think>")
    if open_at != -1:
        text = text[:open_at]
    return text.strip()


_FIELD = re.compile(r"correctness\W{0,3}\s*[:=\-]\s*\W{0,3}\s*(?P<value>[^\n]*)", re.IGNORECASE)
_WRONG_WORDS = re.compile(r"\b(incorrect|wrong|not\s+correct|false|invalid|no|bad)\b", re.IGNORECASE)
_RIGHT_WORDS = re.compile(r"\b(correct|right|true|valid|yes|ok)\b", re.IGNORECASE)


def _verdict_of(value: str) -> str | None:
    """`Correct` / `Wrong` for the first verdict word in a field value; negations win."""
    value = re.sub(r"[\\*_`{}$]|\\text|boxed", " ", value)
    wrong, right = _WRONG_WORDS.search(value), _RIGHT_WORDS.search(value)
    if wrong and (not right or wrong.start() <= right.start()):
        return WRONG
    if right:
        return CORRECT
    return None


def parse_verdict(text: str) -> str | None:
    """The verdict of a Verifier output: the value of its last `Correctness:` field, else None."""
    fields = list(_FIELD.finditer(strip_thinking(text)))
    for match in reversed(fields):
        verdict = _verdict_of(match.group("value"))
        if verdict is not None:
            return verdict
    return None


def parse_bug_report(text: str) -> str:
    """The bug report: everything before the last `Correctness:` field (the whole text if none)."""
    body = strip_thinking(text)
    fields = list(_FIELD.finditer(body))
    return (body[: fields[-1].start()] if fields else body).strip()


def _last_boxed(text: str) -> str | None:
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start == -1:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i].strip() or None
        i += 1
    return None  # unbalanced: the box was cut off


_ANSWER_LINE = re.compile(r"(?:final\s+)?answer\s*(?:is)?\s*[:=]\s*(?P<value>[^\n;]+)", re.IGNORECASE)


def parse_answer(text: str) -> str | None:
    """The final answer: last `\\boxed{…}`, else the last `Answer:` line (also the demo's format)."""
    body = strip_thinking(text)
    boxed = _last_boxed(body)
    if boxed is not None:
        return boxed
    lines = list(_ANSWER_LINE.finditer(body))
    if lines:
        value = lines[-1].group("value").strip().rstrip(".").strip().strip("$").strip()
        return value or None
    return None
