"""Running flows inside a flow: in threads of their own, without a heartbeat of their own.

`in_thread(pool, fn, *args)` runs `fn` (which calls a flow) in a thread of `pool` with the calling
flow's context, so the flow runs as its subflow; it returns a `concurrent.futures.Future`.
`keep_in_flight` submits items in order with a bounded number unfinished, awaiting the oldest.

A Prefect flow run sends a heartbeat event (every 180 s by default) so that the server can tell a
crashed run from a long one. A subflow runs in its parent's process, and the parent's heartbeat
already says whether that process is alive. Each heartbeat costs a flow run time at its end, too:
Prefect joins the heartbeat thread, which sleeps in one-second steps, so every flow run ended ~1 s
late here (an empty flow: 1.05 s with its heartbeat, 0.05 s without). That was most of the rollout
flow's Prefect overhead on the tiny model, whose batches take seconds.

Prefect's `temporary_settings` re-validates the whole settings model on every entry (~75 ms here,
more than a subflow's own API calls), so the heartbeat-free settings are built once and re-entered
while the base settings object stays the same (a run has one; a new base rebuilds them).

Deliberate simplification: the setting is switched off for everything run inside the block, so the
block holds only subflow calls of a running flow.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

import prefect.context
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, Settings

T = TypeVar("T")
_last: tuple[Settings, Settings] | None = None  # (base, base without heartbeat)
_lock = threading.Lock()


def _heartbeat_free(base: Settings) -> Settings:
    global _last
    with _lock:
        if _last is None or _last[0] is not base:
            _last = (base, base.copy_with_update(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}))
        return _last[1]


@contextmanager
def parent_heartbeat_only() -> Iterator[None]:
    """Flows called inside this block send no heartbeat of their own (their parent's covers them)."""
    context = prefect.context.get_settings_context()
    if context.settings.flows.heartbeat_frequency is None:
        yield
        return
    with prefect.context.SettingsContext(profile=context.profile, settings=_heartbeat_free(context.settings)):
        yield


def in_thread(pool: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any) -> Future:
    """`fn(*args)` in a thread of `pool`, with the calling flow's context: a flow it calls is a subflow
    of the calling flow."""
    return pool.submit(contextvars.copy_context().run, fn, *args)


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
