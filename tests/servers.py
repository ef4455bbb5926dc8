"""Test helpers for servers the tests start themselves (Prefect, vLLM): a free port, waiting until up."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, seconds: float, accept: tuple[int, ...] = (200,)) -> None:
    """Wait until `url` answers (with a status in `accept`); fail with the server's output if it exits
    or takes too long."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            output = proc.stdout or proc.stderr
            raise AssertionError(f"server exited early: {output.read()[-3000:] if output else ''}")
        try:
            if httpx.get(url, timeout=2).status_code in accept:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise AssertionError(f"{url} not up after {seconds} s")


def start_vllm_server(folder: Path, max_model_len: int, dtype: str, wait_s: float, *extra: str):
    """A vLLM OpenAI-compatible server for `folder` on a free port, in dev mode (in-place weight reloads)
    with processed log-probs, as the `openai` engine needs; returns (process, base URL) once it answers."""
    port = free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
        + ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len), "--dtype", dtype]
        + ["--enforce-eager", "--logprobs-mode", "processed_logprobs", *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    base = f"http://127.0.0.1:{port}/v1"
    wait_http(f"{base}/models", server, wait_s)
    return server, base


def stop_process(proc: subprocess.Popen | None) -> None:
    """SIGTERM, then SIGKILL after 30 s."""
    if proc is None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def start_prefect_server(tmp_path: Path, server_env: dict[str, str] | None = None):
    """A real Prefect server on a free port (its log in a file: a pipe nobody reads would fill and block
    it), with `server_env` added to its environment; returns (process, API URL, the environment that
    points a process at it). Up once its health check answers (401 counts: an API that asks for auth)."""
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "WARNING",
    }
    log = tmp_path / "prefect-server.log"
    server = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env={**env, **(server_env or {})},
    )
    try:
        wait_http(f"{api}/health", server, 120, accept=(200, 401))
    except AssertionError as err:
        stop_process(server)
        raise AssertionError(f"{err}\n{log.read_text()[-3000:]}") from None
    return server, api, env
