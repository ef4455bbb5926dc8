"""The units of work that orchestration calls (a Prefect task each, or a flow's cheap question), run
on this process's `Runtime`. They take the config and ids and return small results; what crosses from
one to the next goes through the store.

- `check_inputs(cfg)`: fail at once, with one line, on a dataset the run cannot use.
- `start_run`, `resumed_config`: record a run; read back the config it was started with.
- `record_batch(cfg, run_id, b)`: the problems of batch `b` (`runtime.batches`), stored.
- `start_batch`, `turn_starts`, `rollout_turn`, `end_batch`: batch `b` in the run's decode loop
  (`rollout/loop.py`): it joins, a turn's first group starts, a turn's last group finishes, the batch
  ends (and is marked done, so a resumed run skips it).
- `ready_groups(cfg, run_id, flush)`: the groups a learner step would take now (the learner flow's poll).
- `train_step(cfg, run_id, groups)`: one learner step on those groups (or on what is ready).
- `evaluate`, `log_reward_curves`, `log_timeline`, `compact`: evaluation before/after, MLflow's reward
  curves and timeline, and store maintenance.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from marsrl_core.agents.problems import DatasetError
from marsrl_core.config import AGENTS, ConfigError, MarsRLConfig, build_config, migrate_renamed
from marsrl_core.divergence import PolicyDiverged
from marsrl_core.learn.checkpoint_folders import agent_folders, checkpoint_root
from marsrl_core.learn.groups import ready_groups as _ready_groups
from marsrl_core.policy import policy_folder, roles_from_config
from marsrl_core.rollout.gate import AdmissionGate
from marsrl_core.rollout.loop import RolloutLoop
from marsrl_core.rollout.scheduler import RolloutScheduler
from marsrl_core.runtime import events
from marsrl_core.runtime.batches import batch_problems, training_rejections, training_set
from marsrl_core.runtime.context import runtime
from marsrl_core.store import Store, TrainableGroup
from marsrl_core.timings import timed


def check_inputs(cfg: MarsRLConfig) -> None:
    """Raise DatasetError (naming the file) before any work starts when the training file is missing or
    has no good row, or the benchmark file is missing; the training file is loaded (and kept) here."""
    if cfg.data.train_dataset is not None:
        training_set(cfg)
    if cfg.evaluation.dataset is not None and not Path(cfg.evaluation.dataset).exists():
        raise DatasetError(f"evaluation.dataset={cfg.evaluation.dataset!r}: no such file")


def start_run(cfg: MarsRLConfig, run_id: str) -> None:
    """Record a new run (idempotent: a resumed run keeps its row)."""
    store = runtime().store(cfg)
    if store.run_config(run_id) is None:
        store.create_run(run_id, cfg.model_dump(mode="json"))


def resumed_config(cfg: MarsRLConfig, run_id: str) -> MarsRLConfig:
    """The config a run was started with, read from the store that `cfg` points at (for --resume), with
    that store kept: the one the user pointed at, wherever the run began."""
    stored = runtime().store(cfg).run_config(run_id)
    if stored is None:
        raise ConfigError(f"--resume {run_id!r}: no such run in the store {cfg.store.catalog_url!r}")
    return build_config({**migrate_renamed(stored), "store": cfg.store.model_dump(mode="json")})


def record_batch(cfg: MarsRLConfig, run_id: str, batch_index: int) -> int:
    """Store the problems of batch `batch_index` (those not stored yet); the training file's bad rows are
    recorded with the first batch."""
    store = runtime().store(cfg)
    problems = batch_problems(cfg, batch_index)
    if batch_index == 0:
        store.reject(run_id, training_rejections(cfg))
    return store.add_problems(run_id, problems)


def _sync_from_memory(cfg: MarsRLConfig, learner: Any) -> bool:
    """Whether the learner hands its versions to this process's engines from memory (`engine.weight_sync`)."""
    if cfg.engine.name == "openai" or learner.ranks is not None or cfg.engine.weight_sync == "checkpoint":
        return False
    if cfg.engine.name == "vllm" and cfg.engine.tensor_parallel_size > 1:  # its workers are other processes
        return False
    return cfg.engine.weight_sync == "memory" or learner.device.type != "cpu"


def _serve_run(cfg: MarsRLConfig, store: Store, run_id: str, engines: Any) -> None:
    """The process's engines hold `run_id`'s newest committed weights (or the starting ones) before its
    rollout decodes: an engine an earlier run of this process left on its own weights is reloaded."""
    by_agent = engines if isinstance(engines, dict) else {"solver": engines}
    if all(engine.run_id == run_id for engine in by_agent.values()):
        return
    latest = store.latest_version(run_id)
    folders = agent_folders(Path(latest[1])) if latest else dict.fromkeys(by_agent, policy_folder(cfg))
    for agent, engine in by_agent.items():
        engine.serve_run(run_id, latest[0] if latest else 0, folders[agent])


def _make_scheduler(cfg: MarsRLConfig, run_id: str) -> RolloutScheduler:
    """The run's scheduler on this process's engines, paced by the learner (`AdmissionGate`) unless the
    run is synchronous or `learner.max_trained_age` is None."""
    rt = runtime()
    store, engines = rt.store(cfg), rt.engines(cfg)
    _serve_run(cfg, store, run_id, engines)
    tokenizer = (engines["solver"] if isinstance(engines, dict) else engines).tokenizer
    age = cfg.learner.max_trained_age
    gate = None
    if not cfg.rollout.synchronous and age is not None:
        gate = AdmissionGate(store, run_id, cfg.learner.groups_per_step_by_agent(), age)
    return RolloutScheduler(
        cfg,
        store,
        run_id,
        engines,
        tokenizer,
        roles_from_config(cfg),
        seed=cfg.seed * 7919,
        weights=rt.weight_channel(cfg, run_id),
        gate=gate,
        checker=rt.checker(cfg, run_id),
    )


def rollout_loop(cfg: MarsRLConfig, run_id: str) -> RolloutLoop:
    """The run's decode loop in this process."""
    return runtime().rollout_loop(cfg, run_id, functools.partial(_make_scheduler, cfg, run_id))


def start_batch(cfg: MarsRLConfig, run_id: str, batch_index: int, recorded: int | None = None) -> None:
    """Batch `batch_index` joins the run's decode loop: stored samples resume, new problems wait to be
    admitted. `recorded`: how many of its problems `record_batch` recorded just now; all of them means
    nothing of the batch is stored, and the loop skips the resume's query."""
    problems = batch_problems(cfg, batch_index)
    rollout_loop(cfg, run_id).add_batch(batch_index, problems, new=recorded == len(problems))


def turn_starts(cfg: MarsRLConfig, run_id: str, batch_index: int, turn: int) -> bool:
    """Wait until turn `turn` of the batch has its first group (True) or never will (False)."""
    progress = rollout_loop(cfg, run_id).wait(batch_index, lambda p: p.started(turn) or p.final(turn))
    return progress.started(turn)


def rollout_turn(cfg: MarsRLConfig, run_id: str, batch_index: int, turn: int) -> dict[str, int]:
    """Wait until every group of turn `turn` of the batch has finished; its samples, finished samples
    and tokens. The decode loop does the decoding; this is the turn's span of it."""
    try:
        progress = rollout_loop(cfg, run_id).wait(batch_index, lambda p: p.final(turn))
    except PolicyDiverged as exc:  # the loop has ended: every process of the run stops
        runtime().store(cfg).mark(run_id, events.DIVERGED, str(exc))
        return {"diverged": str(exc)}
    return {"samples": progress.samples[turn], "finished": progress.finished[turn], "tokens": progress.tokens[turn]}


def rollout_stats(cfg: MarsRLConfig, run_id: str) -> dict[str, float]:
    """The run's decode loop in this process: stages run, their mean decode batch (samples), restarts."""
    loop = rollout_loop(cfg, run_id)
    sizes = loop.decode_batch_sizes
    return {
        "stages": loop.stages,
        "decode_batch_mean": sum(sizes) / len(sizes) if sizes else 0.0,
        "restarts": loop.restarts,
    }


def end_batch(cfg: MarsRLConfig, run_id: str, batch_index: int) -> bool:
    """Wait until nothing of the batch decodes or waits; mark it done (a resumed run skips it) if all
    its problems were decoded, and let the loop forget it. Whether it was complete."""
    loop = rollout_loop(cfg, run_id)
    progress = loop.wait(batch_index, lambda p: p.ended)
    if progress.complete:
        runtime().store(cfg).mark(run_id, events.batch_done(batch_index))
    loop.forget_batch(batch_index)
    return progress.complete


def ready_groups(cfg: MarsRLConfig, run_id: str, flush: bool = False) -> list[TrainableGroup]:
    """The groups the run's learner would train on now; empty while not enough are ready (see
    `marsrl_core.learn.groups.ready_groups`). One store query."""
    with timed("learner.poll"):
        return _ready_groups(runtime().learner(cfg, run_id), flush=flush)


class StepFailedAgain(RuntimeError):
    """A learner step failed a second time before any step went past it: a retry would roll back to the
    last durable version and fail there again, so the run stops (and is resumed) instead."""


def train_step(
    cfg: MarsRLConfig, run_id: str, groups: list[TrainableGroup] | None = None, flush: bool = False
) -> dict[str, Any] | None:
    """One learner step on `groups` (as `ready_groups` found them; found here when None); None when
    there is nothing to train on."""
    rt = runtime()
    learner = rt.learner(cfg, run_id)
    groups = _ready_groups(learner, flush=flush) if groups is None else groups
    if not groups:
        return None
    failing = learner.step + 1
    try:
        with timed("learner.step"):
            report = learner.train_step(groups)
    except PolicyDiverged as exc:  # not retried: the same groups and weights diverge again
        rt.drop_learner(run_id)  # its in-memory update is not what the last commit holds
        rt.store(cfg, lane="learner").mark(run_id, events.DIVERGED, str(exc))
        return {"diverged": str(exc)}
    except BaseException as exc:
        # The update may have been applied in memory but not committed: drop this learner so a retry
        # rebuilds it from the last durable version (and its newer folders are cleaned up).
        rt.drop_learner(run_id)
        if rt.failed_steps.get(run_id, 0) >= failing:  # failed here before, and no step since went past it
            raise StepFailedAgain(
                f"learner step {failing} of run {run_id!r} failed again after a retry from the last durable "
                f"version: {exc!r}; `marsrl train --resume {run_id}` continues from that version"
            ) from exc
        rt.failed_steps[run_id] = failing
        raise
    if report.step > rt.failed_steps.get(run_id, report.step):
        del rt.failed_steps[run_id]
    if rt.has_engine(cfg):  # this process's decode loop learns of the version without asking the store
        rt.weight_channel(cfg, run_id).committed(report.step, str(report.checkpoint))
    if _sync_from_memory(cfg, learner) and rt.has_engine(cfg):  # this process's engines take it from memory
        with timed("learner.weight_handover"):
            per_agent = cfg.learner.policies == "per_agent"
            weights = {a: learner.state_dict(a) for a in AGENTS} if per_agent else learner.state_dict("solver")
            rt.weight_channel(cfg, run_id).publish(report.step, weights)
    rt.wake_rollouts(cfg, run_id)  # after the publish, so an idle decode loop takes the weights from memory
    return {"step": report.step, "checkpoint": str(report.checkpoint), "metrics": report.metrics}


def follow_learner(cfg: MarsRLConfig, run_id: str, folder: Path, ranks: Any) -> None:
    """A learner rank other than 0 (no store, MLflow or Prefect): it resumes from the run's last commit
    with rank 0 and trains its share of every step rank 0 starts, until rank 0 stops it."""
    from marsrl_core.learn.learner import Learner

    learner = Learner(cfg, None, run_id, folder, checkpoint_root(cfg.output_dir, run_id), ranks=ranks)
    learner.resume()
    learner.follow()


def evaluate(
    cfg: MarsRLConfig, run_id: str, label: str, checkpoint: str | None = None, log: Callable[[str], None] | None = None
) -> dict[str, float]:
    """Evaluate a policy (the starting one, or a checkpoint folder), record it in the store, and log it to
    the run's MLflow run when this process has one; its progress goes to `log` as lines when given."""
    from marsrl_core.runtime.evaluate import evaluate_policy
    from marsrl_core.runtime.progress import LogProgress

    rt = runtime()
    folder = None if checkpoint is None else Path(checkpoint)
    progress = LogProgress(log) if log is not None else None
    report = evaluate_policy(cfg, rt.store(cfg), run_id, label, folder=folder, progress=progress)
    if rt.has_tracker(run_id):
        rt.tracker(cfg, run_id).log_metrics({f"eval_{label}/{k}": v for k, v in report.as_dict().items()})
    return report.as_dict()


def log_reward_curves(cfg: MarsRLConfig, run_id: str) -> str:
    """Plot the run's per-agent reward curves and log the PNG to its MLflow run; returns its URI."""
    from matplotlib import pyplot as plt

    from marsrl_core.runtime.plots import reward_curves

    rt = runtime()
    figure = reward_curves(rt.store(cfg), run_id)
    tracker = rt.tracker(cfg, run_id)
    tracker.log_figure(figure, "reward_curves.png")
    plt.close(figure)
    return f"{tracker.run.info.artifact_uri}/reward_curves.png"


def log_timeline(cfg: MarsRLConfig, run_id: str) -> str:
    """Draw the run's timeline (`timeline.py`) and log the PNG to its MLflow run; returns its URI."""
    from matplotlib import pyplot as plt

    from marsrl_core.rollout.timeline import draw_timeline, timeline_from_store

    rt = runtime()
    figure = draw_timeline(timeline_from_store(rt.store(cfg), run_id), f"timeline of run {run_id}")
    tracker = rt.tracker(cfg, run_id)
    tracker.log_figure(figure, "timeline.png")
    plt.close(figure)
    return f"{tracker.run.info.artifact_uri}/timeline.png"


def sample_accounting(cfg: MarsRLConfig, run_id: str) -> dict[str, float]:
    """What became of a run's finished samples: trained, dropped untrained as stale
    (`stale_groups='drop'`), left out of the loss as truncated (`mask_truncated_completions`; consumed by
    a step, so counted among the trained), and still pending (finished, never consumed).
    `stale_drop_fraction` is the untrained ones (dropped or masked) over those a step consumed;
    `trained_age_max` and `trained_age_mean` the versions between a trained sample's first token and
    the policy its step trained (the `staleness` view)."""
    store = runtime().store(cfg)
    row = store.query(
        """SELECT (SELECT count(DISTINCT sample_id) FROM rewards WHERE run_id = $1) AS finished,
                  (SELECT count(*) FROM consumptions WHERE run_id = $1 AND learner_step > 0) AS trained,
                  (SELECT count(*) FROM consumptions WHERE run_id = $1 AND learner_step < 0) AS dropped_stale,
                  (SELECT coalesce(sum(CAST(json_extract(metrics_json, '$.masked_truncated_samples') AS DOUBLE)), 0)
                   FROM train_steps WHERE run_id = $1) AS masked_truncated,
                  (SELECT coalesce(max(staleness), 0) FROM staleness WHERE run_id = $1) AS trained_age_max,
                  (SELECT coalesce(avg(staleness), 0) FROM staleness WHERE run_id = $1) AS trained_age_mean""",
        [run_id],
    ).to_pylist()[0]
    consumed = row["trained"] + row["dropped_stale"]
    return {
        **{k: float(v) for k, v in row.items()},
        "pending": float(row["finished"] - consumed),
        "stale_drop_fraction": (row["dropped_stale"] + row["masked_truncated"]) / max(1, consumed),
    }


def compact(cfg: MarsRLConfig) -> dict[str, int]:
    """Compact the store (`Store.compact`) with the configured retention."""
    return runtime().store(cfg).compact(retention_s=60 * cfg.store.compaction_retention_minutes)
