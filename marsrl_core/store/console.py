"""`marsrl sql`: the store's read-only SQL console, from any folder of the project.

- Finding the store: a relative SQLite catalog (the default `sqlite:marsrl/lake.sqlite`) is looked up in
  the current folder, then in each folder above it, as git finds `.git`; its data path is taken
  relative to the same folder. Anything else (an absolute path, Postgres) is used as given.
- The prompt has line editing and a history (`~/.marsrl_sql_history`, or `$MARSRL_SQL_HISTORY`) where
  Python's `readline` is available; each line is one statement.
- The banner lists the tables and views and example queries filtered by the newest run.
- A query's result prints as a table, or as CSV, JSON (an array of row objects) or Markdown for a pipe
  (`--format`): the process writes it to stdout; DuckDB's own COPY stays refused.

Run: `marsrl sql` (a prompt) or `marsrl sql "SELECT * FROM train_step_metrics WHERE run_id = '...'"`.
"""

from __future__ import annotations

import csv
import io
import json
import os
from datetime import date, datetime, time, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa

from marsrl_core.store.rows import StoreError
from marsrl_core.store.schema import TABLES, VIEWS

EXAMPLES = [
    "SELECT run_id, min(created_at) AS started FROM runs GROUP BY 1 ORDER BY 2 DESC",
    "SELECT step, agent, reward_mean, loss, tokens, staleness_mean FROM train_step_metrics "
    "WHERE run_id = '{run}' ORDER BY step DESC, agent LIMIT 12",
    "SELECT agent, minute, mean_reward, samples FROM rewards_per_agent WHERE run_id = '{run}' ORDER BY minute",
    "SELECT agent, avg(latency_s) AS latency_s FROM pipeline_latency WHERE run_id = '{run}' GROUP BY agent",
    "SELECT agent, turn, count(*) AS decoding, sum(tokens_so_far) AS tokens FROM in_flight_decodes "
    "WHERE run_id = '{run}' GROUP BY ALL",
    "SELECT label, metrics_json->>'solver_acc' AS solver_acc FROM evaluations WHERE run_id LIKE '{run}%'",
]


def locate(store_config: Any, start: Path | None = None) -> Any:
    """The store config with a relative SQLite catalog resolved against the nearest folder, from `start`
    (default the current one) upwards, that holds it; StoreError saying how to point at it if none does."""
    kind, _, target = store_config.catalog_url.partition(":")
    if kind != "sqlite" or Path(target).is_absolute():
        return store_config
    start = (start or Path.cwd()).resolve()
    for folder in (start, *start.parents):
        if (folder / target).is_file():
            data_path = store_config.data_path
            if "://" not in data_path and not Path(data_path).is_absolute():
                data_path = str(folder / data_path)
            return store_config.model_copy(update={"catalog_url": f"sqlite:{folder / target}", "data_path": data_path})
    raise StoreError(
        f"store.catalog_url={store_config.catalog_url!r}: no such store in {start} or any folder above it; run "
        "`marsrl sql` inside the project that trained, or point at its store with "
        "--set store.catalog_url=sqlite:/path/to/marsrl/lake.sqlite --set store.data_path=/path/to/marsrl/lake_data/"
    )


def banner(store: Any) -> str:
    """What the prompt shows first: the tables, the views, and examples for the newest run."""
    newest = store.query("SELECT run_id FROM runs ORDER BY created_at DESC LIMIT 1").to_pylist()
    run = newest[0]["run_id"] if newest else "<run id>"
    lines = [
        "MarsRL store console (read-only): one statement per line; Ctrl-D quits.",
        f"tables: {', '.join(TABLES)}",
        f"views:  {', '.join(VIEWS)}",
        f"examples (newest run {run}):",
        *[f"  {example.format(run=run)};" for example in EXAMPLES],
    ]
    return "\n".join(lines)


def history_file() -> Path:
    return Path(os.environ.get("MARSRL_SQL_HISTORY") or Path.home() / ".marsrl_sql_history")


def enable_line_editing() -> None:
    """Arrow keys, Ctrl-R and a history kept across sessions, through Python's `readline` (absent on
    some platforms: then the prompt is plain)."""
    try:
        import readline
    except ImportError:
        return
    import atexit

    path = history_file()
    try:
        readline.read_history_file(path)
    except OSError:  # a first session
        pass
    readline.set_history_length(1000)
    atexit.register(_save_history, readline, path)


def _save_history(readline: Any, path: Path) -> None:
    try:
        readline.write_history_file(path)
    except OSError:  # a read-only home: the session still worked
        pass


FORMATS = ("table", "csv", "json", "markdown")


def _plain(value: Any) -> Any:
    """A value JSON has no type for: times as ISO text, durations in seconds, decimals as numbers,
    anything else as its text."""
    if isinstance(value, (datetime, date, time)):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, Decimal):
        return float(value)
    return str(value)


def _cell(value: Any) -> str:
    """A value as one CSV or Markdown cell: lists and structs as JSON, nothing for NULL."""
    if value is None:
        return ""
    if isinstance(value, (list, dict)):
        return json.dumps(value, default=_plain)
    if isinstance(value, (str, int, float, bool)):
        return str(value)
    return str(_plain(value))


def render(table: pa.Table, fmt: str) -> str:
    """Every row of `table` as CSV (a header line first), JSON (an array of objects, a line each) or a
    Markdown table."""
    rows = table.to_pylist()
    if fmt == "json":
        return "[\n" + ",\n".join(json.dumps(row, default=_plain) for row in rows) + "\n]\n"
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(table.column_names)
        writer.writerows([_cell(v) for v in row.values()] for row in rows)
        return out.getvalue()
    if fmt == "markdown":
        lines = ["| " + " | ".join(table.column_names) + " |", "|" + "---|" * table.num_columns]
        lines += ["| " + " | ".join(_cell(v).replace("|", "\\|") for v in row.values()) + " |" for row in rows]
        return "\n".join(lines) + "\n"
    raise ValueError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
