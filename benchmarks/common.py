"""Helpers shared by the benchmark scripts: the results folder and a printed table."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).with_name("results")


def write_results(name: str, figures: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(figures, indent=2))
    return path


def print_rows(title: str, header: list[str], rows: list[list[object]]) -> None:
    table = Table(title=title)
    for name in header:
        table.add_column(name)
    for row in rows:
        table.add_row(*[f"{v:,.3f}" if isinstance(v, float) else str(v) for v in row])
    Console().print(table)
