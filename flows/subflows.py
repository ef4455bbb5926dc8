"""Running flows inside a flow: without a heartbeat of their own.

A Prefect flow run sends a heartbeat event (every 180 s by default) so that the server can tell a
crashed run from a long one. A subflow runs in its parent's process, and the parent's heartbeat
already says whether that process is alive. Each heartbeat costs a flow run time at its end, too:
Prefect joins the heartbeat thread, which sleeps in one-second steps, so every flow run ended ~1 s
late here (an empty flow: 1.05 s with its heartbeat, 0.05 s without). That was most of the rollout
flow's Prefect overhead on the tiny model, whose batches take seconds.

Deliberate simplification: the setting is switched off for everything run inside the block, so the
block holds only subflow calls of a running flow.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings


@contextmanager
def parent_heartbeat_only() -> Iterator[None]:
    """Flows called inside this block send no heartbeat of their own (their parent's covers them)."""
    with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield
