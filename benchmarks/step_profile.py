"""Where a learner step's time goes: the train flow's phases (`marsrl_core/timings.py`) per step and in total.

One run of the train flow (the one `make train` runs, evaluation off) with `rollout.max_turns=1` (the
Solver alone), from its first rollout to its last step. The decode loop and the learner are two lanes
that run at once; each lane's phases are listed with their share of the run's wall-clock:
- decode loop: weights (poll and load a newer version), decode (its prefill of contexts the engine
  did not keep from a sample's previous segment, and its token steps), store writes,
  admitting problems, rewards, the next agents' groups, the rest of a stage, idle, the scheduler's
  and engines' set-up, the time with no batch in the loop (the next rollout subflow not yet started),
  and the rest outside its stages (the first subflow's start, between stages, after the last);
- learner: its build (model, optimizer, resume; beside the first rollouts in a new run), poll, load
  samples, forward/backward, optimizer, the wait for a background durable write
  (`learner.async_save`), checkpoint write, store commit, MLflow, weight hand-over, Prefect's
  bookkeeping (the train-step task less the step and the hand-over), compaction, idle; and the
  background durable write itself (a thread beside the step: not part of its time);
- the store calls by method (a store process serves one call at a time: `lock_wait` is the turn);
- the CPU seconds of the run's processes by role (`cpu_use.py`: this process, the store processes,
  Prefect's server) and the share of the machine's cores they kept busy: a run near 100% leaves the
  pipeline nothing to overlap, and only less work makes it faster.

`--model qwen3-0.6b`: the same on a random-init model of Qwen3-0.6B's shape (28 layers, hidden 1024,
Qwen3's real tokenizer and vocabulary) with short outputs and `--steps` steps (3), so what a checkpoint
costs at a real model's size shows.

`--compare`: this code against a baseline, run after run, alternating, `--repeats` times (3), each run
in a fresh process: `--baseline-ref COMMIT` runs the baseline from that commit's code (a git
worktree; its own defaults), `--baseline KEY=VALUE` changes its settings (e.g.
`learner.save_every=1`); the medians of the runs' wall-clock to step `--steps` give the speed-up.

Run: `python benchmarks/step_profile.py` (tiny, 50 steps, ~1 min), `--model qwen3-0.6b`,
`--compare --baseline-ref fb70dfb` (the code before `save_every` and the step profile),
`--model qwen3-0.6b --compare --baseline learner.save_every=1`; `--set KEY=VALUE` overrides every run.
Writes `benchmarks/results/step_profile.json`: per model (`tiny`, `qwen3_0_6b`) `wall_s`, `steps`,
`per_step_s`, `phases` (each phase's `seconds`, `per_step_s`, `count`, `share`), `store_calls`,
`cpu_s` (by role) and `cpu_busy_fraction`;
per comparison `<model>_compare_<baseline>` with `speedup`, both sides' wall-clocks and per-step
seconds; `solver_only_speedup` for the tiny model against `--baseline-ref fb70dfb`. Figures already in the
file for other keys are kept.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CODE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(CODE))
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

from benchmarks import cpu_use  # noqa: E402
from benchmarks.common import RESULTS, print_rows, write_results  # noqa: E402
from marsrl_core.config import load_config  # noqa: E402
from marsrl_core.demo.sft import find_warm_start  # noqa: E402

QWEN3_SETTINGS = (
    "rollout.segment_tokens=16",
    "rollout.solver_max_tokens=32",
    "rollout.problems_per_batch=2",
    "rollout.num_generations=8",
    "learner.groups_per_step=2",
    "model.dtype=bfloat16",
)

# `solver_only_speedup` is this code against the code before `learner.save_every` and the step profile.
SOLVER_ONLY_BASELINE = "fb70dfb"

# The phases inside a decode-loop stage and inside a learner step (name in the table: phase), each a row;
# the stage's and the step's time outside them is a row of its own ("the rest").
STAGE_PARTS = {
    "weights": "weights",
    "decode": "decode",
    "store write": "store_write",
    "admit": "admit",
    "rewards": "rewards",
    "next agents": "advance",
}
STEP_PARTS = {
    "load samples": "load_samples",
    "forward/backward": "forward_backward",
    "optimizer": "optimizer",
    "checkpoint write": "checkpoint_write",
    "store commit": "store_commit",
    "MLflow": "tracking",
}
# name in the table (its lane first): (the phases it sums, the phases it subtracts)
ROWS = {
    **{f"rollout: {name}": ([f"rollout.{phase}"], []) for name, phase in STAGE_PARTS.items() if name != "decode"},
    # the engines' segment batches: the prefill of contexts not kept from a sample's previous segment
    # (`engines/kv_cache.py`), and the token steps
    "rollout: decode, prefill": (["rollout.prefill"], []),
    "rollout: decode, token steps": (["rollout.decode"], ["rollout.prefill"]),
    "rollout: stage, the rest": (["rollout.stage"], [f"rollout.{phase}" for phase in STAGE_PARTS.values()]),
    "rollout: idle": (["rollout.idle"], []),
    "rollout: scheduler and engine set-up": (["rollout.build"], []),
    "rollout: no batch in the loop": (["rollout.no_batch"], []),
    "learner: build": (["learner.build"], []),
    "learner: poll": (["learner.poll"], []),
    **{f"learner: {name}": ([f"learner.{phase}"], []) for name, phase in STEP_PARTS.items()},
    "learner: step, the rest": (["learner.step"], [f"learner.{phase}" for phase in STEP_PARTS.values()]),
    "learner: wait for the durable write": (["learner.durable_wait"], []),
    "learner: durable write (background)": (["learner.durable_write"], []),
    "learner: weight hand-over": (["learner.weight_handover"], []),
    "learner: Prefect task bookkeeping": (["learner.task"], ["learner.step", "learner.weight_handover"]),
    "learner: compaction": (["learner.compact"], []),
    "learner: idle": (["learner.idle"], []),
}


def qwen3_model(folder: Path) -> Path:
    """A random-init Qwen3-0.6B-shaped model (bf16 on disk) with Qwen3's tokenizer in `folder`."""
    import torch
    from transformers import Qwen3ForCausalLM

    from tests.qwen3 import QWEN3_0_6B, qwen3_config, qwen3_tokenizer_files

    config = qwen3_config(1024, **QWEN3_0_6B)
    torch.manual_seed(0)
    qwen3_tokenizer_files(folder)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return folder


# One run, in a process of its own whose working directory is the code tree under test (this one, or
# a `--baseline-ref` checkout): its train flow to the step budget, its wall-clock and phase timings.
DRIVER = """
import json, os, sys
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
args = json.loads(sys.argv[1])
sys.path.insert(0, args["benchmarks"])  # this code's benchmarks folder, for `cpu_use` (psutil only)
import cpu_use
from marsrl_core.config import load_config
from flows.server import local_server  # the Prefect server `marsrl train` runs against
from flows.train import train_flow
try:
    from marsrl_core import timings
except ImportError:  # a baseline older than the phase timings: its wall-clock alone
    timings = None
before = timings.TIMINGS.snapshot() if timings else {}
cfg = load_config("tiny", None, args["settings"])
with local_server():
    cpu_before = cpu_use.snapshot()
    result = train_flow(cfg, args["tag"], evaluate_before=False, evaluate_after=False)
    cpu = cpu_use.spent(cpu_before, cpu_use.snapshot())
spent = timings.since(before) if timings else {}
figures = {"wall": result["train_wall_clock_s"], "steps": result["learner_steps"], "spent": spent, "cpu": cpu}
print("STEP_PROFILE " + json.dumps(figures))
"""


def profile_run(root: Path, tag: str, model: str, steps: int, overrides: tuple[str, ...], code: Path = CODE) -> dict:
    """One train-flow run to `steps` steps of the code in `code`; its wall-clock and the phases' seconds."""
    settings = [
        f"store.catalog_url=sqlite:{root}/{tag}.sqlite",
        f"store.data_path={root}/{tag}-data",
        f"output_dir={root}/{tag}-out",
        f"tracking.mlflow_tracking_uri=sqlite:///{root}/{tag}-mlflow.db",
        "rollout.max_turns=1",
        f"learner.max_steps={steps}",
        # enough batches for the budget (a batch of the tiny preset holds two Solver-only steps' groups)
        f"data.num_batches={steps * 3 // 5 + 1 if model == 'tiny' else steps + 2}",
    ]
    if model == "tiny":
        settings.append(f"model.path={find_warm_start(load_config('tiny'))}")
    else:
        folder = root / "qwen3-0.6b"
        if not folder.exists():
            qwen3_model(folder)
        settings += [f"model.path={folder}", "sft.enabled=false", *QWEN3_SETTINGS]
    env = {**os.environ, "PYTHONPATH": str(code)}
    args = json.dumps({"settings": [*settings, *overrides], "tag": tag, "benchmarks": str(CODE / "benchmarks")})
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, args], cwd=code, env=env, capture_output=True, text=True, check=False
    )
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("STEP_PROFILE ")), None)
    if done.returncode or line is None:
        raise RuntimeError(
            f"run {tag} in {code} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
        )
    result = json.loads(line.removeprefix("STEP_PROFILE "))
    spent = {name: tuple(value) for name, value in result["spent"].items()}
    cpu = result["cpu"]
    wall, done = result["wall"], result["steps"]
    phases = {}
    for name, (plus, minus) in ROWS.items():
        seconds = sum(spent.get(p, (0.0, 0))[0] for p in plus) - sum(spent.get(p, (0.0, 0))[0] for p in minus)
        count = sum(spent.get(p, (0.0, 0))[1] for p in plus)
        phases[name] = {
            "seconds": seconds,
            "per_step_s": seconds / max(1, done),
            "count": count,
            "share": seconds / wall,
        }
    # The decode loop's lane outside the rows above: the first batch's Prefect subflow, between stages,
    # and after the last stage.
    rest = wall - sum(v["seconds"] for k, v in phases.items() if k.startswith("rollout"))
    phases["rollout: outside stages"] = {
        "seconds": rest,
        "per_step_s": rest / max(1, done),
        "count": 0,
        "share": rest / wall,
    }
    store_calls = {
        name.removeprefix("store."): {"seconds": seconds, "count": count, "ms_each": 1000 * seconds / max(1, count)}
        for name, (seconds, count) in spent.items()
        if name.startswith("store.")
    }
    return {
        "wall_s": wall,
        "steps": done,
        "per_step_s": wall / max(1, done),
        "cpu_s": cpu,
        "cpu_busy_fraction": cpu_use.busy_fraction(sum(cpu.values()), wall),
        "phases": phases,
        "store_calls": dict(sorted(store_calls.items(), key=lambda kv: -kv[1]["seconds"])),
    }


def print_profile(title: str, figures: dict) -> None:
    rows = [
        [name, p["seconds"], p["per_step_s"] * 1000, f"{100 * p['share']:.0f}%"]
        for name, p in figures["phases"].items()
    ]
    print_rows(
        f"{title}: {figures['steps']} steps in {figures['wall_s']:.1f} s "
        f"({figures['per_step_s'] * 1000:.0f} ms a step)",
        ["phase", "seconds", "ms per step", "of wall-clock"],
        rows,
    )
    cpu = [[role, seconds, seconds / figures["wall_s"]] for role, seconds in figures["cpu_s"].items()]
    print_rows(
        f"{title}: CPU seconds by process ({cpu_use.cores()} cores busy "
        f"{100 * figures['cpu_busy_fraction']:.0f}% of the wall-clock)",
        ["process", "CPU seconds", "cores busy"],
        cpu,
    )
    calls = [[name, c["count"], c["ms_each"], c["seconds"]] for name, c in figures["store_calls"].items()]
    print_rows(f"{title}: store calls", ["method", "calls", "ms each", "seconds"], calls)


def checkout(ref: str, folder: Path) -> Path:
    """The code tree of git `ref` in `folder` (a detached worktree of this repository)."""
    subprocess.run(["git", "-C", str(CODE), "worktree", "add", "--detach", str(folder), ref], check=True)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=["tiny", "qwen3-0.6b"])
    parser.add_argument("--steps", type=int, default=None, help="Learner steps (tiny: 50, qwen3-0.6b: 3).")
    parser.add_argument("--compare", action="store_true", help="This code's defaults against the baseline.")
    parser.add_argument("--baseline-ref", default=None, help="The baseline's code: a git commit (default: this code).")
    parser.add_argument("--baseline", action="append", default=[], help="A KEY=VALUE of the baseline runs.")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    args = parser.parse_args()
    steps = args.steps or (50 if args.model == "tiny" else 3)
    key = args.model.replace("-", "_").replace(".", "_")
    path = RESULTS / "step_profile.json"
    figures = json.loads(path.read_text()) if path.exists() else {}
    if args.compare and not (args.baseline_ref or args.baseline):
        parser.error("--compare needs a baseline: --baseline-ref COMMIT and/or --baseline KEY=VALUE")

    with tempfile.TemporaryDirectory(prefix="marsrl-step-profile-") as tmp:
        root = Path(tmp)
        if not args.compare:
            figures[key] = profile_run(root, "profile", args.model, steps, tuple(args.overrides))
            figures[key]["settings"] = args.overrides
            print_profile(args.model, figures[key])
        else:
            code = checkout(args.baseline_ref, root / "baseline-code") if args.baseline_ref else CODE
            variants = {
                "baseline": (code, (*args.overrides, *args.baseline)),
                "this code": (CODE, tuple(args.overrides)),
            }
            runs: dict[str, list[dict]] = {name: [] for name in variants}
            try:
                for repeat in range(args.repeats):  # alternating, so load on this machine hits both alike
                    for name, (tree, settings) in variants.items():
                        run = profile_run(root, f"{name.replace(' ', '-')}{repeat}", args.model, steps, settings, tree)
                        runs[name].append(run)
                        print_profile(f"{name} {repeat}", run)
            finally:
                if args.baseline_ref:
                    subprocess.run(["git", "-C", str(CODE), "worktree", "remove", "--force", str(code)], check=False)
            base = statistics.median(r["wall_s"] for r in runs["baseline"])
            new = statistics.median(r["wall_s"] for r in runs["this code"])
            label = "_".join(filter(None, [f"ref_{args.baseline_ref}" if args.baseline_ref else "", *args.baseline]))
            figures[f"{key}_compare_{label}"] = {
                "speedup": base / new,
                "steps": steps,
                "baseline_ref": args.baseline_ref,
                "baseline_settings": args.baseline,
                "baseline_wall_s": [r["wall_s"] for r in runs["baseline"]],
                "this_code_wall_s": [r["wall_s"] for r in runs["this code"]],
                "baseline_per_step_s": base / steps,
                "this_code_per_step_s": new / steps,
                "this_code_phases": runs["this code"][-1]["phases"],
                "baseline_cpu_s": [r["cpu_s"] for r in runs["baseline"]],
                "this_code_cpu_s": [r["cpu_s"] for r in runs["this code"]],
                "baseline_cpu_busy_fraction": [r["cpu_busy_fraction"] for r in runs["baseline"]],
                "this_code_cpu_busy_fraction": [r["cpu_busy_fraction"] for r in runs["this code"]],
            }
            if key == "tiny" and args.baseline_ref == SOLVER_ONLY_BASELINE and not args.baseline:
                figures["solver_only_speedup"] = base / new
            print(
                f"{args.model}, {steps} steps, medians of {args.repeats}: baseline {base:.1f} s, "
                f"this code {new:.1f} s, speedup {base / new:.2f}x"
            )
    print(f"wrote {write_results('step_profile', figures)}")


if __name__ == "__main__":
    main()
