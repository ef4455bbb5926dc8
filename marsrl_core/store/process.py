"""The segment store served by a child process, replaced whenever its memory has grown past a budget.

Why: DuckDB 1.5.5 keeps a little native memory live for each query with a blocking operator (a join,
a DISTINCT, a GROUP BY) and for each DuckLake commit, for as long as the process lives and below
DuckDB's own accounting (`benchmarks/store_memory.py`: about 15 KB a learner poll, 18 KB an append
transaction). A rollout or learner process makes hundreds of these a minute for days, so with its
connection in-process its resident memory grows without bound, and closing and reopening the
connection in-process does not give that memory back. A process's memory does come back when it
exits.

`StoreProcess` offers the calls of the `Store` protocol, as `SegmentStore` does. Each call is sent
over a socket pair to a child process (`python -m marsrl_core.store.process`, which imports DuckDB
and the store, nothing else), run there on a `SegmentStore`, and its result, or its exception, is
sent back. With each reply the child reports its resident memory as it was before that call (the
previous call's result freed, this one's not yet made, so a large read is not taken for growth). Its
size after its first `warmup_calls` calls (100) is its baseline: counted from the first call
instead, a 12-minute soak replaced the learner's child every 45 s for its warm-up alone (about 60
MB). Once the child has grown `recycle_after_mb` past the baseline, it is told to close between
calls and a replacement is started at once, so it imports and attaches while the caller works (about
half a second), and the next call usually finds it ready.

A child that has died between calls (the OOM killer's choice, say) is replaced before the next call
is sent. A child that dies during a call is replaced too, and the call is sent again to the new one,
where it cannot write anything twice: the reads and maintenance calls write nothing; `mark`,
`create_run`, `add_problems` and `record_evaluation` skip what is already stored (events are only ever
asked about by presence); the other writes (`append`, `commit_step`, `reject`), which may or may not
have committed when their child died, go through `SegmentStore.replay`, which writes them only if
their first row is not stored yet.

Deliberate simplifications: calls are serialized by one lock, as they were on the one in-process
connection (a retry's backoff in the child now also holds the caller's other threads); a call is
sent again once, not in a loop; arguments and results travel pickled; a child whose parent dies
finishes its current call, then exits.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

from marsrl_core.faults import crash_point
from marsrl_core.store.protocol import store_calls
from marsrl_core.store.rows import StoreError
from marsrl_core.store.segment_store import SegmentStore
from marsrl_core.store.sqlite_catalog import CatalogKeeper
from marsrl_core.store.writes import KEYED_WRITES
from marsrl_core.timings import TIMINGS, timed

_OPEN, _CLOSE = "__open__", "__close__"
log = logging.getLogger(__name__)
FORWARDED = store_calls()


def resident_kb() -> int:
    """This process's resident memory in KB (Linux; 0 where /proc is missing, which never recycles)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
    except OSError:
        return 0


class StoreProcess:
    """A `SegmentStore` in a child process that is replaced when it has grown `recycle_after_mb`."""

    def __init__(
        self,
        catalog_url: str,
        data_path: str,
        *,
        recycle_after_mb: float = 64.0,
        warmup_calls: int = 100,
        max_retries: int = 200,
        create: bool = True,
        threads: int | None = None,
    ):
        self.catalog_url = catalog_url
        self.data_path = data_path
        self.recycle_after_mb = recycle_after_mb
        self.warmup_calls = warmup_calls
        self.recycled = 0  # children closed for having grown past the budget
        self.restarted = 0  # children replaced for having died
        self._store_kwargs = {
            "catalog_url": catalog_url,
            "data_path": data_path,
            "max_retries": max_retries,
            "create": create,
            "threads": threads,
        }
        self._lock = threading.RLock()
        self._child: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._opening = False  # the child's open reply is still to be read
        self._closed = False
        self._calls = 0  # calls the current child has answered
        self._baseline_kb: int | None = None  # its resident memory after `warmup_calls` calls
        self._last_status: int | None = None
        self._child_lock_retries = 0
        self._closed_lock_retries = 0
        with self._lock:
            self._start()
            self._finish_opening()  # a bad catalog or data path fails here, as SegmentStore's constructor does
        kind, _, target = catalog_url.partition(":")
        # The catalog's WAL lives while this store is used (`sqlite_catalog.py`), across child replacements.
        self._keeper = CatalogKeeper(Path(target)) if kind == "sqlite" else None

    @classmethod
    def from_config(cls, store_config: Any, **kwargs: Any) -> StoreProcess:
        return cls(
            store_config.catalog_url,
            store_config.data_path,
            recycle_after_mb=store_config.recycle_after_mb,
            threads=store_config.threads,
            **kwargs,
        )

    @property
    def lock_retries(self) -> int:
        """Lock retries of every child so far (`SegmentStore.lock_retries`)."""
        return self._closed_lock_retries + self._child_lock_retries

    @property
    def pid(self) -> int | None:
        """The serving child's process id (None after a child ended until the next call starts one)."""
        return self._child.pid if self._child is not None else None

    @property
    def keeper_pid(self) -> int | None:
        """The process id of the process holding a SQLite catalog open (`sqlite_catalog.CatalogKeeper`)."""
        return self._keeper.pid if self._keeper is not None and self._keeper.running else None

    def __getattr__(self, name: str) -> Any:
        if name not in FORWARDED:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

        def forward(*args: Any, **kwargs: Any) -> Any:
            return self._call(name, args, kwargs)

        forward.__name__ = name
        forward.__doc__ = getattr(SegmentStore, name).__doc__
        return forward

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._child is not None:
                self._stop(_CLOSE)
            if self._keeper is not None:
                self._keeper.close()

    # ------------------------------------------------------------------ the child's lifecycle
    def _start(self) -> None:
        """Start a child and send it the open request; its reply is read by the next call."""
        ours, theirs = socket.socketpair()
        try:
            child = subprocess.Popen(
                [sys.executable, "-m", "marsrl_core.store.process", str(theirs.fileno())], pass_fds=(theirs.fileno(),)
            )
        except OSError as err:
            ours.close()
            raise StoreError(f"catalog {self.catalog_url!r}: cannot start the store process ({err})") from None
        finally:
            theirs.close()
        self._child, self._conn = child, Connection(ours.detach())
        self._opening = True
        self._child_lock_retries = 0
        self._calls, self._baseline_kb = 0, None
        self._exchange(_OPEN, (), self._store_kwargs, receive=False)

    def _finish_opening(self) -> None:
        status, value, _, _ = self._exchange(_OPEN, (), {}, send=False)
        self._opening = False
        if status == "error":
            self._stop(None)
            raise value

    def _exchange(
        self, method: str, args: tuple, kwargs: dict, send: bool = True, receive: bool = True
    ) -> tuple[str, Any, int, int] | None:
        """Send a request and/or read its reply. If the child has gone, or the caller is interrupted
        between the two (a KeyboardInterrupt, a termination signal), the child is ended: a reply left
        in the socket would otherwise answer the next call."""
        if send:
            try:
                payload = ForkingPickler.dumps((method, args, kwargs))
            except Exception as err:  # nothing was sent: the child serves on
                raise StoreError(f"{method}(): its arguments cannot be sent to the store process ({err})") from None
        try:
            if send:
                self._conn.send_bytes(payload)
            return self._conn.recv() if receive else None
        except (EOFError, OSError):
            pid = self._child.pid
            self._stop(None)
            raise _ChildEnded(
                f"store process {pid} for catalog {self.catalog_url!r} ended during {method}() "
                f"(exit status {self._last_status})"
            ) from None
        except BaseException:
            self._stop(None, kill=True)
            raise

    def _stop(self, request: str | None, kill: bool = False) -> None:
        """Ask the child to close its store (`request`), or just hang up (or kill it), and reap it."""
        child, conn = self._child, self._conn
        self._child = self._conn = None
        self._opening = False
        self._closed_lock_retries += self._child_lock_retries
        self._child_lock_retries = 0
        try:
            if request is not None:
                conn.send((request, (), {}))
        except OSError:
            pass
        conn.close()
        if kill:
            child.kill()
        try:
            self._last_status = child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            self._last_status = child.wait()

    def _call(self, method: str, args: tuple, kwargs: dict) -> Any:
        asked = time.perf_counter()
        with self._lock, timed(f"store.{method}"):
            TIMINGS.add("store.lock_wait", time.perf_counter() - asked)
            if self._closed:
                raise StoreError(f"catalog {self.catalog_url!r}: {method}() on a closed store")
            if self._child is not None and self._child.poll() is not None:  # died between calls
                log.warning("store process %d ended (exit status %s); starting a new one", *self._reap())
                self.restarted += 1
            try:
                status, value, self._child_lock_retries, child_kb = self._send(method, args, kwargs)
            except _ChildEnded as ended:
                self.restarted += 1
                log.warning("%s; sending %s() again to a new one", ended, method)
                if method in KEYED_WRITES:  # written only if it had not committed
                    method, args, kwargs = "replay", (method, args, kwargs), {}
                status, value, self._child_lock_retries, child_kb = self._send(method, args, kwargs)
            self._calls += 1
            if self._calls == self.warmup_calls:
                self._baseline_kb = child_kb
            elif self._baseline_kb is not None and child_kb - self._baseline_kb > self.recycle_after_mb * 1024:
                self._recycle()
            if status == "error":
                raise value
            return value

    def _reap(self) -> tuple[int, int | None]:
        """End a child that died between calls; its (pid, exit status)."""
        pid = self._child.pid
        self._stop(None)
        return pid, self._last_status

    def _send(self, method: str, args: tuple, kwargs: dict) -> tuple[str, Any, int, int]:
        """Send one call to the child (started first if there is none) and read its reply."""
        if self._child is None:
            self._start()
        if self._opening:
            self._finish_opening()
        return self._exchange(method, args, kwargs)

    def _recycle(self) -> None:
        """Replace the child between calls; the call that triggered it has its answer already, so a
        replacement that fails to start is left for the next call to start (and report)."""
        self._stop(_CLOSE)
        self.recycled += 1
        try:
            self._start()  # the replacement imports and attaches while the caller works
        except StoreError:
            if self._child is not None:
                self._stop(None)


class _ChildEnded(StoreError):
    """The child ended before it answered (`_call` decides whether the call is sent again)."""


# ---------------------------------------------------------------------- the child
def _sendable(err: BaseException) -> BaseException:
    """The exception itself if it pickles (with the child's traceback as a note), else a StoreError."""
    note = "raised in the store process:\n" + "".join(traceback.format_exception(err)).rstrip()
    try:
        err.add_note(note)
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        copy = StoreError(f"{type(err).__name__}: {err}")
        copy.add_note(note)
        return copy


def serve(conn: Connection) -> None:
    """Answer calls on `conn` with one SegmentStore until told to close or the parent hangs up."""
    store: SegmentStore | None = None
    while True:
        try:
            method, args, kwargs = conn.recv()
        except (EOFError, OSError):
            break
        if method == _CLOSE:
            break
        size_kb = resident_kb()  # before the call: the previous call's result is freed, this one's not made
        result: Any = None
        try:
            if method == _OPEN:
                store = SegmentStore(**kwargs)
            elif store is None:
                raise StoreError(f"{method}() before the store process opened its store")
            else:
                crash_point("store.call")
                result = getattr(store, method)(*args, **kwargs)
            reply = ("ok", result)
        except Exception as err:
            reply = ("error", _sendable(err))
        del result
        try:
            conn.send((*reply, store.lock_retries if store else 0, size_kb))
        except (OSError, EOFError):
            break
        except Exception as err:  # a result that does not pickle
            conn.send(("error", _sendable(err), store.lock_retries if store else 0, size_kb))
        del reply
    if store is not None:
        store.close()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal reaches the parent, which closes us
    serve(Connection(int(sys.argv[1])))
