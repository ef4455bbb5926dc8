"""The outcome checks' section: the worker pool that judges final outputs and the code sandbox's limits."""

from __future__ import annotations

from pydantic import Field

from marsrl_core.config.base import _Section


class OutcomeConfig(_Section):
    workers: int = Field(
        2,
        ge=0,
        description="Worker processes that check final outputs (a math answer with math-verify, a program "
        "against its tests in the sandbox) side by side for the rollouts and the evaluation, each check cut "
        "at `timeout_s` (`agents/outcomes.py`). 0 checks in the calling thread with no time limit: for "
        "integer answers only (the tiny demo), since math-verify's own timeouts need a main thread.",
    )
    timeout_s: float = Field(
        30.0,
        gt=0,
        description="Wall-clock limit of one check; a check cut there is incorrect, its outcome 'timeout', "
        "and its worker is replaced.",
    )
    sandbox_memory_mb: int = Field(1024, ge=16, description="Code checks: address space of each process.")
    sandbox_processes: int = Field(32, ge=1, description="Code checks: processes and threads a program may run.")
    sandbox_tmp_mb: int = Field(64, ge=1, description="Code checks: size of the program's writable /tmp.")
    sandbox_output_kb: int = Field(1024, ge=1, description="Code checks: stdout and stderr kept, each.")
    sandbox_python: str = Field(
        "/usr/bin/python3",
        description="Code checks: the interpreter inside the sandbox; it must lie under /usr, the only host "
        "folder the sandbox mounts.",
    )
