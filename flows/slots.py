"""Thread coordination for running a run's batches as concurrent rollout subflows.

- `DecodeSlots`: at most `rollout.batches_in_flight` of a run's batches decode at once in this
  process, in the order they were queued; a batch whose subflow started ahead of time waits for its
  turn (its Prefect set-up overlaps the decoding of the batches in flight).
- `keep_in_flight`: submit items in order with a bounded number unfinished, awaiting the oldest.

Deliberate simplification: the slots live in the process that runs the subflows (as the engine does);
a rollout flow run on its own (a deployment run of one batch) decodes without waiting for one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")


class DecodeSlots:
    """At most `limit` of a run's batches decode at once in this process, in the order they were
    queued. A batch whose subflow started ahead waits here for its turn and a free slot; it then
    decodes only if `stop()` has not been asked for meanwhile (the flow stops starting batches then,
    and a batch prepared ahead counts as not started)."""

    _by_run: dict[str, DecodeSlots] = {}
    _registry_lock = threading.Lock()

    def __init__(self, limit: int, stop: Callable[[], bool]):
        self.limit, self.stop = limit, stop
        self._changed = threading.Condition()
        self._waiting: list[int] = []  # batches queued and not yet decoding, oldest first
        self._started: set[int] = set()  # queued batches whose subflow has reached `hold`
        self._decoding = 0
        self._closed = False  # the batches' flow is done (or failed): waiting batches do not decode

    def queue(self, batch_index: int) -> None:
        with self._changed:
            self._waiting.append(batch_index)

    def wait_until_started(self, batch_index: int, future: Future) -> None:
        """Until `batch_index`'s subflow run has started (reached `hold`) or its future has ended."""
        with self._changed:
            while batch_index not in self._started and not future.done():
                self._changed.wait(0.05)

    @classmethod
    @contextmanager
    def open(cls, run_id: str, limit: int, stop: Callable[[], bool]) -> Iterator[DecodeSlots]:
        with cls._registry_lock:
            if run_id in cls._by_run:
                raise RuntimeError(f"run {run_id!r}: its batches are already being run in this process")
            cls._by_run[run_id] = slots = cls(limit, stop)
        try:
            yield slots
        finally:
            with cls._registry_lock:
                del cls._by_run[run_id]
            slots.close()

    def close(self) -> None:
        """Batches still waiting for a slot will not decode."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    @classmethod
    @contextmanager
    def hold(cls, run_id: str, batch_index: int) -> Iterator[bool]:
        """Wait for `batch_index`'s turn and a slot (no wait for a batch that `run_batches` did not
        queue); yields whether to decode."""
        slots = cls._by_run.get(run_id)
        if slots is None:
            yield True
            return
        with slots._changed:
            queued = batch_index in slots._waiting
            if queued:
                slots._started.add(batch_index)
                slots._changed.notify_all()
                slots._changed.wait_for(
                    lambda: slots._closed or (slots._waiting[0] == batch_index and slots._decoding < slots.limit)
                )
                got_slot = not slots._closed
                if got_slot:
                    slots._waiting.pop(0)
                    slots._decoding += 1
                    slots._changed.notify_all()  # the next batch in line may take a free slot now
        if not queued:
            yield True
            return
        if not got_slot:
            yield False
            return
        try:
            yield not slots.stop()
        finally:
            with slots._changed:
                slots._decoding -= 1
                slots._changed.notify_all()


def keep_in_flight(
    items: Iterable[T], limit: int, submit: Callable[[T], Any], stop: Callable[[], bool] = lambda: False
) -> Iterator[Any]:
    """`submit(item)` for each item in order, at most `limit` unfinished at a time; the oldest is awaited
    (`.result()` of the future `submit` returned) before the next starts. `stop` is asked before each new
    item; once it says so, those running finish and no more start. Yields the finished items' results,
    in order, as they finish (a run of any length keeps none of them)."""
    pending, running = list(items), []
    while pending or running:
        if pending and stop():
            pending.clear()
        while pending and len(running) < limit:
            running.append(submit(pending.pop(0)))
        if running:
            yield running.pop(0).result()
