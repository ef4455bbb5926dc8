"""Crash injection for the reliability tests: `crash_point(name)` kills this process with SIGKILL
the n-th time it reaches `name`, when the environment variable `MARSRL_CRASH_AT="name:n"` is set.

The points sit where a crash hurts most: after a rollout stage decoded but before its store append
(`rollout.append`), after an optimizer update but before its checkpoint (`learner.update`), half-way
through writing a checkpoint (`checkpoint.write`), between the checkpoint's rename and the store
commit that publishes it (`checkpoint.commit`), half-way through the background write that makes a
committed version durable (`checkpoint.durable`), and in the store's child process before it runs a call
(`store.call`: every child the store process starts dies at its n-th call). With the variable unset
a call is one dict lookup.

`"name:n@r"` kills only the learner rank r (the process whose `RANK` is r) of a multi-rank learner.

Deliberately simple: one point per process run, counted per process (a resumed process counts anew).
"""

from __future__ import annotations

import os
import signal
import threading

POINTS = (
    "rollout.append",
    "learner.update",
    "checkpoint.write",
    "checkpoint.commit",
    "checkpoint.durable",
    "store.call",
)
_counts: dict[str, int] = {}
_lock = threading.Lock()


def _target() -> tuple[str, int] | None:
    spec = os.environ.get("MARSRL_CRASH_AT")
    if not spec:
        return None
    spec_point, _, rank = spec.partition("@")
    name, _, nth = spec_point.partition(":")
    if rank and os.environ.get("RANK", "0") != rank:
        return None
    if name not in POINTS:
        raise ValueError(f"MARSRL_CRASH_AT={spec!r}: unknown crash point {name!r}; choose one of {POINTS}")
    return name, int(nth or 1)


def crash_point(name: str) -> None:
    """SIGKILL this process here if MARSRL_CRASH_AT names this point and this is its n-th arrival."""
    target = _target()
    if target is None or target[0] != name:
        return
    with _lock:
        _counts[name] = _counts.get(name, 0) + 1
        if _counts[name] == target[1]:
            os.kill(os.getpid(), signal.SIGKILL)
