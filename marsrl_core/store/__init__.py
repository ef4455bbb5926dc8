"""The DuckLake segment store (see `segment_store.py`): rows, the in-process store, the store process."""

from marsrl_core.store.connection import CATALOG
from marsrl_core.store.protocol import Store
from marsrl_core.store.rows import (
    DROPPED_STALE,
    AppendResult,
    Rejection,
    RewardRow,
    SampleRow,
    SegmentRow,
    StoredSample,
    StoreError,
    TrainableGroup,
)
from marsrl_core.store.segment_store import SegmentStore

__all__ = [
    "AppendResult",
    "CATALOG",
    "DROPPED_STALE",
    "Rejection",
    "RewardRow",
    "SampleRow",
    "SegmentRow",
    "SegmentStore",
    "Store",
    "StoreError",
    "StoredSample",
    "TrainableGroup",
]
