"""What a run prints and writes: the before/after table and the figures of `benchmarks/results/train.json`."""

from __future__ import annotations

import math
import statistics

from rich.console import Console
from rich.table import Table

from marsrl_core.agents.evaluation import EvalReport

MEASURES = [
    ("Solver accuracy", "solver_acc"),
    ("Verifier balanced accuracy", "verifier_bal_acc"),
    ("Verifier: wrong solutions caught", "verifier_recall"),
    ("Verifier precision (Wrong)", "verifier_precision"),
    ("Corrector fix rate", "corrector_fix"),
    ("Corrector break rate", "corrector_break"),
    ("Corrector break rate after a false flag", "corrector_break_false_flag"),
    ("V-C system accuracy", "vc_acc"),
    ("tokens per problem", "tokens_per_problem"),
]


# Per-agent counts that say why a measure is low, as (EvalReport count, row label); a row appears when
# any report has a case.
COUNTS = [
    ("truncated", "outputs cut by their budget"),
    ("unparsable", "outputs with no answer or verdict"),
    ("skipped", "prompts skipped as too long"),
]


def report_rows(reports: dict[str, EvalReport | dict]) -> list[list[str]]:
    """The before/after table's rows (the measure, then one value per report): a measure with no cases
    is "n/a"; truncated and unparsable outputs, and prompts skipped as too long, are counted per agent."""
    # a dict is a recorded evaluation: one recorded before a measure existed lacks it
    dicts = [r if isinstance(r, dict) else r.as_dict() for r in reports.values()]
    rows = []
    for name, key in MEASURES:
        values = [d.get(key, math.nan) for d in dicts]
        rows.append(
            [
                name,
                *["n/a" if math.isnan(v) else (f"{v:.0f}" if key.startswith("tokens") else f"{v:.1%}") for v in values],
            ]
        )
    for count, label in COUNTS:
        for key in sorted({k for d in dicts for k, v in d.items() if k.startswith(f"{count}_") and v}):
            rows.append([f"{label}: {key.removeprefix(count + '_')}", *[f"{d.get(key, 0):.0f}" for d in dicts]])
    return rows


def print_report(console: Console, reports: dict[str, EvalReport | dict]) -> None:
    table = Table(title="evaluation (avg@k, held-out problems)")
    table.add_column("measure")
    for label in reports:
        table.add_column(label)
    for row in report_rows(reports):
        table.add_row(*row)
    console.print(table)


def report_markdown(
    run_id: str, reports: dict[str, EvalReport | dict], curves_uri: str | None = None, timeline_uri: str | None = None
) -> str:
    """The before/after table in Markdown (a Prefect artifact of the run), with links to the reward curves
    and the run's timeline."""
    lines = [f"# MarsRL run {run_id}", "", "| measure | " + " | ".join(reports) + " |"]
    lines.append("|---" * (len(reports) + 1) + "|")
    lines += ["| " + " | ".join(row) + " |" for row in report_rows(reports)]
    if curves_uri:
        lines += ["", f"Per-agent reward curves (an MLflow artifact): [{curves_uri}]({curves_uri})"]
    if timeline_uri:
        lines += ["", f"The run's timeline (an MLflow artifact): [{timeline_uri}]({timeline_uri})"]
    return "\n".join(lines)


def train_summary(result: dict, seed: int, wall_clock_s: float) -> dict[str, float | int]:
    """The train.json figures of a train-flow result (accuracies as fractions; NaN where not measured)."""
    before, after = result.get("before") or {}, result.get("after") or {}
    nan = math.nan
    return {
        "solver_acc_before": before.get("solver_acc", nan),
        "solver_acc_after": after.get("solver_acc", nan),
        "verifier_bal_acc_before": before.get("verifier_bal_acc", nan),
        "verifier_bal_acc_after": after.get("verifier_bal_acc", nan),
        "verifier_wrong_caught_after": after.get("verifier_recall", nan),
        "corrector_fix_before": before.get("corrector_fix", nan),
        "corrector_fix_after": after.get("corrector_fix", nan),
        "corrector_break_after": after.get("corrector_break", nan),
        "vc_acc_before": before.get("vc_acc", nan),
        "vc_acc_after": after.get("vc_acc", nan),
        "stale_drop_fraction": (result.get("samples") or {}).get("stale_drop_fraction", nan),
        "wall_clock_s": wall_clock_s,
        "learner_steps": int(result.get("learner_steps", 0)),
        "seed": seed,
    }


# The measures of an ablation's table: (row name, train_summary key); accuracies are fractions.
SPREAD_MEASURES = [
    ("Solver accuracy", "solver_acc_after"),
    ("Verifier balanced accuracy", "verifier_bal_acc_after"),
    ("Verifier: wrong solutions caught", "verifier_wrong_caught_after"),
    ("Corrector fix rate", "corrector_fix_after"),
    ("Corrector break rate", "corrector_break_after"),
    ("V-C system accuracy", "vc_acc_after"),
    ("dropped untrained (stale or masked)", "stale_drop_fraction"),
    ("train and evaluation wall-clock (s)", "wall_clock_s"),
]


def spread(runs: list[dict]) -> dict:
    """One variant's runs (train_summary dicts, one per seed) as `seeds`, per-key `mean` and `sd` (NaN
    for one seed, or where a run did not measure the key) and the `runs` themselves."""
    keys = [k for k in runs[0] if k != "seed"]
    mean, sd = {}, {}
    for key in keys:
        values = [float(run[key]) for run in runs]
        if any(math.isnan(v) for v in values):  # statistics' exact sums take no NaN
            mean[key] = sd[key] = math.nan
            continue
        mean[key] = statistics.mean(values)
        sd[key] = statistics.stdev(values) if len(values) > 1 else math.nan
    return {"seeds": len(runs), "mean": mean, "sd": sd, "runs": runs}


def print_spread(console: Console, variants: dict[str, dict]) -> None:
    """The ablation table: one column per variant, each cell the mean ± sd over its seeds."""
    seeds = sorted({v["seeds"] for v in variants.values()})
    table = Table(title=f"after training, mean ± sd over {'/'.join(map(str, seeds))} seed(s)")
    table.add_column("measure")
    for name in variants:
        table.add_column(name)
    for label, key in SPREAD_MEASURES:
        cells = []
        for v in variants.values():
            m, s = v["mean"][key], v["sd"][key]
            scale, fmt = (1, "{:.0f}") if key == "wall_clock_s" else (100, "{:.1f}")
            text = (
                "n/a"
                if math.isnan(m)
                else fmt.format(m * scale) + ("" if math.isnan(s) else " ± " + fmt.format(s * scale))
            )
            cells.append(text + ("%" if scale == 100 and not math.isnan(m) else ""))
        table.add_row(label, *cells)
    console.print(table)
