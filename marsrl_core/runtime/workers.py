"""Process-level work units that orchestration (Prefect tasks, the CLI) calls: one call each.

A worker process keeps one store connection, one engine (wrapped in a `BatchingEngine` so that
concurrent rollout tasks share segment batches) and one learner, created on first use; with its
first store it starts a `MemoryTrimmer` (every `malloc_trim_every_s` of that first config), so that a
long-running worker gives its allocator's free memory back. Rollout and
learner meet only through the store and the checkpoint files: an engine picks up a newer committed
version from the store (its checkpoint folder) at stage boundaries, so rollout and learner can live
in different processes or machines.

- `record_batch(cfg, run_id, b)`: the problems of batch `b` (synthetic or a dataset slice), stored.
- `rollout_turn(cfg, run_id, b, turn)`: decode turn `turn` of batch `b` to its end, unless
  `interrupt(run_id)` stops it at a stage boundary first (`RolloutInterrupted`).
- `interrupt(run_id)`: the process is stopping (a signal, a failed batch): its rollout turns stop
  at their next stage and its learner loop before its next step; `clear_interrupt` when a run starts.
- `mark_batch_done(cfg, run_id, b)`: record that batch `b` has ended (a resumed run skips it).
- `train_step(cfg, run_id)`: one learner step if enough complete groups are ready, else None.

Deliberate simplifications: caches are keyed by run and model, never evicted (a worker serves one
run at a time); with several rollout flows sharing an engine, the staleness bound is enforced per
flow, not across flows.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Any

import transformers  # noqa: F401  (imported here, once: lazy imports from several threads race)

from marsrl_core.agents.problems import LoadedProblems, Problem, load_problems
from marsrl_core.agents.roles import Roles
from marsrl_core.config import AGENTS, MarsRLConfig
from marsrl_core.demo.synthetic import make_problems
from marsrl_core.engines.batching import BatchingEngine
from marsrl_core.rollout.scheduler import RolloutScheduler
from marsrl_core.runtime import policy  # noqa: F401
from marsrl_core.runtime.memory import MemoryTrimmer
from marsrl_core.store import SegmentStore
from marsrl_core.store.process import StoreProcess

_lock = threading.RLock()
_stores: dict[tuple[str, str], SegmentStore | StoreProcess] = {}
_engines: dict[tuple[str, str], BatchingEngine] = {}
_learners: dict[str, Any] = {}
_trimmer: MemoryTrimmer | None = None
_interrupted: set[str] = set()  # runs whose rollout turns and learner loop in this process are stopping


def store_for(cfg: MarsRLConfig) -> SegmentStore | StoreProcess:
    """The process's store: in a child process of its own unless `store.separate_process` is off. The
    process's first call also starts its `MemoryTrimmer` (unless `malloc_trim_every_s` is None)."""
    global _trimmer
    key = (cfg.store.catalog_url, cfg.store.data_path)
    with _lock:
        if _trimmer is None and cfg.malloc_trim_every_s is not None:
            _trimmer = MemoryTrimmer(cfg.malloc_trim_every_s)
        if key not in _stores:
            kind = StoreProcess if cfg.store.separate_process else SegmentStore
            _stores[key] = kind.from_config(cfg.store)
        return _stores[key]


def close_stores() -> None:
    """Close the process's stores (and their child processes) and forget the learners that use them;
    the next `store_for` opens afresh."""
    with _lock:
        stores = list(_stores.values())
        _stores.clear()
        _learners.clear()
        for store in stores:
            store.close()


def engine_for(cfg: MarsRLConfig, agent: str = "policy") -> BatchingEngine:
    """The process's engine for `agent` ("policy" when one model serves all agents)."""
    from marsrl_core.runtime.policy import make_engine, policy_folder

    folder = policy_folder(cfg)
    key = (str(folder), cfg.engine.name, agent)
    with _lock:
        if key not in _engines:
            _engines[key] = BatchingEngine(make_engine(cfg, folder))
        return _engines[key]


def roles_for(cfg: MarsRLConfig) -> Roles:
    from marsrl_core.runtime.jobs import roles_from_config

    return roles_from_config(cfg)


def batch_problems(cfg: MarsRLConfig, batch_index: int) -> list[Problem]:
    n = cfg.rollout.problems_per_batch
    if cfg.data.train_dataset is None:
        return make_problems(
            n,
            cfg.seed * 100_003 + batch_index,
            prefix=f"b{batch_index}",
            min_terms=cfg.data.synthetic_min_terms,
            max_terms=cfg.data.synthetic_max_terms,
        )
    pool = _training_set(cfg.data.train_dataset, cfg.data.question_field, cfg.data.answer_field).problems
    return [
        Problem(f"b{batch_index}-{p.problem_id}", p.prompt, p.answer, p.source)
        for p in (pool[(batch_index * n + i) % len(pool)] for i in range(n))
    ]


@functools.lru_cache(maxsize=4)
def _training_set(path: str, question_field: str, answer_field: str) -> LoadedProblems:
    """The training file, read once per process (every turn task of every batch slices it)."""
    return load_problems(path, question_field=question_field, answer_field=answer_field)


def record_batch(cfg: MarsRLConfig, run_id: str, batch_index: int) -> int:
    store = store_for(cfg)
    problems = batch_problems(cfg, batch_index)
    if cfg.data.train_dataset is not None and batch_index == 0:  # the file's bad rows, recorded once a run
        rejected = _training_set(cfg.data.train_dataset, cfg.data.question_field, cfg.data.answer_field).rejected
        store.reject_many(run_id, [(r.source, r.location, r.reason, r.payload) for r in rejected])
    known = store.known_problems(run_id, [p.problem_id for p in problems])
    return store.add_problems(run_id, [p for p in problems if p.problem_id not in known])


def engines_for(cfg: MarsRLConfig) -> BatchingEngine | dict[str, BatchingEngine]:
    if cfg.learner.policies == "per_agent":
        return {agent: engine_for(cfg, agent) for agent in AGENTS}
    return engine_for(cfg)


def _latest_weights(store: SegmentStore, run_id: str, current_version: int, *, per_agent: bool):
    """(version, checkpoint folder or {agent: folder}) of a committed version newer than the engines'."""
    latest = store.latest_version(run_id)
    if latest is None or latest[0] <= current_version:
        return None
    version, uri = latest
    if per_agent:
        return version, {agent: Path(uri) / agent for agent in AGENTS}
    return version, Path(uri) / "policy"


def interrupt(run_id: str) -> None:
    """Stop `run_id`'s work in this process soon: rollout turns at their next stage boundary (they raise
    `RolloutInterrupted`; what they decoded is stored), the learner loop before its next step. Stays
    in force (later turns stop at once) until `clear_interrupt(run_id)`."""
    with _lock:
        _interrupted.add(run_id)


def interrupted(run_id: str) -> bool:
    return run_id in _interrupted


def clear_interrupt(run_id: str) -> None:
    """Forget an earlier `interrupt(run_id)`: called when the run's work starts in this process."""
    with _lock:
        _interrupted.discard(run_id)


def rollout_turn(cfg: MarsRLConfig, run_id: str, batch_index: int, turn: int) -> dict[str, int]:
    """Decode turn `turn` of batch `batch_index`; returns counts for the task's result."""
    store, engines = store_for(cfg), engines_for(cfg)
    tokenizer = engine_for(cfg, "solver" if isinstance(engines, dict) else "policy").tokenizer
    problems = batch_problems(cfg, batch_index)
    per_agent = cfg.learner.policies == "per_agent"
    scheduler = RolloutScheduler(
        cfg,
        store,
        run_id,
        engines,
        tokenizer,
        roles_for(cfg),
        iter(problems if turn == 0 else ()),
        seed=cfg.seed * 7919 + batch_index * 31 + turn,
        newer_policy=functools.partial(_latest_weights, store, run_id, per_agent=per_agent),
        interrupted=functools.partial(interrupted, run_id),
    )
    scheduler.resume({p.problem_id: p for p in problems})
    try:
        reports = scheduler.run_turn(turn)
    finally:  # the samples form reference cycles: free them now, not at the collector's next full pass
        scheduler.release()
    return {
        "stages": len(reports),
        "tokens": sum(r.tokens for r in reports),
        "finished": sum(r.finished for r in reports),
        "new_samples": sum(r.new_samples for r in reports),
    }


def learner_for(cfg: MarsRLConfig, run_id: str, tracker: Any = None):
    from marsrl_core.learn.learner import Learner
    from marsrl_core.runtime.policy import policy_folder

    with _lock:
        if run_id not in _learners:
            from transformers import AutoTokenizer

            folder = policy_folder(cfg)
            learner = Learner(
                cfg,
                store_for(cfg),
                run_id,
                folder,
                Path(cfg.output_dir) / "checkpoints" / run_id,
                AutoTokenizer.from_pretrained(folder),
                tracker,
            )
            learner.resume()
            _learners[run_id] = learner
        return _learners[run_id]


def train_step(cfg: MarsRLConfig, run_id: str, flush: bool = False, tracker: Any = None) -> dict[str, Any] | None:
    """One learner step on ready groups; None when not enough are ready yet. Uses the groups that
    `groups_ready` just found for this learner step, if any, instead of querying again."""
    from marsrl_core.learn.pipeline import ready_groups

    learner = learner_for(cfg, run_id, tracker)
    with _lock:
        found = _ready.pop(run_id, None)
    groups = found[1] if found is not None and found[0] == (learner.step, flush) else ready_groups(learner, flush=flush)
    if not groups:
        return None
    try:
        report = learner.train_step(groups)
    except BaseException:
        # The update may have been applied in memory but not committed: drop this learner so a retry
        # rebuilds it from the last committed version (and its uncommitted folder is cleaned up).
        with _lock:
            _learners.pop(run_id, None)
        raise
    return {"step": report.step, "checkpoint": str(report.checkpoint), "metrics": report.metrics}


_trackers: dict[str, Any] = {}


def tracker_for(cfg: MarsRLConfig, run_id: str):
    """The MLflow run of a training run (one per run and process)."""
    from marsrl_core.runtime.tracking import Tracker

    with _lock:
        if run_id not in _trackers:
            _trackers[run_id] = Tracker(cfg.tracking, run_id, cfg.model_dump(mode="json"))
        return _trackers[run_id]


_ready: dict[str, tuple[tuple[int, bool], list]] = {}  # run id -> ((learner step, flush), groups found)


def groups_ready(cfg: MarsRLConfig, run_id: str, flush: bool = False) -> bool:
    """Whether a learner step can run now. The groups found are kept for the `train_step` that follows
    (only this process's learner consumes them, so they stay valid until its next step): the learner's
    poll and its step cost one store query, not two."""
    from marsrl_core.learn.pipeline import ready_groups

    learner = learner_for(cfg, run_id, tracker_for(cfg, run_id))
    groups = ready_groups(learner, flush=flush)
    with _lock:
        if groups:
            _ready[run_id] = ((learner.step, flush), groups)
        else:
            _ready.pop(run_id, None)
    return bool(groups)


def evaluate(cfg: MarsRLConfig, run_id: str, label: str, checkpoint: str | None = None) -> dict[str, float]:
    """Evaluate a policy (the starting one, or a checkpoint folder) and record it in the store."""
    from marsrl_core.runtime.jobs import evaluate_policy

    folder = None if checkpoint is None else Path(checkpoint)
    report = evaluate_policy(cfg, store_for(cfg), run_id, label, folder=folder)
    if run_id in _trackers:
        _trackers[run_id].log_metrics({f"eval_{label}/{k}": v for k, v in report.as_dict().items()})
    return report.as_dict()


def log_reward_curves(cfg: MarsRLConfig, run_id: str) -> None:
    """Plot the run's per-agent reward curves and log the PNG to its MLflow run."""
    from matplotlib import pyplot as plt

    from marsrl_core.runtime.plots import reward_curves

    figure = reward_curves(store_for(cfg), run_id)
    tracker_for(cfg, run_id).log_figure(figure, "reward_curves.png")
    plt.close(figure)


def resumed_config(cfg: MarsRLConfig, run_id: str) -> MarsRLConfig:
    """The config a run was started with, read from the store that `cfg` points at (for --resume)."""
    from marsrl_core.config import ConfigError, build_config

    stored = store_for(cfg).run_config(run_id)
    if stored is None:
        raise ConfigError(f"--resume {run_id!r}: no such run in the store {cfg.store.catalog_url!r}")
    return build_config(stored)


STOP_REQUESTED = "stop_requested"  # run event: a split run's rollout side stops before its next batch


def batch_done_event(batch_index: int) -> str:
    return f"batch_done:{batch_index}"


def mark_batch_done(cfg: MarsRLConfig, run_id: str, batch_index: int) -> None:
    store_for(cfg).mark(run_id, batch_done_event(batch_index))


def start_run(cfg: MarsRLConfig, run_id: str) -> None:
    """Record a new run (idempotent: a resumed run keeps its row)."""
    store = store_for(cfg)
    if not store.query("SELECT 1 FROM runs WHERE run_id = ?", [run_id]).num_rows:
        store.create_run(run_id, cfg.model_dump(mode="json"))
