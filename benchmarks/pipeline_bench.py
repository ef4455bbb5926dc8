"""Pipeline benchmark: wall-clock to the same number of learner updates, pipelined vs synchronous.

1. On this CPU, for real: the tiny model (random weights; its EOS is set to a frequent token so
   output lengths are geometric, a long tail up to the budgets), the hf engine, the DuckLake store and
   the learner, in the same process; both variants from the same seed, side by side in one run.
2. At paper scale, with the discrete-event model in `marsrl_core/rollout/simulate.py` (its docstring states
   the assumptions): the speed-up, utilisations, and how they move with segment size and staleness.

An update holds what is ready when the learner takes it: the synchronous baseline trains on each
finished batch until nothing is left, the pipelined learner as soon as one agent has a step's worth.
So the two variants' updates can differ in size, and the benchmark also reports the samples trained
and their rate (`cpu_trained_samples_per_s_ratio`): at 8 updates the wall-clock ratio read 1.30x
while the trained-sample rate was the same (1.01x). It ran 32 updates (7-11 s a run; 8 gave 2 s
runs, mostly the first batch, which nothing overlaps, and the tail). It keeps one group count for
every agent (`downstream_groups_per_step=4`): with the tiny preset's 8 the synchronous baseline
needs twice the batches for its updates and the wall-clock ratio at 8 updates read 2.05x with the
trained-sample rate again 1.01x, a figure about update sizes, not about pipelining. It now runs 64
updates and also reads the 32-update figure off the same runs (the time of each update is recorded).
Per variant it counts the samples finished and those the learner dropped as older than
`learner.max_staleness` (the synchronous baseline, a batch at a time, drops none); `--set KEY=VALUE`
runs both variants with a config override (for example `learner.max_staleness=null`).

Run: `python benchmarks/pipeline_bench.py` (`--hidden-size 256` or `--hidden-size 512 --num-layers 4`
for wider models). Writes benchmarks/results/pipeline.json (pipeline_variant.json with `--set`) with
cpu_speedup (synchronous wall-clock over pipelined, at `cpu_steps` updates), cpu_speedup_at_32_steps,
cpu_trained_samples_per_s_ratio, sim_speedup_paper_scale, and the sweeps.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

from benchmarks.common import print_rows, write_results  # noqa: E402
from marsrl_core.agents.problems import Problem  # noqa: E402
from marsrl_core.agents.roles import TINY_TEMPLATES, Roles  # noqa: E402
from marsrl_core.config import load_config  # noqa: E402
from marsrl_core.demo.tiny import build_tiny_model  # noqa: E402
from marsrl_core.engines.hf import HFEngine  # noqa: E402
from marsrl_core.learn.learner import Learner  # noqa: E402
from marsrl_core.learn.pipeline import run_pipelined, run_synchronous  # noqa: E402
from marsrl_core.rollout.scheduler import RolloutScheduler  # noqa: E402
from marsrl_core.rollout.simulate import SimConfig, compare  # noqa: E402
from marsrl_core.store import SegmentStore  # noqa: E402

STEPS = 64
EARLY_STEPS = 32  # also read off the same runs: the figure earlier sessions reported
REPEATS = 5


def cpu_run(root: Path, folder: Path, synchronous: bool, repeat: int = 0, overrides: tuple[str, ...] = ()) -> dict:
    tag = f"{'sync' if synchronous else 'pipe'}{repeat}"
    cfg = load_config(
        "tiny",
        None,
        [
            f"store.catalog_url=sqlite:{root}/{tag}.sqlite",
            f"store.data_path={root}/{tag}-data",
            "rollout.num_generations=8",
            "rollout.downstream_generations=4",
            "rollout.select_inputs=2",
            "rollout.segment_tokens=16",
            "rollout.solver_max_tokens=64",
            "rollout.verifier_max_tokens=32",
            "rollout.corrector_max_tokens=64",
            "rollout.problems_per_batch=4",
            "rollout.max_staleness=2",
            "rollout.batches_in_flight=2",  # the default; the synchronous baseline always decodes one batch
            f"rollout.synchronous={synchronous}",
            "learner.groups_per_step=4",
            "learner.downstream_groups_per_step=4",
            "learner.learning_rate=1e-5",
            *overrides,
        ],
    )
    store = SegmentStore.from_config(cfg.store)
    engine = HFEngine.from_pretrained(folder)
    engine.eos_id = engine.tokenizer.convert_tokens_to_ids("3")  # a frequent token: geometric lengths
    problems = (
        Problem(f"p{i}", f"{i % 10}+{(i * 7) % 10}", str((i % 10 + (i * 7) % 10) % 10)) for i in itertools.count()
    )
    scheduler = RolloutScheduler(
        cfg, store, tag, engine, engine.tokenizer, Roles.from_config(base=TINY_TEMPLATES), problems, seed=0
    )
    learner = Learner(cfg, store, tag, folder, root / f"{tag}-ckpt", engine.tokenizer)
    loop = run_synchronous if synchronous else run_pipelined
    at_step: list[tuple[float, int]] = []  # (seconds since start, samples trained so far) after each update

    def on_step(report) -> None:
        trained = sum(len(ids) for ids in report.consumed.values())
        at_step.append((time.perf_counter() - start, trained + (at_step[-1][1] if at_step else 0)))

    start = time.perf_counter()
    result = loop(scheduler, learner, STEPS, on_step=on_step)
    wall = time.perf_counter() - start
    tokens = store.query("SELECT sum(len(token_ids)) AS n FROM segments").column("n")[0].as_py()
    trained = store.query("SELECT count(*) AS n FROM consumptions WHERE learner_step > 0").column("n")[0].as_py()
    finished = store.query("SELECT count(*) AS n FROM rewards").column("n")[0].as_py()
    stale = store.query("SELECT count(*) AS n FROM consumptions WHERE learner_step < 0").column("n")[0].as_py()
    return {
        "wall_clock_s": wall,
        "steps": result.steps,
        "stages": result.stages,
        "tokens": int(tokens),
        "trained_samples": int(trained),
        "trained_samples_per_s": trained / wall,
        "finished_samples": int(finished),
        "dropped_stale_samples": int(stale),
        "wall_clock_s_at_step": [t for t, _ in at_step],
        "trained_samples_at_step": [n for _, n in at_step],
        "learner_util": result.learner_utilisation,
        "rollout_util": result.rollout_utilisation,
    }


def main() -> None:
    import argparse

    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=128, help="Width of the model (the tiny default: 128).")
    parser.add_argument("--num-layers", type=int, default=2, help="Layers of the model (the tiny default: 2).")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="A config override for both variants (repeatable); the results then go to pipeline_variant.json.",
    )
    args = parser.parse_args()
    overrides = tuple(args.overrides)
    torch.set_num_threads(1)  # both variants: one intra-op thread per worker, so overlap can use the 2nd core
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = build_tiny_model(
            root / "model", hidden_size=args.hidden_size, num_layers=args.num_layers, max_position_embeddings=512
        )
        runs: dict[str, list[dict]] = {"sync": [], "pipe": []}
        for repeat in range(REPEATS):  # alternated, so that load on this shared machine hits both alike
            runs["sync"].append(cpu_run(root, folder, True, repeat, overrides))
            runs["pipe"].append(cpu_run(root, folder, False, repeat, overrides))
    sync, pipe = (sorted(runs[k], key=lambda r: r["wall_clock_s"])[REPEATS // 2] for k in ("sync", "pipe"))
    cpu_speedup = sync["wall_clock_s"] / pipe["wall_clock_s"]
    samples_ratio = statistics.median(
        p["trained_samples_per_s"] / s["trained_samples_per_s"] for s, p in zip(runs["sync"], runs["pipe"])
    )

    def at_early(kind: str) -> float:
        return statistics.median(r["wall_clock_s_at_step"][EARLY_STEPS - 1] for r in runs[kind])

    early_speedup = at_early("sync") / at_early("pipe")
    print_rows(
        f"CPU, tiny model: wall-clock to {STEPS} learner updates",
        [
            "variant",
            "wall s",
            "steps",
            "stages",
            "tokens decoded",
            "samples finished",
            "samples trained",
            "dropped stale",
            "learner util",
            "rollout util",
        ],
        [
            [
                name,
                r["wall_clock_s"],
                r["steps"],
                r["stages"],
                r["tokens"],
                r["finished_samples"],
                r["trained_samples"],
                r["dropped_stale_samples"],
                r["learner_util"],
                r["rollout_util"],
            ]
            for name, r in (("synchronous", sync), ("pipelined", pipe))
        ],
    )
    print(
        f"CPU speed-up (synchronous / pipelined, medians of {REPEATS}): {cpu_speedup:.2f}x; each run: "
        + ", ".join(f"{s['wall_clock_s'] / p['wall_clock_s']:.2f}x" for s, p in zip(runs["sync"], runs["pipe"]))
    )
    print(
        f"the same runs at {EARLY_STEPS} updates: {early_speedup:.2f}x (the first batch, which nothing overlaps, "
        "and the start-up weigh more in a shorter run)"
    )
    print(
        f"trained samples per second, pipelined / synchronous (median of the {REPEATS} pairs): {samples_ratio:.2f}x "
        "(an update's size depends on what is ready when it is taken, so the two can differ)"
    )

    base = SimConfig()
    paper = compare(base)
    print_rows(
        "paper-scale model (simulate.py): 128 problems x (8 + 4 x 16) samples, 8 updates",
        ["measure", "synchronous", "pipelined"],
        [
            ["wall-clock h", paper["sync_wall_s"] / 3600, paper["pipelined_wall_s"] / 3600],
            ["learner utilisation", paper["sync_learner_util"], paper["pipelined_learner_util"]],
            ["rollout utilisation", paper["sync_rollout_util"], paper["pipelined_rollout_util"]],
        ],
    )
    print(f"simulated speed-up at paper scale: {paper['speedup']:.2f}x")
    segments = {str(s): compare(replace(base, segment_tokens=s))["speedup"] for s in (4096, 8192, 16384, 32768, 65536)}
    staleness = {str(s): compare(replace(base, max_staleness=s))["speedup"] for s in (0, 1, 2, 4)}
    in_flight = {str(b): compare(replace(base, batches_in_flight=b))["speedup"] for b in (1, 2, 3)}
    print_rows(
        "simulated speed-up by segment size (staleness 2)",
        ["segment tokens", "speed-up"],
        [[k, v] for k, v in segments.items()],
    )
    print_rows(
        "simulated speed-up by max_staleness (16K segments)",
        ["max_staleness", "speed-up"],
        [[k, v] for k, v in staleness.items()],
    )
    print_rows(
        "simulated speed-up by batches in flight", ["batches", "speed-up"], [[k, v] for k, v in in_flight.items()]
    )
    path = write_results(
        "pipeline_variant" if overrides else "pipeline",
        {
            "overrides": list(overrides),
            "cpu_speedup": cpu_speedup,
            "cpu_steps": STEPS,
            f"cpu_speedup_at_{EARLY_STEPS}_steps": early_speedup,
            "cpu_synchronous": sync,
            "cpu_pipelined": pipe,
            "cpu_trained_samples_per_s_ratio": samples_ratio,
            "cpu_model": {"hidden_size": args.hidden_size, "num_layers": args.num_layers},
            "cpu_speedup_each_run": [s["wall_clock_s"] / p["wall_clock_s"] for s, p in zip(runs["sync"], runs["pipe"])],
            "sim_speedup_paper_scale": paper["speedup"],
            "sim_paper_scale": paper,
            "sim_speedup_by_segment_tokens": segments,
            "sim_speedup_by_max_staleness": staleness,
            "sim_speedup_by_batches_in_flight": in_flight,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
