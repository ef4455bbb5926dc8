"""Seed-to-seed spread of the CI learning run, to set the margins of tests/test_learning.py.

Runs the short learning run of `tests/configs.learning_config` (committed warm start, 50 learner steps,
512 held-out problems x 2 before and after) once per seed. The seed changes the held-out problems,
the evaluation's sampling and the RL run's sampling; the warm start stays the same. It reports, for
the Solver's accuracy and the Verifier's balanced accuracy, the mean and standard deviation over seeds
of the measure before, after, and of the gain.

The spread of the measure before training is the noise of one evaluation of a fixed policy (the
problems and the sampling change with the seed; the policy does not). If training changed nothing,
the measure after would be another such evaluation, and a gain the difference of two, with standard
deviation `sqrt(2) * sd_before`. The test asserts on the mean gain of two seeds, whose standard
deviation under that null is `sd_before`; its margin is two of those, `margin = 2 * sd_before` (what
this script writes; `margin_one_run = 2 * sqrt(2) * sd_before` is the same bar for a single run). The
spread after adds the run's own randomness (the pipelined learner trains on whatever is ready);
`gain_sds_above_margin`, `(gain_mean - margin) / (gain_sd / sqrt(2))`, says how rarely a mean of two
runs should fall below the margin by chance.

Writes benchmarks/results/learning_spread.json: seeds, runs (per seed), and per measure the mean/sd of
before, after and gain, and the margin. Run: `python benchmarks/learning_spread.py --seeds 5`
(about 100 s of training and evaluation per seed on 2 CPU cores). With `--set key=value` it measures a
variant of the run instead and writes learning_spread_variant.json (as does `--first-seed`; how
`learner.downstream_groups_per_step=8` was compared before the tiny preset took it); `--name` names
the file instead. The Corrector's fix and break rates and the V-C accuracy are summarised the same
way, to compare variants on them (the test's margins use the Solver and the Verifier), as are the
wrong solutions the Verifier caught and the break rate after a false flag.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

from benchmarks.common import print_rows, write_results  # noqa: E402
from marsrl_core.cli import add_overrides_option  # noqa: E402

MEASURES = {
    "solver": "solver_acc",
    "verifier": "verifier_bal_acc",
    "verifier_caught": "verifier_recall",
    "corrector_fix": "corrector_fix",
    "corrector_break": "corrector_break",
    "corrector_break_false_flag": "corrector_break_false_flag",
    "vc": "vc_acc",
}


def run_seed(seed: int, extra: list[str] | None = None) -> dict[str, float]:
    from flows.train import train_flow
    from tests.configs import learning_config

    with tempfile.TemporaryDirectory(prefix=f"marsrl-spread-{seed}-") as tmp:
        start = time.perf_counter()
        result = train_flow(learning_config(tmp, seed, extra))
        row = {"seed": seed, "learner_steps": result["learner_steps"], "wall_clock_s": time.perf_counter() - start}
        row["stale_drop_fraction"] = result["samples"]["stale_drop_fraction"]
        row["trained_age_max"] = result["samples"]["trained_age_max"]
        row["trained_age_mean"] = result["samples"]["trained_age_mean"]
        for name, key in MEASURES.items():
            row[f"{name}_before"], row[f"{name}_after"] = result["before"][key], result["after"][key]
        return row


def summarise(runs: list[dict]) -> dict[str, dict[str, float]]:
    summary = {}
    for name in MEASURES:
        before = [r[f"{name}_before"] for r in runs]
        after = [r[f"{name}_after"] for r in runs]
        gain = [a - b for a, b in zip(after, before)]
        sd_before, sd_after = statistics.stdev(before), statistics.stdev(after)
        summary[name] = {
            "before_mean": statistics.mean(before),
            "before_sd": sd_before,
            "after_mean": statistics.mean(after),
            "after_sd": sd_after,
            "gain_mean": statistics.mean(gain),
            "gain_sd": statistics.stdev(gain),
            "gain_min": min(gain),
            "margin": 2 * sd_before,
            "margin_one_run": 2 * 2**0.5 * sd_before,
        }
        mean_of_two_sd = summary[name]["gain_sd"] / 2**0.5
        summary[name]["gain_sds_above_margin"] = (summary[name]["gain_mean"] - summary[name]["margin"]) / max(
            mean_of_two_sd, 1e-9
        )
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="How many seeds from --first-seed (at least 2).")
    add_overrides_option(
        parser,
        "Override a field of the learning run (repeatable), to compare a variant's spread; the figures then "
        "go to learning_spread_variant.json, not the margins' file.",
    )
    parser.add_argument("--first-seed", type=int, default=0, help="The first seed.")
    parser.add_argument(
        "--name",
        help="Results file name (default: learning_spread, or learning_spread_variant with --set or --first-seed).",
    )
    args = parser.parse_args()
    runs = [run_seed(seed, args.overrides) for seed in range(args.first_seed, args.first_seed + max(2, args.seeds))]
    summary = summarise(runs)
    print_rows(
        "the learning run, per seed",
        ["seed", "Solver before", "Solver after", "Verifier before", "Verifier after", "stale dropped", "wall-clock s"],
        [
            [
                r["seed"],
                r["solver_before"],
                r["solver_after"],
                r["verifier_before"],
                r["verifier_after"],
                r["stale_drop_fraction"],
                r["wall_clock_s"],
            ]
            for r in runs
        ],
    )
    print_rows(
        "spread over seeds",
        [
            "measure",
            "before mean ± sd",
            "after mean ± sd",
            "gain mean ± sd",
            "smallest gain",
            "margin (mean of 2)",
            "gain - margin (sds of a mean of 2)",
        ],
        [
            [
                name,
                f"{s['before_mean']:.3f} ± {s['before_sd']:.3f}",
                f"{s['after_mean']:.3f} ± {s['after_sd']:.3f}",
                f"{s['gain_mean']:.3f} ± {s['gain_sd']:.3f}",
                s["gain_min"],
                s["margin"],
                s["gain_sds_above_margin"],
            ]
            for name, s in summary.items()
        ],
    )
    name = args.name or ("learning_spread_variant" if args.overrides or args.first_seed else "learning_spread")
    drops = [r["stale_drop_fraction"] for r in runs]
    stale = {"mean": statistics.mean(drops), "sd": statistics.stdev(drops)}
    print(f"samples dropped untrained (stale or masked) over those consumed: {stale['mean']:.3f} ± {stale['sd']:.3f}")
    results = {"seeds": len(runs), "overrides": args.overrides, "runs": runs, **summary, "stale_drop_fraction": stale}
    path = write_results(name, results)
    print(f"figures written to {path}")


if __name__ == "__main__":
    main()
