"""One engine per process, shared by concurrent callers: pending segment requests are batched.

Rollout tasks of several concurrently running flows (batch k's Verifiers, batch k+1's Solvers) call
`decode_segment` from their own threads. `BatchingEngine` collects whatever requests are pending,
waits at most `window_s` for more, decodes them as one segment batch on the wrapped engine, and
hands each caller its own results. That merged batch is the agentic pipeline in Prefect's terms.

Weight updates go through the same lock, so they happen between segment batches, never during one.

Deliberate simplification: one decode at a time (the wrapped engine is not re-entrant); requests
arriving during a decode wait for the next batch.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marsrl_core.engines.base import SegmentRequest, SegmentResult


@dataclass
class _Ticket:
    requests: Sequence[SegmentRequest]
    done: threading.Event = field(default_factory=threading.Event)
    results: list[SegmentResult] | None = None
    error: BaseException | None = None


class BatchingEngine:
    def __init__(self, engine: Any, window_s: float = 0.005):
        self.engine = engine
        self.window_s = window_s
        self.tokenizer = getattr(engine, "tokenizer", None)
        self._queue: list[_Ticket] = []
        self._cv = threading.Condition()
        self._decoding = False
        self.batches = 0  # how many engine calls were made
        self.batch_sizes: list[int] = []
        self.weight_updates: Counter[str] = Counter()  # versions loaded: from "memory" or a "checkpoint" folder
        self.run_id: str | None = None  # the run whose weights it holds (None: still its starting weights)

    def __getattr__(self, name: str) -> Any:  # max_positions, eos_id, ... of the wrapped engine
        return getattr(self.engine, name)

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def decode_segment(self, requests: Sequence[SegmentRequest]) -> list[SegmentResult]:
        ticket = _Ticket(list(requests))
        with self._cv:
            self._queue.append(ticket)
            self._cv.notify_all()
            # The first waiting caller that finds the engine idle becomes the decoder for everyone.
            while not ticket.done.is_set():
                if not self._decoding:
                    self._decoding = True
                    deadline = time.monotonic() + self.window_s
                    while (left := deadline - time.monotonic()) > 0:  # let concurrent callers join
                        self._cv.wait(left)
                    batch, self._queue = self._queue, []
                    self._cv.release()
                    try:
                        self._run(batch)
                    finally:
                        self._cv.acquire()
                        self._decoding = False
                        self._cv.notify_all()
                else:
                    self._cv.wait()
        if ticket.error is not None:
            raise ticket.error
        return ticket.results

    def _run(self, batch: list[_Ticket]) -> None:
        flat = [r for t in batch for r in t.requests]
        try:
            results = self.engine.decode_segment(flat)
            self.batches += 1
            self.batch_sizes.append(len(flat))
        except BaseException as err:  # every caller of this batch sees the error
            for t in batch:
                t.error = err
                t.done.set()
            return
        offset = 0
        for t in batch:
            t.results = results[offset : offset + len(t.requests)]
            offset += len(t.requests)
            t.done.set()

    def serve_run(self, run_id: str, version: int, weights: Any) -> None:
        """Hold run `run_id`'s weights before decoding for it. An engine that served another run of
        this process (`marsrl ablate`'s runs, one after another) loads `weights`, that run's version
        `version`, even when its own version number is higher; one still on its starting weights, or
        already on this run, is kept (a newer version of the run arrives by `update_weights`)."""

        def other_run() -> bool:
            if self.run_id in (None, run_id):
                self.run_id = run_id
                return False
            return True

        if self._load_between_batches(other_run, version, weights):
            self.run_id = run_id

    def update_weights(self, version: int, weights: Any) -> None:
        """Load a newer version between segment batches; an older or equal version is ignored (several
        schedulers may offer the same update, in any order)."""
        if self._load_between_batches(lambda: version > self.engine.policy_version, version, weights):
            self.weight_updates["checkpoint" if isinstance(weights, (str, Path)) else "memory"] += 1

    def _load_between_batches(self, wanted: Callable[[], bool], version: int, weights: Any) -> bool:
        """Wait until no segment batch decodes; if `wanted()` (asked under the lock) load `weights` as
        `version` with decoding held off meanwhile. Whether it loaded."""
        with self._cv:
            while self._decoding:
                self._cv.wait()
            if not wanted():
                return False
            self._decoding = True
        try:
            self.engine.update_weights(version, weights)
            return True
        finally:
            with self._cv:
                self._decoding = False
                self._cv.notify_all()
