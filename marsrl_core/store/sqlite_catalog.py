"""What a SQLite catalog needs to serve several store processes at once (the rollout's, the learner's).

- **WAL mode**, set once when the catalog is new (the mode is stored in the file), so readers run
  beside one writer.
- **Attach one at a time** (`attaching`): two processes creating a new catalog together collide.
- **One writer at a time** (`WriterLock`): DuckDB's SQLite extension sets no busy timeout, so a write
  that meets another process's write fails at once ("database is locked"), and the store's retry
  then runs the whole transaction again (its Parquet writes included) after a backoff that grows
  towards a second. An exclusive `flock` on `<catalog>.writer` around each transaction makes a writer
  wait exactly as long as the other's commit takes instead.
- **A keeper process** (`CatalogKeeper`) holding the catalog open while a store process serves it.
  DuckLake opens the SQLite file for each transaction and closes it after, and when the last
  connection to a WAL-mode file closes, SQLite checkpoints the log and deletes it; the next open
  creates it again. With two store processes doing this tens of times a second, one's open meets the
  other's checkpoint-and-delete and waits about a second. An idle connection in another process keeps
  the log alive.

The keeper is a process of its own, never a `sqlite3` connection inside a DuckDB process: Python's
`sqlite3` and DuckDB's SQLite extension are two copies of SQLite, and a copy that closes the file
drops the other copy's POSIX locks in that process and, seeing no other connection, deletes the WAL
under the other copy's open connection, which then commits into a deleted file and may later write
stale pages back ("database disk image is malformed", sqlite.org's "How To Corrupt An SQLite Database
File", 2.2.1). For the same reason `set_wal_mode` runs only on a catalog not yet in WAL mode, which no
DuckDB connection of the process has open.

Deliberate simplifications: the locks are `flock`s, so the processes share one file system (a
Postgres catalog needs none of this); a reader that cannot create the lock files (a SQL console on a
read-only folder) writes nothing and takes no writer lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from marsrl_core.store.rows import StoreError


def in_wal_mode(path: Path) -> bool:
    """Whether the SQLite file at `path` is in WAL mode: its header's write and read versions are 2."""
    try:
        with open(path, "rb") as file:
            header = file.read(20)
    except FileNotFoundError:
        return False
    except OSError as err:
        raise StoreError(f"catalog {str(path)!r}: cannot be read ({err.strerror})") from None
    return len(header) == 20 and header[18] == 2 and header[19] == 2


def set_wal_mode(path: Path) -> None:
    """Put the SQLite catalog at `path` in WAL mode, with Python's `sqlite3` closed again at once (see the
    module docstring: only on a catalog not yet in WAL mode)."""
    try:
        with contextlib.closing(sqlite3.connect(path, timeout=30)) as db:
            db.execute("PRAGMA journal_mode=WAL")
    except sqlite3.Error as err:
        raise StoreError(f"catalog {str(path)!r}: not writable ({err})") from None


@contextlib.contextmanager
def attaching(path: Path, create: bool) -> Iterator[None]:
    """Prepare a SQLite catalog (WAL) and hold an exclusive lock on `<catalog>.lock` while the caller
    attaches it: processes attach one at a time. Two processes creating a new catalog at once collide:
    in a measured 10 tries of two processes opening a new store together, one failed 8 times
    (DuckLake's initialisation: "database is locked"), and a reader polling a catalog still being
    created once saw "database disk image is malformed". A split run's rollout and learner processes
    start together on a new store."""
    if not path.exists() and not create:
        raise StoreError(f"catalog {str(path)!r}: no such store")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "a")
    except OSError as err:
        raise StoreError(f"catalog {str(path)!r}: not writable ({err})") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not in_wal_mode(path):
                set_wal_mode(path)
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class WriterLock:
    """An exclusive `flock` on `<catalog>.writer` for each write transaction, across processes; a no-op
    for a catalog that is not a local SQLite file, or whose folder this user cannot write."""

    def __init__(self, catalog_file: Path | None):
        self._file: IO | None = None
        if catalog_file is not None:
            try:
                self._file = open(catalog_file.with_name(catalog_file.name + ".writer"), "a")
            except OSError:
                self._file = None
        self._thread_lock = threading.Lock()  # one connection's threads: the flock is the file's, not the thread's

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        if self._file is None:
            yield
            return
        with self._thread_lock:
            fcntl.flock(self._file, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._file, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# The keeper: open the catalog, read it once (which keeps the WAL alive while the connection is open),
# then wait for its parent to close the pipe (or die).
_KEEPER = (
    "import sqlite3, sys\n"
    "db = sqlite3.connect(sys.argv[1], timeout=30)\n"
    "db.execute('SELECT count(*) FROM sqlite_master').fetchall()\n"
    "sys.stdout.write('open\\n'); sys.stdout.flush()\n"
    "sys.stdin.buffer.read()\n"
)


class CatalogKeeper:
    """A child process that holds the SQLite catalog at `path` (already in WAL mode) open until `close()`
    or until this process dies (its pipe closes)."""

    def __init__(self, path: Path):
        self.path = path
        self._process: subprocess.Popen | None = subprocess.Popen(
            [sys.executable, "-c", _KEEPER, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        if self._process.stdout.readline() != b"open\n":  # it could not open the catalog: run without it
            self.close()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def close(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.stdin.close()
        process.stdout.close()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
