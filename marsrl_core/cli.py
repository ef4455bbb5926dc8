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
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from marsrl_core.config import ConfigError, MarsRLConfig, config_to_yaml, load_config

console = Console()


def add_overrides_option(parser: argparse.ArgumentParser, help: str) -> None:
    """`--set KEY=VALUE` (repeatable) into `args.overrides`: the dotted config overrides of a command."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)


def _add_config_options(parser: argparse.ArgumentParser) -> None:
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


def cmd_config(args: argparse.Namespace) -> int:
    print(config_to_yaml(_config(args)), end="")
    return 0


def cmd_sql(args: argparse.Namespace) -> int:
    """The store's SQL console: read-only (SELECT and EXPLAIN; writes are refused with one line)."""
    import duckdb

    from marsrl_core.store import SegmentStore, StoreError

    cfg = _config(args)
    store = SegmentStore.from_config(cfg.store, create=False, read_only=True)
    if args.query:
        try:
            print_table(store.query(args.query))
        except duckdb.Error as err:  # a malformed query, an unknown table: one line, not a traceback
            raise StoreError(f"query: {str(err).splitlines()[0]}") from None
        return 0
    console.print(
        "MarsRL store console: tables runs, problems, samples, segments, rewards, consumptions, "
        "policy_versions, train_steps, rejected_inputs; views rewards_per_agent, pipeline_latency, "
        "staleness, in_flight_decodes. End with Ctrl-D."
    )
    while True:
        try:
            text = input("marsrl> ").strip()
        except EOFError:
            return 0
        if not text:
            continue
        try:
            print_table(store.query(text))
        except Exception as err:  # an interactive console reports and goes on
            console.print(f"[red]error:[/red] {str(err).splitlines()[0]}")


def cmd_compact(args: argparse.Namespace) -> int:
    from marsrl_core.store import SegmentStore

    store_config = _config(args).store
    store = SegmentStore.from_config(store_config, create=False)
    result = store.compact(retention_s=60 * store_config.compaction_retention_minutes)
    console.print(f"data files: {result['files_before']} -> {result['files_after']}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import uuid

    from marsrl_core.runtime.evaluate import evaluate_policy, resolve_checkpoint
    from marsrl_core.runtime.report import print_report
    from marsrl_core.store import SegmentStore

    cfg = _config(args)
    store = SegmentStore.from_config(cfg.store)
    folder, name = resolve_checkpoint(cfg, store, args.checkpoint)
    console.print(f"evaluating {name}", soft_wrap=True, highlight=False)
    run_id = f"{cfg.run_name}-eval-{uuid.uuid4().hex[:8]}"
    store.create_run(run_id, cfg.model_dump(mode="json"))
    with console.status("evaluating"):
        report = evaluate_policy(cfg, store, run_id, "eval", folder=folder)
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
    }
    setups = {
        "sql": lambda c: c.add_argument("query", nargs="?", help="SQL to run; without it an interactive prompt opens."),
        "eval": lambda c: c.add_argument(
            "--checkpoint",
            default=None,
            metavar="RUN[:VERSION]|FOLDER",
            help="The policy to evaluate: a run's newest committed version, one version of it, or a model or "
            "checkpoint folder (default: the newest version of the store's most recent run, else the starting "
            "policy, the warm start for the tiny preset). The command says which it evaluated.",
        ),
    }
    for name, (handler, help_text, setup) in (extra_commands or {}).items():
        commands[name] = (handler, help_text)
        setups[name] = setup
    for name, (handler, help_text) in sorted(commands.items()):
        command = sub.add_parser(name, help=help_text, description=help_text)
        _add_config_options(command)
        command.set_defaults(handler=handler)
        if setups.get(name):
            setups[name](command)
    return parser, commands


def main(argv: Sequence[str] | None = None, extra_commands: dict | None = None) -> int:
    from marsrl_core.agents.problems import DatasetError
    from marsrl_core.engines.base import EngineError
    from marsrl_core.learn.checkpoint import CheckpointError
    from marsrl_core.store import StoreError

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(extra_commands)[0].parse_args(argv)
    args.argv = argv  # a command that re-runs itself under a launcher (`learn --nproc`) passes them on
    try:
        return args.handler(args)
    except (ConfigError, StoreError, DatasetError, EngineError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
