"""The learner's versions: where a run resumes from, and what each step publishes.

Every step publishes version `step`: its folder first (written to a temporary name, renamed when whole),
then one store transaction with the step's consumptions, version row and metrics, then MLflow. The
folder is a durable checkpoint (weights, AdamW state, schedulers, RNG) every `learner.save_every` steps
and at step `learner.max_steps`, the weights alone between (`checkpoint.py`). With `learner.async_save`
a durable version commits with its weights alone, and a background thread (`DurableWriter`) adds the
trainer state, making the folder durable once all of it is on disk; the next optimizer update waits
for it, since it writes the live tensors rather than a copy. `resume()` restarts from
the newest durable version: the committed steps after it are voided in the store (`rollback_to`), so
their samples are trained again, once, and their folders are removed. `make_durable()` ends a run
with a durable version whatever step it stopped at.

`LearnerVersions` is mixed into `Learner`, whose attributes (`cfg`, `store`, `models`, `optimizers`,
`schedulers`, `ranks`, `step`, ...) it uses.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from marsrl_core.faults import crash_point
from marsrl_core.learn import distributed
from marsrl_core.learn.checkpoint import (
    add_trainer_state,
    engine_state,
    load_checkpoint,
    save_rank_shard,
    save_version,
    trainer_state,
)
from marsrl_core.learn.checkpoint_folders import (
    CheckpointError,
    clean_uncommitted,
    is_durable,
    newest_durable,
    prune_checkpoints,
    version_folder,
)
from marsrl_core.timings import timed

log = logging.getLogger(__name__)
DURABLE = "durable"  # rank 0's message to the other ranks: write the current version durably


class DurableWriter:
    """One background thread at a time that makes a committed weights-only version durable
    (`checkpoint.add_trainer_state`); `wait()` joins it and raises what it raised."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._version = 0
        self._error: BaseException | None = None

    def start(self, version: int, folder: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        self.wait()

        def write() -> None:
            try:
                with timed("learner.durable_write"):
                    add_trainer_state(folder, tensors, meta)
            except BaseException as exc:  # raised in the learner's thread by `wait`
                self._error = exc

        self._version, self._error = version, None
        self._thread = threading.Thread(target=write, name=f"durable-v{version}")
        self._thread.start()

    def wait(self) -> int | None:
        """The version the finished write made durable (None if none was running)."""
        if self._thread is None:
            return None
        with timed("learner.durable_wait"):
            self._thread.join()
        self._thread, error = None, self._error
        if error is not None:
            raise CheckpointError(f"durable checkpoint v{self._version}: {error!r}") from error
        return self._version


class LearnerVersions:
    """Resuming and publishing the learner's versions (a mixin of `Learner`)."""

    # ------------------------------------------------------------------ resume
    def resume(self) -> int:
        """Restore the last durable version; returns the step to continue from (0 if none). Committed
        steps after it (weights-only versions, `learner.save_every`) are voided in the store first, so
        their samples are trained again, then their folders are removed."""
        main = self.ranks is None or self.ranks.main
        latest = self.store.latest_version(self.run_id) if main else None
        if main and latest is not None:
            durable = newest_durable(self.checkpoint_root, latest[0])
            if durable < latest[0]:
                voided = self.store.rollback_to(self.run_id, durable)
                log.warning(
                    "run %s: resuming from durable version %d; %d later weights-only versions voided, "
                    "their samples are trainable again",
                    self.run_id,
                    durable,
                    voided,
                )
                latest = self.store.latest_version(self.run_id)
        if main:
            clean_uncommitted(self.checkpoint_root, latest[0] if latest else None)
        if self.ranks is not None:
            latest = distributed.broadcast(latest)  # after the clean-up: no rank reads a removed folder
        if latest is None:
            return 0
        version, uri = latest
        shard = {"rank": self.ranks.rank, "world_size": self.ranks.world_size} if self.sharded else {}
        self.step = load_checkpoint(Path(uri), self.models, self.optimizers, self.schedulers, **shard)
        if self.step != version:
            raise RuntimeError(f"checkpoint {uri!r}: holds step {self.step} but the store committed version {version}")
        return self.step

    # ------------------------------------------------------------------ publishing
    def publish(
        self,
        consumed: dict[str, list[str]],
        metrics: dict[str, dict[str, float]],
        dropped: dict[str, list[str]] | None = None,
    ) -> Path:
        """The version's folder (complete before anything else): a durable checkpoint every
        `learner.save_every` steps and at step `learner.max_steps` (its trainer state added in the
        background after the commit with `learner.async_save`), weights alone between; then one store
        transaction, then MLflow (durable versions only). With several ranks, rank 0 commits; the
        others wait for the commit."""
        durable = self.step % self.cfg.learner.save_every == 0 or self.step == self.cfg.learner.max_steps
        background = durable and self.cfg.learner.async_save and not self.sharded
        folder = self._write_version(durable and not background)
        if folder is None:  # until rank 0 has committed: on the control group, whose wait is not
            # `collective_timeout_s`, since writing a large checkpoint (and logging it to MLflow) may take
            # longer; a rank 0 that fails takes the ranks down through the launcher
            distributed.barrier(self.ranks.control)
            return version_folder(self.checkpoint_root, self.step)
        mlflow_run = self.tracker.run_id if self.tracker is not None else None
        crash_point("checkpoint.commit")
        with timed("learner.store_commit"):
            self.store.commit_step(self.run_id, self.step, consumed, str(folder), mlflow_run, metrics, dropped)
        if background:  # the folder becomes durable in the background; the next update waits for it
            self.writer.start(self.step, folder, *self._trainer_state())
        if self.tracker is not None:
            with timed("learner.tracking"):
                self.tracker.log_step(self.step, metrics)
            if durable and not background:
                self._log_checkpoint_if_due(self.step)
        if self.cfg.learner.save_total_limit:  # only after the commit: the newest committed version stays
            prune_checkpoints(self.checkpoint_root, self.cfg.learner.save_total_limit)
        if self.ranks is not None:
            distributed.barrier(self.ranks.control)
        return folder

    def make_durable(self) -> None:
        """At the end of a run (rank 0): rewrite the newest committed version as a durable checkpoint if
        it holds weights alone, so that the run's result can be resumed and logged. Its store row already
        names the folder, which is replaced whole (renamed into place)."""
        self.wait_for_durable()
        if self.step == 0 or is_durable(version_folder(self.checkpoint_root, self.step)):
            return
        if self.ranks is not None:
            distributed.broadcast(DURABLE, self.ranks.control)
        self._write_version(durable=True)
        if self.ranks is not None:
            distributed.barrier(self.ranks.control)

    def _write_version(self, durable: bool) -> Path | None:
        """Write version `self.step`'s folder (durable, or weights alone); its path on rank 0, None on the
        others. A sharded learner's ranks take part in gathering the weights and, when durable, each
        writes its own shards."""
        full_states, shards = None, 0
        save_dtype = getattr(torch, self.cfg.model.dtype)
        if self.sharded:  # rank 0 gathers the whole weights in model.dtype; each rank saves its own shards
            full_states = {
                n: distributed.consolidated_state(m, save_dtype, self.ranks.main) for n, m in self.models.items()
            }
            if durable:
                save_rank_shard(self.checkpoint_root, self.step, self.ranks.rank, self.models, self.optimizers)
                shards = self.ranks.world_size
        if self.ranks is not None:  # data parallel: rank 0's model and AdamW state are whole
            distributed.barrier()
            if not self.ranks.main:
                return None
        with timed("learner.checkpoint_write"):
            trainer = self._trainer_state(sharded=bool(shards)) if durable else None
            return save_version(
                self.checkpoint_root, self.step, self.models, self.tokenizer, save_dtype, full_states, trainer, shards
            )

    def _trainer_state(self, sharded: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
        save_dtype = getattr(torch, self.cfg.model.dtype)
        return trainer_state(self.models, self.optimizers, self.schedulers, self.step, save_dtype, sharded)

    def wait_for_durable(self) -> None:
        """Before anything changes the trained tensors (the next optimizer update, a rebuild, the run's
        end): wait for the background durable write, if one runs; raise what it raised; log the version
        to MLflow if `tracking.log_checkpoint_steps` says so."""
        written = self.writer.wait()
        if written is not None:
            self._log_checkpoint_if_due(written)

    def _log_checkpoint_if_due(self, version: int) -> None:
        every = self.cfg.tracking.log_checkpoint_steps
        if self.tracker is not None and every and version - self.logged_version >= every:
            with timed("learner.tracking"):
                self.tracker.log_checkpoint(version_folder(self.checkpoint_root, version), version)
            self.logged_version = version

    def log_newest_checkpoint(self) -> None:
        """At the end of a run: log the newest durable version to MLflow if `log_checkpoint_steps` skipped it."""
        if self.tracker is None or not self.cfg.tracking.log_checkpoint_steps:
            return
        newest = newest_durable(self.checkpoint_root, self.step)
        if newest > self.logged_version:
            self.tracker.log_checkpoint(version_folder(self.checkpoint_root, newest), newest)
            self.logged_version = newest

    def state_dict(self, agent: str) -> dict[str, torch.Tensor]:
        """A copy of `agent`'s current weights as its checkpoint folder holds them (in `model.dtype`, on
        the learner's device), for an in-process engine update: the learner's next step does not change
        it. Tied parameters share one copy. One process only (a sharded learner's ranks hold shards)."""
        return engine_state(self.model_for(agent), getattr(torch, self.cfg.model.dtype))
