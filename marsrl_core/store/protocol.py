"""`Store`: the calls rollout, learner, flows and the SQL console make on the segment store.

Both `SegmentStore` (the connection in this process) and `StoreProcess` (the same calls served by a
child process) satisfy it, so code that takes a `Store` does not care which one it was given.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import pyarrow as pa

from marsrl_core.store.rows import (
    AppendResult,
    Rejection,
    RewardRow,
    SampleRow,
    SegmentRow,
    StoredSample,
    TrainableGroup,
)


@runtime_checkable
class Store(Protocol):
    catalog_url: str
    data_path: str

    @property
    def lock_retries(self) -> int: ...

    # writes
    def create_run(self, run_id: str, config: dict[str, Any]) -> None: ...
    def add_problems(self, run_id: str, problems: Iterable[Any]) -> int: ...
    def record_evaluation(self, run_id: str, label: str, dataset: str, metrics: dict[str, Any]) -> None: ...
    def mark(self, run_id: str, event: str, detail: str = "") -> None: ...
    def reject(self, run_id: str, rejections: Sequence[Rejection]) -> None: ...
    def append(
        self,
        run_id: str,
        samples: Sequence[SampleRow] = (),
        segments: Sequence[SegmentRow] = (),
        rewards: Sequence[RewardRow] = (),
    ) -> AppendResult: ...
    def commit_step(
        self,
        run_id: str,
        step: int,
        consumed: dict[str, Sequence[str]],
        checkpoint_uri: str,
        mlflow_run_id: str | None = None,
        metrics: dict[str, dict[str, float]] | None = None,
        dropped: dict[str, Sequence[str]] | None = None,
    ) -> None: ...

    # reads
    def evaluation(self, run_id: str, label: str) -> dict[str, Any] | None: ...
    def run_config(self, run_id: str) -> dict[str, Any] | None: ...
    def has_event(self, run_id: str, event: str) -> bool: ...
    def trainable_groups(self, run_id: str, agent: str, limit: int | None = None) -> list[TrainableGroup]: ...
    def trainable_groups_by_agent(
        self,
        run_id: str,
        agents: Sequence[str],
        limit: int | Mapping[str, int] | None = None,
        min_version: int | None = None,
    ) -> dict[str, list[TrainableGroup]]: ...
    def load_samples(self, run_id: str, sample_ids: Sequence[str]) -> dict[str, StoredSample]: ...
    def samples_of_problems(self, run_id: str, problem_ids: Sequence[str]) -> list[dict[str, Any]]: ...
    def known_problems(self, run_id: str, problem_ids: Sequence[str]) -> set[str]: ...
    def latest_version(self, run_id: str) -> tuple[int, str] | None: ...
    def query(self, sql: str, params: Sequence[Any] = ()) -> pa.Table: ...
    def count(self, table: str, run_id: str | None = None) -> int: ...
    def invariants(self, run_id: str) -> dict[str, int]: ...
    def group_counts(self, run_id: str) -> dict[str, dict[str, int]]: ...

    # maintenance
    def data_file_count(self) -> int: ...
    def compact(self, retention_s: float = 0.0) -> dict[str, int]: ...
    def close(self) -> None: ...


def store_calls() -> frozenset[str]:
    """The protocol's methods, the calls a `StoreProcess` forwards to its child (all but `close`)."""
    return frozenset(
        name for name, value in vars(Store).items() if not name.startswith("_") and callable(value) and name != "close"
    )
