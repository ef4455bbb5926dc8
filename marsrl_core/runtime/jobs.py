"""Evaluation jobs behind `marsrl eval` and the evaluate flow.

- `evaluate_policy`: Solver, Verifier, Corrector and V-C metrics of a policy on a dataset (or on
  held-out synthetic problems), recorded in the store's `evaluations` table;
- `print_report`: the before/after table;
- `train_summary`: a training run's figures under the keys of `benchmarks/results/train.json`.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from marsrl_core.agents.evaluation import EvalReport, evaluate
from marsrl_core.agents.problems import Problem, load_problems
from marsrl_core.agents.roles import DEFAULT_TEMPLATES, TINY_TEMPLATES, Roles
from marsrl_core.config import AGENTS, MarsRLConfig
from marsrl_core.demo.synthetic import make_problems
from marsrl_core.engines.base import SamplingParams, TextGenerator, derive_seed
from marsrl_core.runtime.policy import make_engine, policy_folder
from marsrl_core.store import SegmentStore

HELD_OUT_SEED_OFFSET = 10_000  # held-out synthetic problems never share a generator seed with training


def roles_from_config(cfg: MarsRLConfig) -> Roles:
    base = TINY_TEMPLATES if cfg.roles.templates == "tiny" else DEFAULT_TEMPLATES
    return Roles.from_config(
        {"solver": cfg.roles.solver, "verifier": cfg.roles.verifier, "corrector": cfg.roles.corrector}, base=base
    )


def evaluation_problems(cfg: MarsRLConfig, store: SegmentStore, run_id: str, tokenizer) -> list[Problem]:
    ev = cfg.evaluation
    if ev.dataset is None:
        return make_problems(ev.num_problems, cfg.seed + HELD_OUT_SEED_OFFSET, prefix="heldout")
    loaded = load_problems(
        ev.dataset,
        question_field=ev.question_field,
        answer_field=ev.answer_field,
        count_tokens=lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]),
        max_prompt_tokens=cfg.model.max_prompt_tokens,
    )
    store.reject_many(run_id, [(r.source, r.location, r.reason, r.payload) for r in loaded.rejected])
    return loaded.problems[: ev.num_problems]


def print_report(console: Console, reports: dict[str, EvalReport | dict]) -> None:
    table = Table(title="evaluation (avg@k, held-out problems)")
    table.add_column("measure")
    for label in reports:
        table.add_column(label)
    rows = [
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
    for name, key in rows:
        # a dict is a recorded evaluation: one recorded before a measure existed lacks it
        values = [r.get(key, math.nan) if isinstance(r, dict) else getattr(r, key) for r in reports.values()]
        table.add_row(
            name,
            *["n/a" if math.isnan(v) else (f"{v:.0f}" if key.startswith("tokens") else f"{v:.1%}") for v in values],
        )
    console.print(table)


def evaluation_generators(cfg: MarsRLConfig, folder: Path) -> dict[str, TextGenerator]:
    """One text generator per agent for the policy in `folder`: a model folder, or a learner checkpoint
    (its `policy` model, or one model per agent for `per_agent`). Agents that share a model share a
    generator. Separate generators get separate seed streams: generators that share a seed draw the
    same noise on their n-th call, and a Corrector drawing the Solver's noise repeats its mistakes (a
    repair is written token for token in the solution's format)."""
    if (folder / "config.json").is_file():
        folders = {agent: folder for agent in AGENTS}
    else:
        shared = (folder / "policy").is_dir()
        folders = {agent: folder / ("policy" if shared else agent) for agent in AGENTS}
    ev = cfg.evaluation
    generators = {}
    for stream, path in enumerate(sorted(set(folders.values()))):
        engine = make_engine(cfg, path)
        generators[path] = TextGenerator(
            engine,
            engine.tokenizer,
            cfg.rollout.segment_tokens,
            SamplingParams(temperature=ev.temperature, seed=derive_seed(cfg.seed, stream)),
        )
    return {agent: generators[path] for agent, path in folders.items()}


def evaluate_policy(
    cfg: MarsRLConfig, store: SegmentStore, run_id: str, label: str, folder: Path | None = None
) -> EvalReport:
    """Evaluate a policy (see `evaluation_generators` for `folder`; the run's starting policy when None)
    and record the metrics."""
    generator = evaluation_generators(cfg, Path(folder) if folder is not None else policy_folder(cfg))
    ev = cfg.evaluation
    problems = evaluation_problems(cfg, store, run_id, generator["solver"].tokenizer)
    budgets = {agent: cfg.rollout.max_tokens(agent) for agent in ("solver", "verifier", "corrector")}
    start = time.perf_counter()
    report = evaluate(
        generator,
        roles_from_config(cfg),
        problems,
        k=ev.k,
        max_tokens=budgets,
        accept_after=ev.accept_after,
        max_rounds=ev.max_rounds,
    )
    metrics = report.as_dict() | {"wall_clock_s": time.perf_counter() - start}
    store.record_evaluation(run_id, label, ev.dataset or "synthetic-heldout", metrics)
    return report


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
        "wall_clock_s": wall_clock_s,
        "learner_steps": int(result.get("learner_steps", 0)),
        "seed": seed,
    }
