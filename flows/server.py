"""A local Prefect API server for one `marsrl` command, as a child process that dies with it.

With no Prefect API configured (no `PREFECT_API_URL` in the environment or the profile), Prefect
starts a temporary server of its own on the first flow run and stops it at exit, from an `atexit`
hook. A process killed with SIGKILL (the OOM killer, a scheduler's hard stop) runs no hook, and that
server lives on. So `local_server()` starts the server itself, with Prefect's own command (`prefect
server start`, without the UI, on a free port of 127.0.0.1), asks the kernel to kill it when this
process dies (Linux `PR_SET_PDEATHSIG`), waits for its health check, and points this process's
Prefect settings at it for the block (`temporary_settings`, so the flows' threads, which copy the
calling context, see it too).

Its services (`SERVER_SERVICES`): those that record what the flows report run, the others do not.
A Prefect 3 task run reaches the database only through its state events, which the task run recorder
writes, so a server without it (`--no-services`) shows flow runs with no tasks. By default the
recorder writes each event in a transaction of its own; on SQLite, a write that lands between another
request's read and its write fails that request ("database is locked", HTTP 503), and the client sends
it again after 2 s, then 4 s. A rollout subflow's creation meets this a few times in a 50-step
Solver-only run, and the decode loop can run out of batches meanwhile. The recorder here writes up to
25 events at a time, at least every second, so its writes are fewer (`docs/benchmarks.md`). The loop
services (deployment schedules, late and lost runs, worker health, pauses, automations) serve
deployments and workers, which a server living for one command has none of.

A configured API (a `prefect server start` the user runs, Prefect Cloud) is used as it is.

Deliberate simplifications: the parent-death signal is Linux's; elsewhere the server is stopped on
every exit but a SIGKILL, as Prefect's own is. The server keeps its database in `PREFECT_HOME`, as
Prefect's temporary server does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from prefect.logging.handlers import APILogHandler
from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

# Environment of the server: services on (the recorders) or off (the loops), and the recorder's batching.
SERVER_SERVICES = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "25",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
    **{
        f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false"
        for name in (
            "SCHEDULER",
            "LATE_RUNS",
            "FOREMAN",
            "CANCELLATION_CLEANUP",
            "PAUSE_EXPIRATIONS",
            "REPOSSESSOR",
            "TRIGGERS",
            "CLEANUP_RECONCILER",
        )
    },
}
STARTUP_TIMEOUT_S = 180.0  # a busy 2-core machine has taken over 20 s (Prefect's own temporary-server limit)
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: the kernel sends it SIGKILL when its parent dies."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def local_server(timeout_s: float = STARTUP_TIMEOUT_S) -> Iterator[str | None]:
    """Run the block against a Prefect server that dies with this process; yields its API URL (None
    when an API is configured, which the block then uses)."""
    if get_current_settings().api.url:
        yield None
        return
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    command = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    errors = tempfile.TemporaryFile()  # a file, not a pipe: a pipe nobody reads would fill and block the server
    server = subprocess.Popen(
        [*command, "--no-ui", "--log-level", "ERROR"],
        stdout=subprocess.DEVNULL,
        stderr=errors,
        preexec_fn=_die_with_parent,
        env={**os.environ, **SERVER_SERVICES},
    )
    try:
        _wait_until_healthy(server, errors, url, timeout_s)
        with temporary_settings({PREFECT_API_URL: url}):
            try:
                yield url
            finally:
                APILogHandler().flush()  # the run's last log lines reach the server before it stops
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        errors.close()


def _wait_until_healthy(server: subprocess.Popen, errors, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise RuntimeError(
                    f"the local Prefect server exited with status {server.returncode} before it answered: "
                    f"{_tail(errors)}"
                )
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
    raise RuntimeError(f"the local Prefect server at {url} did not answer within {timeout_s:.0f} s")


def _tail(file, size: int = 2000) -> str:
    file.seek(0)
    return file.read().decode(errors="replace")[-size:]
