"""Where a run's wall-clock goes: seconds and counts per phase, summed over the process's threads.

The decode loop and the learner mark their phases with `timed(name)` (a `with` block); a benchmark
reads `TIMINGS.snapshot()` before and after the stretch it measures (`benchmarks/step_profile.py`).
A span costs two `perf_counter` calls and a lock (about a microsecond), so it is always on.

Phases (a name's prefix is its lane, the decode loop's or the learner's):
- `rollout.*`: `stage` (one stage of the decode loop), which holds `weights` (poll the store for a
  newer version and load it into the engines), `decode` (the engines' segment batches; within it
  `prefill`, the transformers engine's encoding of contexts it did not keep), `store_write` (the
  stage's append), `admit` (new problems' first groups), `rewards` (judging finished outputs) and
  `advance` (the next agents' groups); and `idle` (nothing to decode).
- `learner.*`: `build` (the learner's model, optimizer and resume, once per process and run), `poll`
  (find ready groups), `idle` (waiting for groups), `task` (the `train-step`
  Prefect task), which holds `step` (the learner's step: `load_samples`, `forward_backward`,
  `optimizer` (clip and step), `checkpoint_write`, `store_commit`, `tracking` (MLflow)) and
  `weight_handover` (the in-memory copy for this process's engines); `task` less those two is
  Prefect's bookkeeping.
- `store.*`: each call to a store process (`store/process.py`), by method, and `lock_wait` (calls
  from the process's threads take turns); they lie inside the phases above.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class Timings:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = {}
        self._counts: dict[str, int] = {}

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self._seconds[name] = self._seconds.get(name, 0.0) + seconds
            self._counts[name] = self._counts.get(name, 0) + 1

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def snapshot(self) -> dict[str, tuple[float, int]]:
        """{phase: (seconds, count)} so far."""
        with self._lock:
            return {name: (self._seconds[name], self._counts[name]) for name in self._seconds}


TIMINGS = Timings()
timed = TIMINGS.span


def since(before: dict[str, tuple[float, int]]) -> dict[str, tuple[float, int]]:
    """The phases' seconds and counts since the snapshot `before`."""
    now = TIMINGS.snapshot()
    return {
        name: (seconds - before.get(name, (0.0, 0))[0], count - before.get(name, (0.0, 0))[1])
        for name, (seconds, count) in sorted(now.items())
        if count > before.get(name, (0.0, 0))[1]
    }
