"""One learner per run: a lease its learner holds for as long as its process lives.

With a SQLite catalog the lease is an exclusive `flock` on `<catalog>.learner-<run>.lock`, a file
beside the catalog; split `rollout`/`learn` processes share the catalog's folder, so they see the same
lock. With a Postgres catalog (learners on other machines) it is a session-level advisory lock in
the catalog's database, keyed by the run (`pg_try_advisory_lock`), on a connection the lease keeps
open; the holder (pid and host) is recorded in a table of that database, `marsrl_learner_leases`.

Either way the lease ends when its holder's process exits or is killed (the OS closes the file, or
the server ends the dead connection's session and its locks), so a crashed learner never blocks a
resume, while a second live learner of the same run (a second `marsrl train --resume`, `marsrl learn`
beside a running train, or one on another machine) is refused with an error that names the run and
the holder.

Deliberate simplification: a Postgres server notices a holder's machine that vanished (no FIN, no
RST) only when TCP keepalive gives up on its connection; the lease's connection asks for keepalives
after 30 s idle, every 10 s, 3 tries.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import socket
from pathlib import Path
from typing import IO, Any

from marsrl_core.store.rows import StoreError


def _refusal(run_id: str, holder: str, where: str) -> StoreError:
    return StoreError(
        f"run {run_id!r} already has a learner ({holder}, {where}): one learner per run; stop that one "
        "first (its lease ends when its process does)"
    )


def _holder() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}"


class LearnerLease:
    """The lease of `run_id`'s learner in the store at `catalog_url`; `release()` (or process exit) ends it."""

    def __init__(self, catalog_url: str, run_id: str):
        self.run_id = run_id
        self._file: IO[str] | None = None
        self._connection: Any = None
        kind, _, target = catalog_url.partition(":")
        if kind == "postgres":
            self._advisory_lock(target)
        elif kind == "sqlite":
            self._file_lock(Path(target).resolve())

    def _file_lock(self, catalog: Path) -> None:
        catalog.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256(self.run_id.encode()).hexdigest()[:16]  # any run id gives a safe file name
        self.path = catalog.with_name(f"{catalog.name}.learner-{digest}.lock")
        lock = open(self.path, "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            lock.close()
            raise _refusal(self.run_id, holder, f"lock {str(self.path)!r}") from None
        lock.seek(0)
        lock.truncate()
        lock.write(_holder())
        lock.flush()
        self._file = lock

    def _advisory_lock(self, dsn: str) -> None:
        try:
            import psycopg
        except ImportError:
            raise StoreError(
                "catalog_url='postgres:...': the learner lease needs psycopg (pip install 'marsrl[cluster]')"
            ) from None
        # The lock's key: the run id's hash as a signed 64-bit integer (Postgres' bigint).
        key = int.from_bytes(hashlib.sha256(f"marsrl-learner:{self.run_id}".encode()).digest()[:8], "big", signed=True)
        try:
            con = psycopg.connect(dsn, autocommit=True, keepalives_idle=30, keepalives_interval=10, keepalives_count=3)
        except psycopg.Error as err:
            raise StoreError(f"learner lease: cannot connect to the catalog's database ({err})") from None
        con.execute(
            "CREATE TABLE IF NOT EXISTS marsrl_learner_leases (run_id text PRIMARY KEY, holder text, since timestamptz)"
        )
        if not con.execute("SELECT pg_try_advisory_lock(%s)", [key]).fetchone()[0]:
            row = con.execute("SELECT holder FROM marsrl_learner_leases WHERE run_id = %s", [self.run_id]).fetchone()
            con.close()
            raise _refusal(self.run_id, row[0] if row else "another process", "Postgres advisory lock")
        con.execute(
            "INSERT INTO marsrl_learner_leases VALUES (%s, %s, now()) "
            "ON CONFLICT (run_id) DO UPDATE SET holder = excluded.holder, since = excluded.since",
            [self.run_id, _holder()],
        )
        self._connection = con

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None
        if self._connection is not None:
            self._connection.close()  # the session ends, and its advisory lock with it
            self._connection = None
