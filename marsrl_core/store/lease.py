"""One learner per run: a lease its learner holds for as long as its process lives.

The lease is an exclusive `flock` on `<catalog>.learner-<run>.lock`, a file beside a SQLite catalog.
The operating system releases it when the holding process exits or is killed, so a crashed learner
never blocks a resume, while a second live learner of the same run (a second `marsrl train --resume`,
or `marsrl learn` beside a running train) is refused with an error that names the run and the holder
(written into the file: pid and host). Split `rollout`/`learn` processes share the catalog's folder,
so they see the same lock.

Deliberate simplification: with a Postgres catalog no lease is taken (the lock file needs a catalog on
a shared local file system); such a deployment must start one learner per run itself.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import socket
from pathlib import Path
from typing import IO

from marsrl_core.store.rows import StoreError


class LearnerLease:
    """The lease of `run_id`'s learner in the store at `catalog_url`; `release()` (or process exit) ends it."""

    def __init__(self, catalog_url: str, run_id: str):
        self.run_id = run_id
        self._file: IO[str] | None = None
        kind, _, target = catalog_url.partition(":")
        if kind != "sqlite":
            return
        catalog = Path(target).resolve()
        catalog.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256(run_id.encode()).hexdigest()[:16]  # any run id gives a safe file name
        self.path = catalog.with_name(f"{catalog.name}.learner-{digest}.lock")
        lock = open(self.path, "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            lock.close()
            raise StoreError(
                f"run {run_id!r} already has a learner ({holder}, lock {str(self.path)!r}): one learner per "
                "run; stop that one first (its lease ends when its process does)"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()} on {socket.gethostname()}")
        lock.flush()
        self._file = lock

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None
