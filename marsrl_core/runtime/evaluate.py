"""Evaluating a policy behind `marsrl eval` and the evaluate flow: Solver, Verifier, Corrector and V-C
metrics on a dataset (or on held-out synthetic problems), recorded in the store's `evaluations` table.

The policy is a model folder or a learner checkpoint version (`agent_folders`); the run's starting
policy when none is given. Held-out synthetic problems are generated from a seed that no training
batch uses.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from marsrl_core.agents.evaluation import EvalReport, evaluate
from marsrl_core.agents.problems import Problem, load_problems
from marsrl_core.config import AGENTS, MarsRLConfig
from marsrl_core.demo.synthetic import make_problems
from marsrl_core.engines.base import SamplingParams, TextGenerator, derive_seed
from marsrl_core.learn.checkpoint_folders import agent_folders
from marsrl_core.policy import make_engine, policy_folder, roles_from_config
from marsrl_core.runtime.context import runtime
from marsrl_core.store import Rejection, Store

HELD_OUT_SEED_OFFSET = 10_000  # held-out synthetic problems never share a generator seed with training


def evaluation_problems(cfg: MarsRLConfig, store: Store, run_id: str, tokenizer) -> list[Problem]:
    ev = cfg.evaluation
    if ev.dataset is None:
        # the synthetic task's held-out problems, in the form it trains on (`data.verifier`)
        code = cfg.data.verifier == "code"
        return make_problems(ev.num_problems, cfg.seed + HELD_OUT_SEED_OFFSET, prefix="heldout", code=code)
    loaded = load_problems(
        ev.dataset,
        question_field=ev.question_field,
        answer_field=ev.answer_field,
        count_tokens=lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]),
        max_prompt_tokens=cfg.model.max_prompt_tokens,
        verifier=ev.verifier,
    )
    store.reject(run_id, loaded.rejected)
    return loaded.problems[: ev.num_problems]


def evaluation_generators(cfg: MarsRLConfig, folder: Path) -> dict[str, TextGenerator]:
    """One text generator per agent for the policy in `folder`: a model folder, or a learner checkpoint
    (its `policy` model, or one model per agent for `per_agent`). Agents that share a model share a
    generator. Separate generators get separate seed streams: generators that share a seed draw the
    same noise on their n-th call, and a Corrector drawing the Solver's noise repeats its mistakes (a
    repair is written token for token in the solution's format)."""
    folders = agent_folders(folder)
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


def resolve_checkpoint(cfg: MarsRLConfig, store: Store, spec: str | None) -> tuple[Path | None, str]:
    """The policy `marsrl eval --checkpoint SPEC` evaluates, and how to name it: a folder (a model, or a
    learner version with its agents' folders), `RUN` (that run's newest committed version) or
    `RUN:VERSION`; with no SPEC the newest committed version of the store's most recent run, else the
    starting policy (`model.path`, the tiny preset's warm start, or a fresh tiny model). None: the
    starting policy's folder is resolved by `evaluate_policy` itself."""
    from marsrl_core.learn.checkpoint_folders import CheckpointError

    if spec is None:
        newest = store.query(
            "SELECT run_id, version, checkpoint_uri FROM policy_versions ORDER BY created_at DESC, version DESC LIMIT 1"
        ).to_pylist()
        if newest:
            row = newest[0]
            return Path(row["checkpoint_uri"]), f"run {row['run_id']} version {row['version']} (the newest)"
        if cfg.model.path is None and cfg.sft.enabled:
            from marsrl_core.demo.sft import find_warm_start

            warm = find_warm_start(cfg)
            if warm is not None:
                return warm, f"the {cfg.preset} preset's warm start {warm}"
        return None, f"the starting policy ({cfg.model.path or 'a tiny model built from the config'})"
    if Path(spec).is_dir():
        return Path(spec), f"folder {spec}"
    run_id, _, version = spec.partition(":")
    if version:
        if not version.isdigit():
            raise CheckpointError(f"--checkpoint {spec!r}: the version after ':' must be a number")
        rows = store.query(
            "SELECT checkpoint_uri FROM policy_versions WHERE run_id = ? AND version = ?", [run_id, int(version)]
        ).to_pylist()
        if not rows:
            raise CheckpointError(f"--checkpoint {spec!r}: run {run_id!r} has no committed version {version}")
        return Path(rows[0]["checkpoint_uri"]), f"run {run_id} version {version}"
    latest = store.latest_version(run_id)
    if latest is None:
        raise CheckpointError(
            f"--checkpoint {spec!r}: not a folder, and no run of that name has a committed version in the store "
            f"{cfg.store.catalog_url!r}"
        )
    return Path(latest[1]), f"run {run_id} version {latest[0]} (its newest)"


def evaluate_policy(
    cfg: MarsRLConfig, store: Store, run_id: str, label: str, folder: Path | None = None, progress: Any = None
) -> EvalReport:
    """Evaluate a policy (see `evaluation_generators` for `folder`; the run's starting policy when None)
    and record the metrics; `progress` (`runtime.progress.Progress`) sees each phase and segment."""
    generator = evaluation_generators(cfg, Path(folder) if folder is not None else policy_folder(cfg))
    ev = cfg.evaluation
    problems = evaluation_problems(cfg, store, run_id, generator["solver"].tokenizer)
    budgets = {agent: cfg.rollout.max_tokens(agent) for agent in AGENTS}
    start = time.perf_counter()
    report = evaluate(
        generator,
        roles_from_config(cfg),
        problems,
        k=ev.k,
        max_tokens=budgets,
        accept_after=ev.accept_after,
        max_rounds=ev.max_rounds,
        progress=progress,
        checker=runtime().checker(cfg, run_id),
    )
    metrics = report.as_dict() | {"wall_clock_s": time.perf_counter() - start}
    context = generator["solver"].context
    store.reject(
        run_id,
        [
            Rejection(
                f"evaluation:{problem_id}",
                f"{label}: {agent}",
                f"{agent} prompt of {tokens} tokens + budget {budgets[agent]} exceeds the engine context of {context}",
            )
            for agent, problem_id, tokens in report.skipped_prompts
        ],
    )
    store.record_evaluation(run_id, label, ev.dataset or "synthetic-heldout", metrics)
    return report
