"""The `marsrl` console command: the library's commands plus the Prefect ones.

- `marsrl train`: the main job (`make train`): the train flow (rollout and learner flows
  concurrently, evaluation before and after), then the before/after table. `--resume RUN`
  continues a killed run; the figures go to benchmarks/results/train.json.
- `marsrl sft`: the SFT warm start alone (the train flow runs it first when `sft.enabled`).
- `marsrl ablate [variants]`: the ablations, each a train run from the same seed and budgets.
- `marsrl rollout --run-id R --batches 0 1 ...`: rollout flows only (one process of a split run).
- `marsrl learn --run-id R`: the learner flow only (the other process of a split run).
- `marsrl serve`: serve every deployment (schedules included) for the Prefect UI.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from marsrl_core import cli as core_cli
from marsrl_core.config import ConfigError, absolute_paths
from marsrl_core.runtime.report import print_report, train_summary


def cmd_train(args: argparse.Namespace) -> int:
    from flows.server import local_server
    from flows.train import train_flow
    from marsrl_core.runtime import work
    from marsrl_core.runtime.context import runtime

    cfg = core_cli._config(args)
    if args.resume:
        cfg = work.resumed_config(cfg, args.resume)  # the stored config, so the run continues as it began
        core_cli.console.print(f"resuming run [bold]{args.resume}[/bold]")
    cfg = absolute_paths(cfg)  # as the flows record them: a learner built here writes the same checkpoint URIs
    work.check_inputs(cfg)  # one line and exit 2 on a bad dataset, before Prefect starts
    if args.resume and cfg.learner.nproc == 1 and runtime().store(cfg).latest_version(args.resume) is not None:
        # its last checkpoint is loaded now, before Prefect starts: a bad one is one line, not a flow's traceback
        runtime().learner(cfg, args.resume)
    elif (args.resume or args.run_id) and cfg.learner.nproc == 1:  # one learner per run: refused here if it has one
        runtime().lease(cfg, args.resume or args.run_id)
    start = time.perf_counter()
    with local_server():
        result = train_flow(cfg, args.resume or args.run_id)
    reports = {label: result[label] for label in ("before", "after") if label in result}
    finished = result.get("already_finished", False)
    if finished:
        core_cli.console.print(f"run [bold]{result['run_id']}[/bold] had finished: nothing left to decode or train")
    core_cli.console.print(f"run [bold]{result['run_id']}[/bold]: {result['learner_steps']} learner steps")
    if reports:
        print_report(core_cli.console, reports)
    # A finished run's figures are its stored evaluations; this command trained nothing, so no wall clock.
    summary = train_summary(result, cfg.seed, math.nan if finished else time.perf_counter() - start)
    if args.results:  # written whenever the report is printed, a finished run's too
        _write_json(Path(args.results), summary)
        core_cli.console.print(f"figures written to {args.results}")
    return 0


# The ablations of `marsrl ablate`: each changes one thing from MarsRL as configured.
ABLATIONS = {
    "marsrl": [],
    "shared_reward": ["rollout.reward_mode=shared"],
    "synchronous": ["rollout.synchronous=true"],
    "random_selection": ["rollout.selection=random"],
    "per_agent_policies": ["learner.policies=per_agent"],
}


def cmd_ablate(args: argparse.Namespace) -> int:
    from flows.server import local_server
    from flows.sft import sft_flow
    from flows.train import train_flow
    from marsrl_core.config import load_config
    from marsrl_core.runtime.report import print_spread, spread

    names = args.variants or list(ABLATIONS)
    unknown = [name for name in names if name not in ABLATIONS]
    if unknown:
        raise ConfigError(f"ablation {unknown[0]!r}: unknown; choose from {sorted(ABLATIONS)}")
    if args.seeds < 1:
        raise ConfigError(f"--seeds {args.seeds}: at least 1")
    base = load_config(args.preset, args.config_file, args.overrides)
    overrides, first_seed = list(args.overrides), base.seed
    if base.sft.enabled and base.model.path is None:  # one warm start (the first seed's) for every variant and seed
        with local_server():
            folder = sft_flow(base)
        overrides += [f"model.path={folder}", "sft.enabled=false"]
    results = Path(args.results)
    figures: dict[str, dict] = json.loads(results.read_text()) if results.is_file() else {}
    for name in names:
        runs = []
        for seed in range(first_seed, first_seed + args.seeds):
            run_name = f"ablate-{name}" + (f"-seed{seed}" if args.seeds > 1 else "")
            extra = [*ABLATIONS[name], f"seed={seed}", f"run_name={run_name}"]
            cfg = load_config(args.preset, args.config_file, [*overrides, *extra])
            core_cli.console.rule(f"ablation: {name}, seed {seed}")
            start = time.perf_counter()
            with local_server():
                result = train_flow(cfg)
            runs.append(train_summary(result, cfg.seed, time.perf_counter() - start))
        figures[name] = spread(runs)
        _write_json(results, figures)  # after every variant: a long ablation keeps what it measured
    print_spread(core_cli.console, {name: figures[name] for name in names})
    core_cli.console.print(f"figures written to {args.results}")
    return 0


def _write_json(path: Path, figures: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=2))


def cmd_sft(args: argparse.Namespace) -> int:
    from flows.server import local_server
    from flows.sft import sft_flow

    with local_server():
        core_cli.console.print(f"warm start: {sft_flow(core_cli._config(args))}")
    return 0


def cmd_rollout(args: argparse.Namespace) -> int:
    from flows.rollout import rollouts_flow
    from flows.server import local_server
    from marsrl_core.runtime import events
    from marsrl_core.runtime.context import runtime

    cfg = core_cli._config(args)
    with local_server():
        rollouts_flow(cfg, args.run_id, args.batches or None, finish=args.finish)
    store = runtime().store(cfg)
    store.mark(args.run_id, events.STORE_LOCK_RETRIES, f"rollout:{store.lock_retries}")
    return 0


def cmd_learn(args: argparse.Namespace) -> int:
    from flows.learner import learner_flow
    from flows.server import local_server
    from marsrl_core.learn.distributed import init_ranks, shutdown
    from marsrl_core.policy import policy_folder
    from marsrl_core.runtime import events, work
    from marsrl_core.runtime.context import runtime

    cfg = absolute_paths(core_cli._config(args))  # as the learner flow records them
    nproc = args.nproc or cfg.learner.nproc
    if nproc > 1 and "WORLD_SIZE" not in os.environ:  # the same command on N ranks, started by torchrun
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
        argv = [a for i, a in enumerate(args.argv) if not _is_nproc(args.argv, i)]  # each rank is one process
        return subprocess.call([*launcher, "-m", "flows.cli", *argv])
    # The starting policy first: once torch.distributed is up, transformers writes model files on rank 0 only.
    folder = policy_folder(cfg)
    ranks = init_ranks(cfg.learner.collective_timeout_s)  # None in one process
    if ranks is not None and not ranks.main:  # it trains its share of each step rank 0 starts
        work.follow_learner(cfg, args.run_id, folder, ranks)
        shutdown()
        return 0
    # Built before Prefect starts (under the run's one-learner lease, from its last checkpoint): a second
    # learner of the run or a bad checkpoint is one line, not a flow's traceback.
    learner = runtime().learner(cfg, args.run_id)
    try:
        with local_server():
            steps = learner_flow(cfg, args.run_id, args.max_steps, idle_timeout_s=args.idle_timeout)
    except BaseException as err:
        runtime().end_tracker(args.run_id, "FAILED" if isinstance(err, Exception) else "KILLED")
        raise
    learner.stop_followers()
    shutdown()
    runtime().end_tracker(args.run_id, "FINISHED")
    store = runtime().store(cfg)
    store.mark(args.run_id, events.STORE_LOCK_RETRIES, f"learner:{store.lock_retries}")
    core_cli.console.print(f"learner stopped after step {steps}")
    return 0


def _is_nproc(argv: list[str], i: int) -> bool:
    return argv[i] == "--nproc" or argv[i].startswith("--nproc=") or (i > 0 and argv[i - 1] == "--nproc")


def cmd_serve(args: argparse.Namespace) -> int:
    from deployments.serve import serve_all

    serve_all(core_cli._config(args), train_cron=args.cron or None, limit=args.limit)
    return 0


def _run_id(required: bool):
    def setup(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--run-id", required=required, default=None, help="The training run (store and MLflow).")

    return setup


def _train_setup(parser: argparse.ArgumentParser) -> None:
    _run_id(False)(parser)
    parser.add_argument(
        "--resume",
        metavar="RUN",
        default=None,
        help="Continue a killed run with its stored config (the store located by --config/--set).",
    )
    parser.add_argument(
        "--results",
        default="benchmarks/results/train.json",
        help="Where to write the run's figures as JSON ('' for nowhere).",
    )


def _ablate_setup(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("variants", nargs="*", help=f"Ablations to run (default all): {', '.join(ABLATIONS)}.")
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="Runs per variant, seeds seed..seed+N-1 (the config's seed first); the table and ablations.json give "
        "each measure's mean and sd over them (sd needs 2 or more).",
    )
    parser.add_argument(
        "--results",
        default="benchmarks/results/ablations.json",
        help="Where to write the figures: each variant run replaces its entry; the file's other variants stay.",
    )


def _rollout_setup(parser: argparse.ArgumentParser) -> None:
    _run_id(True)(parser)
    parser.add_argument("--batches", type=int, nargs="*", help="Batch indices (default: all of data.num_batches).")
    parser.add_argument("--finish", action="store_true", help="Mark the rollouts finished afterwards.")


def _learn_setup(parser: argparse.ArgumentParser) -> None:
    _run_id(True)(parser)
    parser.add_argument("--max-steps", type=int, default=None, help="Step budget (default learner.max_steps).")
    parser.add_argument("--idle-timeout", type=float, default=3600.0, help="Stop after this long without groups.")
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="Learner ranks on this machine, default learner.nproc (started with torch.distributed.run; data "
        "parallel, or FSDP2 with learner.fsdp=true). Several machines: on each, `accelerate launch "
        "--config_file deployments/accelerate/two-nodes.yaml -m flows.cli learn ...`.",
    )


def _serve_setup(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cron", default="0 2 * * *", help="Schedule of the train deployment ('' for none).")
    parser.add_argument("--limit", type=int, default=None, help="Most flow runs at once.")


COMMANDS = {  # name: (handler, help, argument setup, (settings listed by --help, an example))
    "train": (
        cmd_train,
        "Run the main job: MarsRL training with evaluation before and after (make train).",
        _train_setup,
        (
            [
                "learner.max_steps",
                "data.num_batches",
                "data.train_dataset",
                "model.path",
                "engine.name",
                "model.device",
            ],
            "marsrl train --set learner.max_steps=100 --set data.train_dataset=problems.jsonl",
        ),
    ),
    "ablate": (
        cmd_ablate,
        "Train each ablation (same seed and budgets) and compare: shared reward, synchronous, "
        "random selection, per-agent policies.",
        _ablate_setup,
        (["seed", "learner.max_steps", "evaluation.num_problems"], "marsrl ablate marsrl synchronous --seeds 3"),
    ),
    "sft": (
        cmd_sft,
        "Warm-start the policy with SFT on synthetic demonstrations (cached by config).",
        None,
        (["sft.enabled", "sft.max_steps", "model.path"], "marsrl sft --set sft.max_steps=400"),
    ),
    "rollout": (
        cmd_rollout,
        "Run rollout flows for a run (one side of a split rollout/learner run).",
        _rollout_setup,
        (
            ["data.num_batches", "rollout.segment_tokens", "engine.name"],
            "marsrl rollout --run-id r1 --batches 0 1 --finish",
        ),
    ),
    "learn": (
        cmd_learn,
        "Run the learner flow for a run (the other side of a split run).",
        _learn_setup,
        (["learner.max_steps", "learner.nproc", "learner.fsdp", "model.device"], "marsrl learn --run-id r1 --nproc 2"),
    ),
    "serve": (
        cmd_serve,
        "Serve the flows as Prefect deployments (with schedules) for the UI.",
        _serve_setup,
        (["learner.max_steps", "data.num_batches"], "marsrl serve --preset tiny --cron '0 2 * * *'"),
    ),
}


def main(argv: Sequence[str] | None = None) -> int:
    from prefect.exceptions import FailedRun

    from flows.logs import set_verbosity

    try:
        return core_cli.main(argv, COMMANDS, before=lambda args: set_verbosity(args.verbose))
    except FailedRun as err:  # a run that stopped itself with one line (the policy diverged)
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
