"""Problems: loading benchmark/training datasets, with bad rows rejected and reported.

Formats: JSON lines (`.jsonl`, `.json` with one object per line), Parquet (`.parquet`), and a folder
written by Hugging Face `datasets.save_to_disk` (its `.arrow` files are read with pyarrow, so the
`datasets` package is not needed). Field names are configurable; MarsRL's format (`query`,
`ans_box`, `qid`, `source`) is the default.

A code row (`verifier: "code"`, or every row with `verifier="code"`) carries its tests instead of
an answer: a test program with the function it checks, or input/output cases (`code_tests`).

A bad row never stops a load: invalid JSON, non-UTF-8 bytes, text that is not valid Unicode (a lone
surrogate such as `"\ud800"`, which is valid JSON) or holds a NUL character, a missing or empty
question or answer, a question or answer that is not text or a number (a list, an object, a bool), a
problem id seen earlier in the file (the first row with it is kept), a prompt longer than the model's
input limit. It becomes a `Rejection` with file and line number, the caller records it in the
store's `rejected_inputs`, and the good rows load. A dataset with no good row at all is an error
(`DatasetError`), as is a missing or unreadable file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from marsrl_core.agents.code import CodeTests
from marsrl_core.store.rows import Rejection


class DatasetError(ValueError):
    """A dataset cannot be used at all; the message names the file and the problem."""


@dataclass(frozen=True)
class Problem:
    """A task: its prompt, its reference `answer` (a math problem's; a code problem's reference
    solution, or ""), and how an output is checked (`verifier`: "math" or "code", whose `tests` it
    carries: `agents.outcomes`)."""

    problem_id: str
    prompt: str
    answer: str
    source: str = ""
    verifier: str = "math"
    tests: CodeTests | None = None


@dataclass
class LoadedProblems:
    problems: list[Problem] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)


def _rows(path: Path) -> list[tuple[str, Any]]:
    """(location, parsed row or Rejection reason) for every row of the file."""
    if path.is_dir():
        tables = []
        for arrow_file in sorted(path.glob("*.arrow")):
            with pa.memory_map(str(arrow_file)) as source:
                try:
                    tables.append(pa.ipc.open_stream(source).read_all())
                except pa.ArrowInvalid:
                    tables.append(pa.ipc.open_file(source).read_all())
        if not tables:
            raise DatasetError(f"dataset {str(path)!r}: folder holds no .arrow files (expected datasets.save_to_disk)")
        return [(f"row {i + 1}", row) for i, row in enumerate(pa.concat_tables(tables).to_pylist())]
    if path.suffix == ".parquet":
        try:
            table = pq.read_table(path)
        except (pa.ArrowInvalid, OSError) as err:
            raise DatasetError(f"dataset {str(path)!r}: not a readable Parquet file ({err})") from None
        return [(f"row {i + 1}", row) for i, row in enumerate(table.to_pylist())]
    rows: list[tuple[str, Any]] = []
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        location = f"line {number}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            rows.append((location, ValueError(f"not UTF-8 ({err.reason} at byte {err.start})")))
            continue
        if not text.strip():
            continue
        try:
            rows.append((location, json.loads(text)))
        except json.JSONDecodeError as err:
            rows.append((location, ValueError(f"invalid JSON ({err.msg})")))
    return rows


def _text_problem(fields: tuple[tuple[str, str], ...]) -> str | None:
    """Why one of these texts cannot be stored or tokenized (a NUL, a lone surrogate), or None."""
    for name, text in fields:
        if "\x00" in text:
            return f"{name!r} holds a NUL character"
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            return f"{name!r} is not valid Unicode ({err.reason} at character {err.start})"
    return None


def code_tests(row: dict[str, Any]) -> CodeTests | str:
    """A code row's tests: `tests` (a program defining `check(candidate)`) with `entry_point`, or
    `cases` (a list of {"input": ..., "output": ...}), and an optional `time_limit_s` per test run; or
    why the row has none usable (a rejection's reason)."""
    test, entry, cases = row.get("tests"), row.get("entry_point"), row.get("cases")
    limit = row.get("time_limit_s", 10.0)
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 < limit <= 600:
        return f"'time_limit_s' must be a number of seconds in (0, 600], got {limit!r}"
    if test is not None:
        if not isinstance(test, str) or not test.strip():
            return "'tests' must be a non-empty test program (text)"
        if not isinstance(entry, str) or not entry.isidentifier():
            return "'tests' needs 'entry_point': the name of the function it checks"
        return CodeTests(test=test, entry_point=entry, time_limit_s=float(limit))
    if cases is not None:
        good = (
            isinstance(cases, list)
            and cases
            and all(
                isinstance(c, dict) and isinstance(c.get("input"), str) and isinstance(c.get("output"), str)
                for c in cases
            )
        )
        if not good:
            return '\'cases\' must be a non-empty list of {"input": text, "output": text}'
        return CodeTests(cases=tuple((c["input"], c["output"]) for c in cases), time_limit_s=float(limit))
    return "a code row needs 'tests' (with 'entry_point') or 'cases'"


def load_problems(
    path: str | Path,
    *,
    question_field: str = "query",
    answer_field: str = "ans_box",
    id_field: str = "qid",
    count_tokens: Callable[[str], int] | None = None,
    max_prompt_tokens: int | None = None,
    verifier: str = "math",
) -> LoadedProblems:
    """Load a dataset; bad rows are returned as rejections, good rows as problems. A row's `verifier`
    field ("math" or "code") says how its outputs are checked, `verifier` when it has none; a code
    row carries its tests (`code_tests`) and may leave the answer out."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset {str(path)!r}: no such file")
    result = LoadedProblems()
    first_seen: dict[str, str] = {}  # problem id -> location of its first row
    for location, row in _rows(path):

        def reject(reason: str, location: str = location, row: Any = row) -> None:
            payload = str(row)[:500].encode("utf-8", "backslashreplace").decode("utf-8")  # storable as text
            result.rejected.append(Rejection(str(path), location, reason, payload))

        if isinstance(row, Exception):
            reject(str(row))
            continue
        if not isinstance(row, dict):
            reject(f"expected an object, got {type(row).__name__}")
            continue
        row_verifier = row.get("verifier", verifier)
        if row_verifier not in ("math", "code"):
            reject(f"verifier={row_verifier!r}: expected 'math' or 'code'")
            continue
        tests = None
        if row_verifier == "code":
            tests = code_tests(row)
            if isinstance(tests, str):
                reject(tests)
                continue
        question, answer = row.get(question_field), row.get(answer_field, "" if tests else None)
        if question is None or answer is None:
            missing = [name for name, value in ((question_field, question), (answer_field, answer)) if value is None]
            reject(f"missing field(s) {', '.join(repr(m) for m in missing)}")
            continue
        kinds = [
            (name, type(value).__name__)
            for name, value in ((question_field, question), (answer_field, answer))
            if isinstance(value, bool) or not isinstance(value, (str, int, float))
        ]
        if kinds:
            reject("; ".join(f"{name!r} must be text or a number, got {kind}" for name, kind in kinds))
            continue
        question, answer = str(question).strip(), str(answer).strip()
        if not question or (not answer and tests is None):
            reject(f"empty {question_field!r}" if not question else f"empty {answer_field!r}")
            continue
        if problem := _text_problem(((question_field, question), (answer_field, answer))):
            reject(problem)
            continue
        if count_tokens is not None and max_prompt_tokens is not None:
            length = count_tokens(question)
            if length > max_prompt_tokens:
                reject(f"prompt has {length} tokens, over the input limit of {max_prompt_tokens}")
                continue
        problem_id = str(row.get(id_field, location.split()[-1]))
        if problem_id in first_seen:
            reject(f"duplicate problem id {problem_id!r} (first at {first_seen[problem_id]})")
            continue
        first_seen[problem_id] = location
        source = str(row.get("source", path.stem))
        result.problems.append(Problem(problem_id, question, answer, source, row_verifier, tests))
    if not result.problems:
        reasons = "; ".join(f"{r.location}: {r.reason}" for r in result.rejected[:3])
        raise DatasetError(f"dataset {str(path)!r}: no usable problems" + (f" ({reasons})" if reasons else " (empty)"))
    return result
