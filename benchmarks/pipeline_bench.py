"""Pipeline benchmark: wall-clock to the same learner steps, the pipelined train flow vs the synchronous one.

1. On this CPU, for real: the train flow that `make train` runs (`flows.train.train_flow`: rollout
   subflows per batch, `batches_in_flight` decoding at once beside the learner flow, DuckLake store,
   MLflow, Prefect) against the same flow with `rollout.synchronous=true` (what `marsrl ablate
   synchronous` runs: each batch decoded whole, then trained on, then the next). Both start from the
   tiny preset's committed warm start with the same seed and step budget, evaluation off; the clock is
   the flow's `train_wall_clock_s` (first rollout to the learner's last step). Runs alternate, so load on
   this shared machine hits both alike; the figure is the ratio of the medians.
2. At paper scale, with the discrete-event model in `marsrl_core/rollout/simulate.py` (its docstring
   states the assumptions and which rules it shares with the flows): the speed-up, utilisations, and how
   they move with segment size, staleness and batches in flight.

An update holds what is ready when the learner takes it, so the two variants' updates can differ in
size: the benchmark also reports the samples trained per second. Per variant it counts the samples
finished and those the learner dropped untrained as older than `learner.max_trained_age`.

Run: `python benchmarks/pipeline_bench.py` (`--repeats 3` by default; `--set KEY=VALUE` overrides both
variants, and the results then go to pipeline_variant.json). Writes benchmarks/results/pipeline.json
with cpu_speedup (synchronous over pipelined wall-clock to `cpu_steps` learner steps),
stale_drop_fraction (the pipelined runs' median of samples dropped untrained, as stale or masked, over
those the learner consumed: `work.sample_accounting`),
cpu_speedup_each_run, cpu_trained_samples_per_s_ratio, the per-variant figures,
sim_speedup_paper_scale and the sweeps.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

from benchmarks.common import print_rows, write_results  # noqa: E402
from marsrl_core.cli import add_overrides_option  # noqa: E402
from marsrl_core.config import load_config  # noqa: E402
from marsrl_core.demo.sft import find_warm_start  # noqa: E402
from marsrl_core.rollout.simulate import SimConfig, compare  # noqa: E402
from marsrl_core.store import SegmentStore  # noqa: E402


def flow_run(root: Path, synchronous: bool, repeat: int, overrides: tuple[str, ...]) -> dict:
    """One train-flow run of `make train`'s configuration, without the evaluations."""
    from flows.train import train_flow

    tag = f"{'sync' if synchronous else 'pipe'}{repeat}"
    warm = find_warm_start(load_config("tiny"))
    cfg = load_config(
        "tiny",
        None,
        [
            f"store.catalog_url=sqlite:{root}/{tag}.sqlite",
            f"store.data_path={root}/{tag}-data",
            f"output_dir={root}/{tag}-out",
            f"tracking.mlflow_tracking_uri=sqlite:///{root}/{tag}-mlflow.db",
            f"model.path={warm}",
            f"rollout.synchronous={synchronous}",
            *overrides,
        ],
    )
    result = train_flow(cfg, tag, evaluate_before=False, evaluate_after=False)
    store = SegmentStore.from_config(cfg.store)

    def one(sql: str) -> int:
        return int(store.query(sql, [tag]).column(0)[0].as_py() or 0)

    wall = result["train_wall_clock_s"]
    trained = one("SELECT count(*) FROM consumptions WHERE run_id = ? AND learner_step > 0")
    figures = {
        "wall_clock_s": wall,
        "steps": result["learner_steps"],
        "tokens": one("SELECT sum(len(token_ids)) FROM segments WHERE run_id = ?"),
        "batches_decoded": one("SELECT count(*) FROM run_events WHERE run_id = ? AND event LIKE 'batch_done:%'"),
        "finished_samples": one("SELECT count(*) FROM rewards WHERE run_id = ?"),
        "trained_samples": trained,
        "trained_samples_per_s": trained / wall,
        "dropped_stale_samples": one("SELECT count(*) FROM consumptions WHERE run_id = ? AND learner_step < 0"),
        "stale_drop_fraction": result["samples"]["stale_drop_fraction"],
    }
    store.close()
    return figures


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="Alternated runs of each variant (median taken).")
    add_overrides_option(
        parser, "A config override for both variants (repeatable); results go to pipeline_variant.json."
    )
    args = parser.parse_args()
    overrides = tuple(args.overrides)
    if find_warm_start(load_config("tiny")) is None:
        raise SystemExit("no warm start for the tiny preset: run `marsrl sft` first")
    runs: dict[str, list[dict]] = {"sync": [], "pipe": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):  # alternated, so that load on this shared machine hits both alike
            runs["sync"].append(flow_run(Path(tmp), True, repeat, overrides))
            runs["pipe"].append(flow_run(Path(tmp), False, repeat, overrides))
            print(
                f"pair {repeat + 1}: synchronous {runs['sync'][-1]['wall_clock_s']:.1f} s, "
                f"pipelined {runs['pipe'][-1]['wall_clock_s']:.1f} s",
                flush=True,
            )
    sync, pipe = (sorted(runs[k], key=lambda r: r["wall_clock_s"])[len(runs[k]) // 2] for k in ("sync", "pipe"))
    cpu_speedup = sync["wall_clock_s"] / pipe["wall_clock_s"]
    each = [s["wall_clock_s"] / p["wall_clock_s"] for s, p in zip(runs["sync"], runs["pipe"])]
    samples_ratio = statistics.median(
        p["trained_samples_per_s"] / s["trained_samples_per_s"] for s, p in zip(runs["sync"], runs["pipe"])
    )
    columns = [
        "wall_clock_s",
        "steps",
        "batches_decoded",
        "tokens",
        "finished_samples",
        "trained_samples",
        "dropped_stale_samples",
        "stale_drop_fraction",
    ]
    print_rows(
        f"the train flow (make train's configuration), wall-clock to {pipe['steps']} learner steps",
        ["variant", *columns],
        [[name, *[r[c] for c in columns]] for name, r in (("synchronous", sync), ("pipelined", pipe))],
    )
    print(
        f"CPU speed-up (synchronous / pipelined, medians of {args.repeats}): {cpu_speedup:.2f}x; each pair: "
        + ", ".join(f"{x:.2f}x" for x in each)
    )
    print(f"trained samples per second, pipelined / synchronous (median of the pairs): {samples_ratio:.2f}x")

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
            "loop": "flows.train.train_flow (pipelined) vs the same with rollout.synchronous=true",
            "cpu_speedup": cpu_speedup,
            "stale_drop_fraction": statistics.median(r["stale_drop_fraction"] for r in runs["pipe"]),
            "cpu_steps": pipe["steps"],
            "cpu_repeats": args.repeats,
            "cpu_speedup_each_run": each,
            "cpu_trained_samples_per_s_ratio": samples_ratio,
            "cpu_synchronous": sync,
            "cpu_pipelined": pipe,
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
