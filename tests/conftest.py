"""Shared fixtures: a fresh DuckLake store per test in a temporary folder."""

from __future__ import annotations

import sys

import pytest

from marsrl_core.store import SegmentStore


@pytest.fixture
def store_paths(tmp_path):
    return f"sqlite:{tmp_path}/lake.sqlite", str(tmp_path / "data")


@pytest.fixture
def store(store_paths):
    catalog, data = store_paths
    s = SegmentStore(catalog, data)
    yield s
    s.close()


@pytest.fixture(autouse=True)
def close_worker_stores():
    """After each test, close the stores `workers.store_for` opened (each serves from a child process)."""
    yield
    workers = sys.modules.get("marsrl_core.workers")
    if workers is not None:
        workers.close_stores()
