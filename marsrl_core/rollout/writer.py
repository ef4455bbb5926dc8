"""Write-behind of a decode stage's rows: stage k's append to the store runs while stage k+1 decodes.

A stage ends with one append (its new samples, segments and rewards: one transaction, a DuckLake commit
in the store process). With `rollout.write_behind` the scheduler issues that append to this writer's
thread and goes on decoding the next stage; the next stage waits for it once its decode is done, before
anything that depends on what it wrote: the next agents' groups and admission (the gate counts the
groups this scheduler stored), and the next append (appends land in order). So the store's commit
overlaps the engine's decode instead of following it.

What the scheduler tells its waiters is what the store holds: `progress` is the batches' progress as of
the newest stage whose append has landed, so a turn or a batch is reported finished (and a batch marked
done) only once its rows are stored. A crash loses at most the stage whose append was in flight, which a
resume from the store decodes again; an append that failed (or found its rows stored: the scheduler was
behind the store) raises at the next stage's wait, and the decode loop resumes a new scheduler from the
store, as for any failed stage.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from marsrl_core.rollout.samples import BatchProgress


class StageWriter:
    """One append in flight at a time, and the batches' progress as of the last one that landed."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-write")
        self._pending: tuple[Future, dict[int | None, BatchProgress]] | None = None
        self._landed: dict[int | None, BatchProgress] = {}  # per batch, as of the last append that landed

    @property
    def pending(self) -> bool:
        """Whether an append is in flight (issued and not yet waited for)."""
        return self._pending is not None

    def issue(self, write: Callable[[], Any], progress: Mapping[int | None, BatchProgress]) -> None:
        """Run `write` (the stage's append) in the writer's thread; `progress` is every batch as the stage
        left it, which the store holds once `write` has landed. One at a time: `wait` first."""
        if self._pending is not None:
            raise RuntimeError("a stage's append is still in flight: wait for it before issuing the next")
        self._pending = (self._pool.submit(write), dict(progress))

    def wait(self) -> Any:
        """Wait for the append in flight (None when none is); its result, or its error raised."""
        if self._pending is None:
            return None
        future, progress = self._pending
        self._pending = None
        result = future.result()
        self._landed = progress
        return result

    def stored_progress(self, batch: int | None, live: BatchProgress) -> BatchProgress:
        """Batch `batch` as the store holds it, given `live` (as the scheduler holds it). With no append
        in flight the store holds everything. With one in flight, a batch the last landed append covered
        is as it left it; any other batch entered the scheduler after that append, through admissions
        in the append in flight (its samples not decoded yet) or through a resume from the store."""
        if self._pending is None or batch not in self._landed:
            return live
        return self._landed[batch]

    def forget(self, batch: int | None) -> None:
        self._landed.pop(batch, None)

    def close(self) -> None:
        """Let the append in flight land or fail (a new scheduler resumes from what the store holds), and
        end the thread."""
        if self._pending is not None:
            self._pending[0].exception()
            self._pending = None
        self._pool.shutdown(wait=True)
