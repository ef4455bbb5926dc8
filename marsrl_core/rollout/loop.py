"""The decode loop: one `RolloutScheduler` per run and process, fed by every batch in flight, stepped
stage after stage in a thread of its own.

Batches join it (`add_batch`) and leave it (`forget_batch`) at a stage boundary; each stage decodes
one segment of every unfinished sample of every batch in one engine batch, so a problem's next agent
starts at the next stage boundary after its inputs exist, and batch k+1's Solvers decode beside batch
k's Verifiers and Correctors. Whoever waits on a batch (`wait`) is woken after every stage with the
batch's `BatchProgress`; the flows' turn tasks wait there for their turn to finish.

When nothing can be decoded (the admission gate holds every waiting problem, or nothing is left), the
loop waits between stages, from `idle_s` growing to half a second, instead of spinning; `wake()` (the
process's learner committed a version, which may make room at the gate and brings new weights) ends
the wait at once. Once `stop_when()` says so (the run's learner has its steps) the problems not yet
admitted are dropped and those in flight finish the samples they are decoding but start no next
turn (nothing more of them would be trained). A stage that fails (an engine or
store error, `RolloutBehindStore`) is retried by a new scheduler resumed from the store (nothing
stored is decoded again), up to `max_restarts` times in a row; then, at once when the policy diverged
(`PolicyDiverged`), or when `interrupted()` (the process is stopping), every waiter gets the error and
the loop ends: the next `add_batch` is refused, and the process's runtime makes a new loop.

Deliberate simplification: the loop's stages run one after another in its thread; the engine is the
only place work runs in parallel (vLLM's own scheduler, or a batched forward).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from marsrl_core.agents.problems import Problem
from marsrl_core.divergence import PolicyDiverged
from marsrl_core.rollout.samples import BatchProgress, RolloutInterrupted
from marsrl_core.timings import TIMINGS, timed

log = logging.getLogger(__name__)
MAX_IDLE_S = 0.5  # the longest wait between two stages of a loop with nothing to decode


class RolloutLoop:
    """A run's decode loop in this process; see the module docstring."""

    def __init__(
        self,
        make_scheduler: Callable[[], Any],
        *,
        interrupted: Callable[[], bool] = lambda: False,
        max_restarts: int = 2,
        idle_s: float = 0.05,
        stop_check_s: float = 0.5,
    ):
        self._make_scheduler = make_scheduler
        self._interrupted = interrupted
        self.max_restarts, self.idle_s, self.stop_check_s = max_restarts, idle_s, stop_check_s
        self._lock = threading.RLock()  # the scheduler: stages, batch changes, a rebuild
        self._changed = threading.Condition()  # progress, error, the inbox
        # Batch changes for the next boundary: (kind, batch, its problems, whether the store may hold some of it)
        self._inbox: list[tuple[str, int, list[Problem] | None, bool]] = []
        self._scheduler: Any = None
        self._batches: dict[int, list[Problem]] = {}
        self._joined: set[int] = set()  # added and not forgotten (under `_changed`)
        self._progress: dict[int, BatchProgress] = {}
        self._admitting = True
        self._stop_when: Callable[[], bool] = lambda: False
        self._stop_checked = 0.0
        self._error: BaseException | None = None
        self._closed = False
        self._woken = False  # `wake()` since the last idle wait
        self._thread: threading.Thread | None = None
        self._emptied_at: float | None = None  # when the thread last ended for want of a batch
        self.stages = 0
        self.restarts = 0
        self.decode_batch_sizes: list[int] = []  # samples decoded by each stage that decoded

    # ------------------------------------------------------------------ batches
    def add_batch(self, batch: int, problems: Sequence[Problem], new: bool = False) -> None:
        """Batch `batch` joins the loop (at its next stage boundary): what the store holds of it resumes,
        the rest waits for admission. `new`: its problems were all recorded just now, so the store holds
        nothing of it and the resume's query is skipped."""
        problems = list(problems)
        with self._changed:
            self._raise_if_ended()
            self._inbox.append(("add", batch, problems, not new))
            self._joined.add(batch)
            self._changed.notify_all()
            if self._thread is None:
                if self._emptied_at is not None:  # the loop was without a batch until now
                    TIMINGS.add("rollout.no_batch", time.perf_counter() - self._emptied_at)
                    self._emptied_at = None
                self._thread = threading.Thread(target=self._run, name="rollout-loop", daemon=True)
                self._thread.start()

    def forget_batch(self, batch: int) -> None:
        """The batch's flow is done with it: the loop lets go of its problems."""
        with self._changed:
            self._inbox.append(("forget", batch, None, False))
            self._progress.pop(batch, None)
            self._joined.discard(batch)
            self._changed.notify_all()

    def wake(self) -> None:
        """A new policy version was committed in this process: an idle loop runs its next stage now (the
        gate may admit again, and the engines take the version) instead of at the end of its back-off."""
        with self._changed:
            self._woken = True
            self._changed.notify_all()

    def joined(self, batch: int) -> bool:
        """Whether batch `batch` has been added (and not forgotten)."""
        with self._changed:
            return batch in self._joined

    def wait(self, batch: int, until: Callable[[BatchProgress], bool], timeout_s: float | None = None) -> BatchProgress:
        """The batch's progress once `until(progress)` holds (checked after every stage); raises the
        loop's error if it has ended, TimeoutError after `timeout_s`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._changed:
            while True:
                if self._error is not None:
                    raise self._error
                progress = self._progress.get(batch)
                if progress is not None and until(progress):
                    return progress
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"batch {batch}: still waiting after {timeout_s} s")
                self._changed.wait(left if left is not None else 1.0)

    def stop_when(self, condition: Callable[[], bool]) -> None:
        """From now on, stop the batches once `condition()` holds (asked every `stop_check_s`): the
        problems not admitted yet are dropped and those in flight start no next turn; problems are
        admitted again until then."""
        with self._lock:
            self._stop_when, self._admitting = condition, True

    def stop_admitting(self) -> None:
        """At the next stage boundary, drop the problems not admitted yet and start no next turn of those
        in flight; the same for batches added later."""
        with self._changed:
            self._inbox.append(("stop", -1, None, False))
            self._changed.notify_all()

    @property
    def ended(self) -> bool:
        return self._error is not None or self._closed

    @property
    def diverged(self) -> bool:
        """Whether it ended on `PolicyDiverged` (its error goes to every later caller too)."""
        return isinstance(self._error, PolicyDiverged)

    def close(self) -> None:
        """End the loop after its current stage (waited for); waiters get RolloutInterrupted."""
        with self._changed:
            self._closed = True
            self._error = self._error or RolloutInterrupted("the rollout loop was closed")
            self._changed.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=60)

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        try:
            self._stages()
        except BaseException as err:  # a bug, not a failed stage: every waiter hears of it, nothing hangs
            self._end(err)
            raise

    def _stages(self) -> None:
        failures = idle_stages = 0
        while not self._closed:
            if self._interrupted():
                return self._end(RolloutInterrupted("interrupted: what it decoded is stored and a resume continues it"))
            self._check_stop()
            with self._lock:
                self._take_inbox()
                scheduler = self._scheduler
                idle = scheduler is None or scheduler.finished()
                if not idle:
                    try:
                        with timed("rollout.stage"):
                            report = scheduler.stage()
                        failures = 0
                    except PolicyDiverged as err:  # the weights are unusable: a retry decodes with them again
                        return self._end(err)
                    except Exception as err:  # noqa: BLE001  (every failure is retried from the store, then reported)
                        failures += 1
                        if failures > self.max_restarts:
                            return self._end(err)
                        log.warning("rollout stage failed (%s); resuming from the store (%d)", err, failures)
                        self._rebuild()
                        continue
                    self.stages += 1
                    if report.decoded:
                        self.decode_batch_sizes.append(report.decoded)
                    idle = not report.decoded and not report.admitted
                self._publish()
            idle_stages = min(idle_stages + 1, 20) if idle else 0
            if idle:  # nothing to decode (done, or the gate holds every waiting problem): back off
                with self._changed:
                    if self._inbox or self._woken:
                        self._woken = False
                        continue
                    if not self._batches:  # no batch left: the thread ends, the next add_batch starts one
                        self._thread, self._emptied_at = None, time.perf_counter()
                        return
                    with timed("rollout.idle"):
                        self._changed.wait(min(self.idle_s * 1.5**idle_stages, MAX_IDLE_S))
                    self._woken = False

    def _take_inbox(self) -> None:
        """Apply the batch changes asked for since the last stage (under `_lock`)."""
        with self._changed:
            inbox, self._inbox = self._inbox, []
        for kind, batch, problems, resume in inbox:
            if kind == "add":
                if self._scheduler is None:
                    with timed("rollout.build"):  # the engines and their weights, on the first batch
                        self._scheduler = self._make_scheduler()
                self._scheduler.add_problems(problems, batch, resume=resume)
                if not self._admitting:
                    self._scheduler.drop_waiting()
                self._batches[batch] = problems
            elif kind == "forget":
                self._batches.pop(batch, None)
                if self._scheduler is not None:
                    self._scheduler.forget_batch(batch)
            else:
                self._admitting = False
                if self._scheduler is not None:
                    self._scheduler.drop_waiting()

    def _rebuild(self) -> None:
        """A new scheduler resumed from the store for the batches in flight (under `_lock`)."""
        self.restarts += 1
        if self._scheduler is not None:
            self._scheduler.release()
        self._scheduler = self._make_scheduler()
        for batch, problems in self._batches.items():
            self._scheduler.add_problems(problems, batch)
        if not self._admitting:
            self._scheduler.drop_waiting()

    def _check_stop(self) -> None:
        if not self._admitting or time.monotonic() - self._stop_checked < self.stop_check_s:
            return
        self._stop_checked = time.monotonic()
        if self._stop_when():
            self.stop_admitting()

    def _publish(self) -> None:
        """Every batch's progress, for the waiters (under `_lock`)."""
        progress = {b: self._scheduler.batch_progress(b) for b in self._batches} if self._scheduler else {}
        with self._changed:
            self._progress.update((b, p) for b, p in progress.items() if b in self._batches)
            self._changed.notify_all()

    def _end(self, err: BaseException) -> None:
        with self._changed:
            self._error = err
            self._changed.notify_all()
        with self._lock:
            if self._scheduler is not None:
                self._scheduler.release()
                self._scheduler = None

    def _raise_if_ended(self) -> None:
        if self._error is not None:
            raise self._error
