"""The `marsrl` command's library half: configuration, the store's SQL console, evaluation.

The Prefect half (`train`, `serve`, `rollout`, `learn`) lives in `flows/cli.py`, which adds its
commands to this parser; the console script `marsrl` is `flows.cli:main`. This module never imports
Prefect.

Every subcommand that runs a job takes the same configuration options: `--preset`, `--config FILE`
and repeated `--set dotted.key=value` overrides. Errors in user input (config, dataset, store path)
print one clear line and exit with status 2 instead of a traceback.

Deliberately plain argparse: the command is thin; the work lives in the library and the flows.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from rich.console import Console
from rich.table import Table

from marsrl_core.config import ConfigError, MarsRLConfig, config_to_yaml, load_config

console = Console()


def add_overrides_option(parser: argparse.ArgumentParser, help: str) -> None:
    """`--set KEY=VALUE` (repeatable) into `args.overrides`: the dotted config overrides of a command."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="Show Prefect's and vLLM's own INFO lines too (quiet by default)."
    )
    parser.add_argument("--preset", default="tiny", help="Preset to start from: tiny (CPU demo) or paper.")
    parser.add_argument("--config", dest="config_file", default=None, help="YAML file merged over the preset.")
    add_overrides_option(parser, "Override one field, e.g. --set rollout.segment_tokens=1024 (repeatable).")


def _config(args: argparse.Namespace) -> MarsRLConfig:
    return load_config(args.preset, args.config_file, args.overrides)


def print_table(table, title: str | None = None, max_rows: int = 200) -> None:
    """Print a pyarrow table with rich."""
    view = Table(title=title)
    for name in table.column_names:
        view.add_column(name)
    for row in table.slice(0, max_rows).to_pylist():
        view.add_row(*["" if v is None else str(v) for v in row.values()])
    console.print(view)
    if table.num_rows > max_rows:
        console.print(f"... {table.num_rows - max_rows} more rows")


# What `marsrl <command> --help` lists after its options: the settings that matter for the command, with
# their tiny-preset defaults and help, and an example (the Prefect layer's commands bring their own).
USAGE = {
    "eval": (
        ["evaluation.dataset", "evaluation.num_problems", "evaluation.k", "evaluation.max_rounds", "model.path"],
        "marsrl eval --checkpoint marsrl-1a2b3c4d --set evaluation.dataset=aime2025.jsonl --set evaluation.k=4",
    ),
    "sql": (
        ["store.catalog_url", "store.data_path"],
        'marsrl sql "SELECT step, agent, reward_mean, loss FROM train_step_metrics ORDER BY step DESC LIMIT 6"',
    ),
    "config": (
        ["model.path", "learner.max_steps"],
        "marsrl config --preset paper --set learner.max_steps=500 > run.yaml",
    ),
    "compact": (["store.catalog_url", "store.compaction_retention_minutes"], "marsrl compact --config run.yaml"),
    "check": (["store.catalog_url", "store.data_path"], "marsrl check marsrl-1a2b3c4d"),
    "timeline": (["store.catalog_url", "store.data_path"], "marsrl timeline marsrl-1a2b3c4d --out timeline.svg"),
}


def usage_epilog(cfg: MarsRLConfig, keys: list[str], example: str) -> str:
    """The settings `keys` (dotted fields of `cfg`) with their values and help, then the example."""
    import textwrap

    lines = ["settings (--set KEY=VALUE; default in the tiny preset):"]
    for key in keys:
        *path, field = key.split(".")
        section = cfg
        for part in path:
            section = getattr(section, part)
        help_text = type(section).model_fields[field].description or ""
        lines.append(f"  {key} = {getattr(section, field)}")
        lines += textwrap.wrap(help_text, 96, initial_indent="      ", subsequent_indent="      ")
    return "\n".join([*lines, "", "example:", f"  {example}"])


def cmd_config(args: argparse.Namespace) -> int:
    print(config_to_yaml(_config(args)), end="")
    return 0


def cmd_sql(args: argparse.Namespace) -> int:
    """The store's SQL console: read-only (SELECT and EXPLAIN; writes are refused with one line)."""
    import duckdb

    from marsrl_core.store import SegmentStore, StoreError
    from marsrl_core.store.console import banner, enable_line_editing, locate

    store = SegmentStore.from_config(locate(_config(args).store), create=False, read_only=True)
    if args.query:
        try:
            result = store.query(args.query)
        except duckdb.Error as err:  # a malformed query, an unknown table: one line, not a traceback
            raise StoreError(f"query: {str(err).splitlines()[0]}") from None
        _print_result(result, args.format)
        return 0
    enable_line_editing()
    console.print(banner(store), soft_wrap=True, highlight=False)
    while True:
        try:
            text = input("marsrl> ").strip().rstrip(";")
        except EOFError:
            return 0
        if not text:
            continue
        try:
            _print_result(store.query(text), args.format)
        except Exception as err:  # an interactive console reports and goes on
            console.print(f"[red]error:[/red] {str(err).splitlines()[0]}")


def _timeline_arguments(command: argparse.ArgumentParser) -> None:
    command.add_argument("run", help="The run to draw.")
    command.add_argument("--out", default=None, help="The picture to write, .png or .svg (default timeline-RUN.png).")


def _print_result(result, fmt: str) -> None:
    from marsrl_core.store.console import render

    if fmt == "table":
        print_table(result)
    else:
        sys.stdout.write(render(result, fmt))
        sys.stdout.flush()


def _sql_arguments(command: argparse.ArgumentParser) -> None:
    from marsrl_core.store.console import FORMATS

    command.add_argument("query", nargs="?", help="SQL to run; without it an interactive prompt opens.")
    command.add_argument(
        "--format",
        choices=FORMATS,
        default="table",
        help="How results print: a table (at most 200 rows shown), or every row as CSV, JSON (an array of "
        "objects) or Markdown, to pipe somewhere.",
    )


def cmd_check(args: argparse.Namespace) -> int:
    """Each exactly-once invariant of the run, one line each with its count; 1 if any count is not 0."""
    from marsrl_core.store import SegmentStore, StoreError
    from marsrl_core.store.console import locate
    from marsrl_core.store.invariants import INVARIANTS

    store = SegmentStore.from_config(locate(_config(args).store), create=False, read_only=True)
    if store.run_config(args.run) is None:
        raise StoreError(f"run {args.run!r}: no such run in the store {store.catalog_url!r}")
    counts = store.invariants(args.run)
    for name, count in counts.items():
        mark = "ok    " if count == 0 else "BROKEN"
        console.print(f"{mark} {name:<26} {count:>6}  {INVARIANTS[name][0]}", highlight=False, soft_wrap=True)
    return 1 if any(counts.values()) else 0


def cmd_timeline(args: argparse.Namespace) -> int:
    """Draw the run's timeline (`rollout/timeline.py`) from its store."""
    from pathlib import Path

    from marsrl_core.rollout.timeline import timeline_from_store, write_timeline
    from marsrl_core.store import SegmentStore, StoreError
    from marsrl_core.store.console import locate

    store = SegmentStore.from_config(locate(_config(args).store), create=False, read_only=True)
    if store.run_config(args.run) is None:
        raise StoreError(f"run {args.run!r}: no such run in the store {store.catalog_url!r}")
    timeline = timeline_from_store(store, args.run)
    if not timeline.stages:
        raise StoreError(f"run {args.run!r}: no rollout stage stored yet")
    path = write_timeline(timeline, f"timeline of run {args.run}", Path(args.out or f"timeline-{args.run}.png"))
    console.print(f"{len(timeline.stages)} stages, {len(timeline.steps)} learner steps: {path}", highlight=False)
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    """Write a dataset in MarsRL's row format."""
    from pathlib import Path

    from marsrl_core.agents.humaneval import humaneval_rows, write_rows

    count = write_rows(humaneval_rows(), Path(args.out))
    console.print(f"{count} {args.dataset} problems (code rows with their tests) -> {args.out}", highlight=False)
    return 0


def _data_arguments(command: argparse.ArgumentParser) -> None:
    command.add_argument("dataset", choices=["humaneval"], help="humaneval: HumanEval's 164 problems and tests.")
    command.add_argument("out", help="The JSON-lines file to write.")


def cmd_compact(args: argparse.Namespace) -> int:
    from marsrl_core.store import SegmentStore
    from marsrl_core.store.console import locate

    store_config = locate(_config(args).store)
    store = SegmentStore.from_config(store_config, create=False)
    result = store.compact(retention_s=60 * store_config.compaction_retention_minutes)
    console.print(f"data files: {result['files_before']} -> {result['files_after']}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import uuid

    from marsrl_core.runtime.context import runtime
    from marsrl_core.runtime.evaluate import evaluate_policy, resolve_checkpoint
    from marsrl_core.runtime.progress import BarProgress, LogProgress
    from marsrl_core.runtime.report import print_report
    from marsrl_core.store import SegmentStore

    cfg = _config(args)
    store = SegmentStore.from_config(cfg.store)
    folder, name = resolve_checkpoint(cfg, store, args.checkpoint)
    console.print(f"evaluating {name}", soft_wrap=True, highlight=False)
    run_id = f"{cfg.run_name}-eval-{uuid.uuid4().hex[:8]}"
    store.create_run(run_id, cfg.model_dump(mode="json"))
    try:
        if console.is_terminal:
            with BarProgress(console) as progress:
                report = evaluate_policy(cfg, store, run_id, "eval", folder=folder, progress=progress)
        else:  # a pipe or a file: a line per phase, and one every 15 s while it decodes
            progress = LogProgress(lambda line: console.print(line, highlight=False, soft_wrap=True))
            report = evaluate_policy(cfg, store, run_id, "eval", folder=folder, progress=progress)
    finally:
        runtime().end_checker(run_id)
    print_report(console, {"eval": report})
    console.print(f"recorded as run {run_id} (table evaluations)")
    return 0


def build_parser(extra_commands: dict | None = None) -> tuple[argparse.ArgumentParser, dict]:
    """The parser with the library's commands plus `extra_commands` (name -> (handler, help, setup)).

    The Prefect layer (`flows/cli.py`) adds its commands here, so this module never imports it."""
    parser = argparse.ArgumentParser(
        prog="marsrl",
        description="MarsRL: multi-agent reasoning RL (Solver, Verifier, Corrector) with segment rollouts.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {
        "eval": (cmd_eval, "Evaluate Solver, Verifier, Corrector and the V-C loop (set evaluation.dataset=FILE)."),
        "config": (cmd_config, "Print the resolved configuration as YAML."),
        "sql": (cmd_sql, "Query a run's store with SQL (works while a run is writing)."),
        "compact": (cmd_compact, "DuckLake maintenance: merge small files, expire snapshots."),
        "check": (cmd_check, "Check a run's exactly-once invariants in the store; exit 1 if any is broken."),
        "timeline": (cmd_timeline, "Draw a run's timeline: what each agent decoded when, and the learner's steps."),
        "data": (cmd_data, "Write a dataset in MarsRL's row format (humaneval: code rows with their tests)."),
    }
    setups = {
        "sql": _sql_arguments,
        "check": lambda c: c.add_argument("run", help="The run whose store invariants to check."),
        "timeline": _timeline_arguments,
        "data": _data_arguments,
        "eval": lambda c: c.add_argument(
            "--checkpoint",
            default=None,
            metavar="RUN[:VERSION]|FOLDER",
            help="The policy to evaluate: a run's newest committed version, one version of it, or a model or "
            "checkpoint folder (default: the newest version of the store's most recent run, else the starting "
            "policy, the warm start for the tiny preset). The command says which it evaluated.",
        ),
    }
    usage, tiny = dict(USAGE), load_config("tiny")
    for name, (handler, help_text, setup, *extra_usage) in (extra_commands or {}).items():
        commands[name] = (handler, help_text)
        setups[name] = setup
        if extra_usage:
            usage[name] = extra_usage[0]
    for name, (handler, help_text) in sorted(commands.items()):
        command = sub.add_parser(
            name,
            help=help_text,
            description=help_text,
            epilog=usage_epilog(tiny, *usage[name]) if name in usage else None,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _add_config_options(command)
        command.set_defaults(handler=handler)
        if setups.get(name):
            setups[name](command)
    return parser, commands


def set_engine_verbosity(verbose: bool) -> None:
    """vLLM's start-up and MLflow's database INFO lines only with `-v` (a user's own level stays)."""
    import logging
    import os

    level = "INFO" if verbose else "WARNING"
    for variable, logger in (("VLLM_LOGGING_LEVEL", "vllm"), ("MLFLOW_LOGGING_LEVEL", "mlflow")):
        if os.environ.get(variable) in (None, "INFO", "WARNING"):
            os.environ[variable] = level  # read when the library is imported, here and in its child processes
            logging.getLogger(logger).setLevel(level)  # where this process has imported it already


def offline_and_quiet() -> None:
    """For this process and its children (store child, learner ranks, vLLM workers): nothing is ever
    downloaded from a model hub, and transformers' own warnings and progress bars stay off. Set before
    those libraries are imported (they read the variables then); a variable the user set is kept."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def main(argv: Sequence[str] | None = None, extra_commands: dict | None = None, before: Callable | None = None) -> int:
    """Run one command; `before(args)` runs first (the Prefect layer sets its logging there)."""
    offline_and_quiet()
    from marsrl_core.agents.problems import DatasetError
    from marsrl_core.engines.base import EngineError
    from marsrl_core.learn.checkpoint_folders import CheckpointError
    from marsrl_core.store import StoreError

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(extra_commands)[0].parse_args(argv)
    args.argv = argv  # a command that re-runs itself under a launcher (`learn --nproc`) passes them on
    set_engine_verbosity(args.verbose)
    if before is not None:
        before(args)
    try:
        return args.handler(args)
    except (ConfigError, StoreError, DatasetError, EngineError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
