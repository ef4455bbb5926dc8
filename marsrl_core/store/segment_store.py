"""The segment store: an append-only DuckLake lakehouse shared by rollout, learner and users.

Its parts: the connection and its retrying primitives (`connection.py`), the rows and their Arrow
batches (`rows.py`, schema in `schema.py`), writes (`writes.py`), reads (`queries.py`), compaction
(`compaction.py`). `StoreProcess` (`process.py`) serves the same calls from a child process; both
satisfy the `Store` protocol (`protocol.py`).
"""

from __future__ import annotations

from marsrl_core.store.compaction import StoreCompaction
from marsrl_core.store.queries import StoreQueries
from marsrl_core.store.writes import StoreWrites


class SegmentStore(StoreWrites, StoreQueries, StoreCompaction):
    """The DuckLake segment store. Open one per process; it is safe to share between threads."""
