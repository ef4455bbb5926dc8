"""Test helpers for servers the tests start themselves (Prefect, vLLM): a free port, waiting until up."""

from __future__ import annotations

import socket
import subprocess
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, seconds: float) -> None:
    """Wait until `url` answers 200; fail with the server's output if it exits or takes too long."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            output = proc.stdout or proc.stderr
            raise AssertionError(f"server exited early: {output.read()[-3000:] if output else ''}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise AssertionError(f"{url} not up after {seconds} s")
