"""CPU seconds of a process tree by role: how much of the machine's cores a run kept busy, and with what.

`snapshot()` reads this process and its live descendants (pid -> role, CPU seconds, user + system);
`spent(before, after)` is what each role used between two snapshots. Roles, by command line: `store`
(the store's child processes, `marsrl_core.store.process`), `prefect server`, `outcome checks` (their
worker processes), `this process` (the decode loop, the learner, the flows, the MLflow and Prefect
clients) and `other`. A child that exited between the snapshots is not counted, so the figures are a
lower bound. `busy_fraction(seconds, wall)` is the share of the cores' time a run used:
`seconds / (cores x wall)`; a run near 1 leaves nothing for overlap to fill.

Imports psutil alone, so a benchmark's driver can use it on another checkout's code.
"""

from __future__ import annotations

import os

import psutil


def _role(process: psutil.Process, me: int) -> str:
    if process.pid == me:
        return "this process"
    command = " ".join(process.cmdline())
    if "marsrl_core.store.process" in command:
        return "store"
    if "prefect" in command and "server" in command:
        return "prefect server"
    if "outcomes" in command or "multiprocessing" in command:
        return "outcome checks"
    return "other"


def snapshot() -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds so far) for this process and its live descendants."""
    me = psutil.Process()
    found = {}
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
            found[process.pid] = (_role(process, me.pid), times.user + times.system)
        except psutil.Error:  # it exited while being read
            pass
    return found


def spent(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per role between two snapshots (a process new since `before` counts in full)."""
    by_role: dict[str, float] = {}
    for pid, (role, seconds) in after.items():
        by_role[role] = by_role.get(role, 0.0) + seconds - before.get(pid, (role, 0.0))[1]
    return dict(sorted(by_role.items(), key=lambda kv: -kv[1]))


def cores() -> int:
    return len(os.sched_getaffinity(0))


def busy_fraction(seconds: float, wall_s: float) -> float:
    return seconds / (cores() * wall_s)
