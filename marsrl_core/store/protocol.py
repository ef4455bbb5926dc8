"""`Store`: the calls rollout, learner, flows and the SQL console make on the segment store.

`SegmentStore` (the connection in this process) defines them, once; `StoreProcess` offers the same
calls served by a child process (`store_calls`: every public method of `SegmentStore` but `close`),
so code that takes a `Store` does not care which one it was given.
"""

from __future__ import annotations

import inspect

from marsrl_core.store.segment_store import SegmentStore

Store = SegmentStore  # the type a store argument is given; a `StoreProcess` offers the same calls


def store_calls() -> frozenset[str]:
    """The calls a `StoreProcess` forwards to its child: `SegmentStore`'s public methods but `close`."""
    methods = inspect.getmembers(SegmentStore, inspect.isfunction)
    return frozenset(name for name, _ in methods if not name.startswith("_") and name != "close")
