"""Pipeline benchmark: the pipelined train flow against the synchronous one, and the paper-scale simulation.

1. On this CPU, for real: the train flow that `make train` runs (`flows.train.train_flow`: rollout
   subflows feeding one decode loop, `batches_in_flight` at once, beside the learner flow; DuckLake
   store, MLflow, Prefect's server as `marsrl train` starts it) against the same flow with
   `rollout.synchronous=true` (what `marsrl ablate synchronous` runs: each batch decoded whole, then
   trained on, then the next). Both start from the tiny preset's committed warm start with the same seed
   and step budget, evaluation off; the clock is the flow's `train_wall_clock_s` (first rollout to the
   learner's last step). Runs alternate, so load on this shared machine hits both alike; the figures are
   medians. A step holds what is ready when the learner takes it, so the variants' steps differ in size:
   besides the wall-clock to the same steps (`cpu_speedup`) it reports trained samples per second
   (`cpu_trained_samples_per_s_ratio`, the fairer figure), the engine's mean decode batch and each
   pair's training reward against wall-clock (`benchmarks/results/pipeline_reward.png`).
2. At paper scale, `marsrl_core/rollout/simulate.py` (the real scheduler, gate and learner readiness
   rule on a simulated engine and clock; its docstring states the assumptions): synchronous, the
   per-batch turn barrier and the shipped streaming rule side by side, to the same trained samples, with
   the fleet's and the learner's busy fractions per agent and the age of trained samples; then the
   streaming speed-up by segment size, `max_version_span` and batches in flight.

Run: `python benchmarks/pipeline_bench.py` (`--repeats 3` by default; `--set KEY=VALUE` overrides both
variants, and the results then go to pipeline_variant.json; `--sim-only` runs part 2 alone and keeps
the file's CPU figures; `--cpu-only` the pairs alone, keeping the simulated ones). Writes
benchmarks/results/pipeline.json with cpu_speedup, cpu_trained_samples_per_s_ratio,
cpu_speedup_each_run, cpu_decode_batch_mean,
cpu_busy_fraction (each variant's CPU seconds over the cores' time: `cpu_use.py`), cpu_speedup_bound
(the synchronous wall-clock over the pipelined run's CPU seconds per core: the most overlap could give),
stale_drop_fraction (the pipelined runs' median of samples dropped untrained over those consumed:
`work.sample_accounting`), the per-variant figures, sim_speedup_paper_scale (streaming),
sim_speedup_batch_barrier, sim_paper_scale and the sweeps.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

from benchmarks import cpu_use  # noqa: E402
from benchmarks.common import RESULTS, print_rows, write_results  # noqa: E402
from marsrl_core.cli import add_overrides_option  # noqa: E402
from marsrl_core.config import load_config  # noqa: E402
from marsrl_core.demo.sft import find_warm_start  # noqa: E402
from marsrl_core.rollout.simulate import SimConfig, compare, simulate  # noqa: E402
from marsrl_core.store import SegmentStore  # noqa: E402


def flow_run(root: Path, synchronous: bool, repeat: int, overrides: tuple[str, ...]) -> dict:
    """One train-flow run of `make train`'s configuration, without the evaluations."""
    from flows.server import local_server
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
    with local_server():  # the Prefect server `marsrl train` runs against, one per run
        cpu_before = cpu_use.snapshot()
        result = train_flow(cfg, tag, evaluate_before=False, evaluate_after=False)
        cpu = cpu_use.spent(cpu_before, cpu_use.snapshot())
    store = SegmentStore.from_config(cfg.store)

    def one(sql: str) -> int:
        return int(store.query(sql, [tag]).column(0)[0].as_py() or 0)

    wall = result["train_wall_clock_s"]
    trained = one("SELECT count(*) FROM consumptions WHERE run_id = ? AND learner_step > 0")
    rewards = store.query(
        """SELECT epoch(created_at) - (SELECT epoch(min(created_at)) FROM segments WHERE run_id = $1) AS t,
                  avg(reward_mean) AS reward
           FROM train_step_metrics WHERE run_id = $1 AND reward_mean IS NOT NULL GROUP BY step, created_at
           ORDER BY step""",
        [tag],
    ).to_pylist()
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
        "decode_batch_mean": result["rollout"]["decode_batch_mean"],
        "cpu_s": cpu,
        "cpu_busy_fraction": cpu_use.busy_fraction(sum(cpu.values()), wall),
        "reward_curve": [(r["t"], r["reward"]) for r in rewards],
    }
    store.close()
    return figures


def plot_reward_curves(runs: dict[str, list[dict]]) -> Path:
    """Each pair's mean training reward (over the agents, per learner step) against wall-clock from the
    first rollout, both variants on one panel; written to benchmarks/results/pipeline_reward.png."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    pairs = len(runs["pipe"])
    figure, axes = plt.subplots(1, pairs, figsize=(4.5 * pairs, 3.4), sharey=True, squeeze=False)
    for i, ax in enumerate(axes[0]):
        for key, label in (("pipe", "pipelined"), ("sync", "synchronous")):
            points = runs[key][i]["reward_curve"]
            ax.plot([t for t, _ in points], [r for _, r in points], marker=".", label=label)
        ax.set_title(f"pair {i + 1}")
        ax.set_xlabel("seconds since the first rollout")
    axes[0][0].set_ylabel("training reward (mean over agents)")
    axes[0][0].legend()
    figure.tight_layout()
    path = Path(__file__).parent / "results" / "pipeline_reward.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="Alternated runs of each variant (median taken).")
    parser.add_argument(
        "--sim-only", action="store_true", help="Only the paper-scale simulation; the file's CPU figures are kept."
    )
    parser.add_argument(
        "--cpu-only", action="store_true", help="Only the train-flow pairs; the file's simulated figures are kept."
    )
    add_overrides_option(
        parser, "A config override for both variants (repeatable); results go to pipeline_variant.json."
    )
    args = parser.parse_args()
    overrides = tuple(args.overrides)
    name = "pipeline_variant" if overrides else "pipeline"
    figures = _kept(name) if args.sim_only or args.cpu_only else {}
    if not args.sim_only:
        figures.update(cpu_pairs(args.repeats, overrides))
    if not args.cpu_only:
        figures.update(simulated())
    path = write_results(name, figures)
    print(f"wrote {path}")


def _kept(name: str) -> dict:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def cpu_pairs(repeats: int, overrides: tuple[str, ...]) -> dict:
    """The train flow, synchronous and pipelined, `repeats` alternated pairs: the `cpu_*` figures."""
    if find_warm_start(load_config("tiny")) is None:
        raise SystemExit("no warm start for the tiny preset: run `marsrl sft` first")
    runs: dict[str, list[dict]] = {"sync": [], "pipe": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):  # alternated, so that load on this shared machine hits both alike
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
        "decode_batch_mean",
    ]
    print_rows(
        f"the train flow (make train's configuration), wall-clock to {pipe['steps']} learner steps",
        ["variant", *columns],
        [[name, *[r[c] for c in columns]] for name, r in (("synchronous", sync), ("pipelined", pipe))],
    )
    print(
        f"CPU speed-up (synchronous / pipelined, medians of {repeats}): {cpu_speedup:.2f}x; each pair: "
        + ", ".join(f"{x:.2f}x" for x in each)
    )
    print(f"trained samples per second, pipelined / synchronous (median of the pairs): {samples_ratio:.2f}x")
    # The pipelined run needs at least its CPU seconds over the cores: overlap can give no more than this.
    bound = sync["wall_clock_s"] * cpu_use.cores() / sum(pipe["cpu_s"].values())
    print_rows(
        f"CPU seconds by process, median runs ({cpu_use.cores()} cores)",
        ["variant", "cores busy", *pipe["cpu_s"]],
        [
            [name, f"{100 * r['cpu_busy_fraction']:.0f}%", *[r["cpu_s"].get(k, 0.0) for k in pipe["cpu_s"]]]
            for name, r in (("synchronous", sync), ("pipelined", pipe))
        ],
    )
    print(f"most a pipelined run doing this work could gain on these cores (synchronous wall / its CPU): {bound:.2f}x")
    figure = plot_reward_curves(runs)
    return {
        "overrides": list(overrides),
        "loop": "flows.train.train_flow (pipelined) vs the same with rollout.synchronous=true",
        "cpu_speedup": cpu_speedup,
        "stale_drop_fraction": statistics.median(r["stale_drop_fraction"] for r in runs["pipe"]),
        "cpu_steps": pipe["steps"],
        "cpu_repeats": repeats,
        "cpu_speedup_each_run": each,
        "cpu_trained_samples_per_s_ratio": samples_ratio,
        "cpu_speedup_bound": bound,
        "cpu_busy_fraction": {"synchronous": sync["cpu_busy_fraction"], "pipelined": pipe["cpu_busy_fraction"]},
        "cpu_synchronous": sync,
        "cpu_pipelined": pipe,
        "cpu_decode_batch_mean": {"synchronous": sync["decode_batch_mean"], "pipelined": pipe["decode_batch_mean"]},
        "reward_figure": str(figure),
    }


def simulated() -> dict:
    """The paper-scale simulation: the three modes side by side, then the streaming rule's sweeps."""
    base = SimConfig()
    paper = compare(base)
    measures = [
        "speedup",
        "wall_clock_h",
        "learner_steps",
        "trained_samples",
        "fleet_busy",
        "fleet_token_use",
        *[f"fleet_busy_{a}" for a in ("solver", "verifier", "corrector")],
        "learner_busy",
        *[f"learner_busy_{a}" for a in ("solver", "verifier", "corrector")],
        "trained_age_mean",
        "trained_age_max",
        "decode_batch_mean",
    ]
    print_rows(
        f"paper-scale simulation (simulate.py: the real scheduler, gate and learner rule), {base.problems_per_batch}"
        f" problems a batch, to the synchronous run's {paper['synchronous']['trained_samples']} trained samples",
        ["measure", *paper],
        [[m, *[paper[mode][m] for mode in paper]] for m in measures],
    )
    print(
        f"simulated speed-up at paper scale: streaming {paper['streaming']['speedup']:.2f}x, "
        f"per-batch turn barrier {paper['batch_barrier']['speedup']:.2f}x"
    )
    pair = ("synchronous", "streaming")
    segments = {str(t): compare(replace(base, segment_tokens=t), pair)["streaming"]["speedup"] for t in (4096, 8192)}
    segments[str(base.segment_tokens)] = paper["streaming"]["speedup"]
    spans = {str(v): compare(replace(base, max_version_span=v), pair)["streaming"]["speedup"] for v in (0, 1)}
    spans[str(base.max_version_span)] = paper["streaming"]["speedup"]
    # The synchronous baseline decodes one batch at a time whatever `batches_in_flight` says: it runs once.
    sync = paper["synchronous"]
    in_flight = {
        str(b): sync["wall_clock_h"]
        / simulate(replace(base, batches_in_flight=b), "streaming", until_trained=sync["trained_samples"]).as_dict()[
            "wall_clock_h"
        ]
        for b in (1, 2, 3, 4)
        if b != base.batches_in_flight
    }
    in_flight[str(base.batches_in_flight)] = paper["streaming"]["speedup"]
    for title, column, sweep in (
        ("simulated streaming speed-up by segment size", "segment tokens", segments),
        ("simulated streaming speed-up by max_version_span", "max_version_span", spans),
        ("simulated streaming speed-up by batches in flight", "batches", in_flight),
    ):
        print_rows(title, [column, "speed-up"], [[k, sweep[k]] for k in sorted(sweep, key=int)])
    return {
        "sim_speedup_paper_scale": paper["streaming"]["speedup"],
        "sim_speedup_batch_barrier": paper["batch_barrier"]["speedup"],
        "sim_paper_scale": paper,
        "sim_speedup_by_segment_tokens": segments,
        "sim_speedup_by_max_version_span": spans,
        "sim_speedup_by_batches_in_flight": in_flight,
    }


if __name__ == "__main__":
    main()
