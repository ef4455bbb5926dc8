"""A lock between a SQLite catalog's compaction and every other use of it, across processes.

Why: with DuckLake 1.5.5 on a SQLite catalog, a query that runs while another process commits
`ducklake_merge_adjacent_files` can see the merged table without rows: measured with a writer, a
reader and a compacting process (`tests/test_store_processes.py`), a `SELECT sample_id FROM samples`
came back empty, and a reader's `commit_step` refused the 12 samples its previous query had just
returned, in about one 20-second run of five; the same query a moment later saw every row. The
same reader loops without a compacting process saw no such read. A read that misses rows is worse than a slow one
here: the rollout's resume and the store's append-by-key decide what to write from what they read.

So every query and transaction holds this lock shared, and compaction's catalog rewrites (flush,
merge, snapshot expiry) hold it exclusive. `flock` locks belong to an open file, so two connections of
one process exclude each other like two processes do, and a killed process's locks go with it. A
compaction first takes a turnstile exclusive, and a query passes the turnstile before it takes its
shared lock, so a steady stream of queries cannot starve a waiting compaction.

Deliberate simplifications: only local SQLite catalogs get the lock (their processes share a file
system); a Postgres catalog's processes run on several machines, and its merges run unlocked. A
reader that can neither create nor open the lock files (a SQL console on a folder it cannot write,
opened before any writer made them) runs unlocked too: its query may miss rows during a merge.
"""

from __future__ import annotations

import contextlib
import fcntl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO


def _open(catalog_file: Path, suffix: str) -> IO | None:
    """The lock file beside the catalog; opened for reading where the folder is read-only to this user
    (a SQL console), which `flock` allows; None where it cannot be opened at all."""
    path = catalog_file.with_name(catalog_file.name + suffix)
    for mode in ("a", "r"):
        try:
            return open(path, mode)
        except OSError:
            pass
    return None


class MaintenanceLock:
    """Shared for queries, exclusive for compaction; reentrant within one holder of `shared`."""

    def __init__(self, catalog_file: Path | None):
        self._files = None
        if catalog_file is not None:
            gate, turnstile = _open(catalog_file, ".maintenance"), _open(catalog_file, ".turnstile")
            self._files = (gate, turnstile) if gate and turnstile else None
        self._depth = 0
        self._thread_lock = threading.RLock()

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        """Hold the lock shared (a query or a write transaction)."""
        with self._thread_lock:
            take = self._files is not None and self._depth == 0  # an inner holder must not release it
            if take:
                gate, turnstile = self._files
                fcntl.flock(turnstile, fcntl.LOCK_SH)  # waits while a compaction waits or runs
                try:
                    fcntl.flock(gate, fcntl.LOCK_SH)
                finally:
                    fcntl.flock(turnstile, fcntl.LOCK_UN)
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if take:
                    fcntl.flock(gate, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the lock exclusive (a compaction's catalog rewrite): no query of any process runs."""
        with self._thread_lock:
            if self._files is None:
                yield
                return
            if self._depth > 0:
                raise RuntimeError("MaintenanceLock.exclusive inside shared: it would wait for itself")
            gate, turnstile = self._files
            fcntl.flock(turnstile, fcntl.LOCK_EX)
            try:
                fcntl.flock(gate, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(gate, fcntl.LOCK_UN)
            finally:
                fcntl.flock(turnstile, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._files is not None:
            for f in self._files:
                f.close()
            self._files = None
