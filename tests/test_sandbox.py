"""The sandbox that runs model-written code, attacked as a model output would attack it.

Each hostile program goes through the code check (`agents.code.check_program`) wrapped in a fenced
block, as a Solver's output would: the check returns "incorrect" with its reason (it never raises, so a
rollout goes on), and the host is unchanged afterwards. Bubblewrap is installed by `make test`'s
set-up; without it these tests fail (they are never skipped).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from marsrl_core.agents.code import CodeTests, check_program, last_python_block
from marsrl_core.sandbox import Sandbox, SandboxLimits, SandboxUnavailable

PROJECT = Path(__file__).resolve().parents[1]
ANY_OUTPUT = CodeTests(cases=(("", "never printed"),), time_limit_s=5)


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(SandboxLimits(memory_mb=512, processes=16, output_bytes=64 << 10))


def fenced(program: str) -> str:
    return f"Here is my solution.\n```python\n{program}\n```\n"


def rejected(sandbox: Sandbox, program: str, tests: CodeTests = ANY_OUTPUT) -> str:
    outcome = check_program(sandbox, fenced(program), tests)
    assert not outcome.correct
    assert outcome.reason
    return outcome.reason


def processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def test_code_check_passes_a_right_program_and_fails_a_wrong_one_in_the_sandbox(sandbox):
    tests = CodeTests(test="def check(f):\n    assert f(2, 3) == 5\n    assert f(-1, 1) == 0\n", entry_point="add")
    right = check_program(sandbox, fenced("def add(a, b):\n    return a + b"), tests)
    assert right.correct and right.reason == ""
    wrong = check_program(sandbox, fenced("def add(a, b):\n    return a - b"), tests)
    assert not wrong.correct and "AssertionError" in wrong.reason
    cases = CodeTests(cases=(("3\n", "6"), ("10\n", "20")))
    assert check_program(sandbox, fenced("print(int(input()) * 2)"), cases).correct
    assert check_program(sandbox, fenced("print(int(input()) + 3)"), cases).reason == "case 2: wrong output"
    assert check_program(sandbox, "no code at all", cases).reason == "no fenced Python block"


def test_code_check_takes_the_last_python_block_outside_thinking():
    text = "<think>```python\nbad()\n```</think>First:\n```python\nx = 1\n```\nFinal:\n```python\nx = 2\n```"
    assert last_python_block(text) == "x = 2\n"
    assert last_python_block("```\nplain = 1\n```") == "plain = 1\n"


def test_sandbox_cuts_an_infinite_loop_at_the_time_limit(sandbox):
    start = time.monotonic()
    reason = rejected(sandbox, "while True:\n    pass", CodeTests(cases=(("", ""),), time_limit_s=2))
    assert "timeout" in reason or "SIGKILL" in reason or "SIGXCPU" in reason
    assert time.monotonic() - start < 10


def test_sandbox_contains_a_fork_bomb(sandbox):
    marker = f"forkbomb-{uuid.uuid4().hex}"
    program = f"import os, time\nmarker = {marker!r}\nwhile True:\n    os.fork()\n    time.sleep(0.01)"
    reason = rejected(sandbox, program, CodeTests(cases=(("", ""),), time_limit_s=3))
    assert "timeout" not in reason  # RLIMIT_NPROC stopped it, not the clock
    result = sandbox.run(program, limits=replace(sandbox.limits, wall_s=3))
    assert not result.timed_out and "Resource temporarily unavailable" in result.stderr
    time.sleep(0.5)
    assert processes_with(marker) == []


def test_sandbox_refuses_8_gb_of_memory(sandbox):
    reason = rejected(sandbox, "block = bytearray(8 << 30)\nprint('allocated')")
    assert "MemoryError" in reason


def test_sandbox_cuts_a_2_gb_file(sandbox, tmp_path):
    program = "chunk = b'x' * (1 << 20)\nwith open('big', 'wb') as f:\n"
    program += "    for _ in range(2048):\n        f.write(chunk)"
    free_before = os.statvfs(tmp_path).f_bavail
    reason = rejected(sandbox, program)
    assert "SIGXFSZ" in reason or "No space left" in reason or "File too large" in reason
    assert os.statvfs(tmp_path).f_bavail >= free_before - (64 << 20) // os.statvfs(tmp_path).f_frsize


def test_sandbox_reaches_no_host_port(sandbox):
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    port = server.getsockname()[1]
    connected = []

    def accept() -> None:
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            try:
                connected.append(server.accept())
            except TimeoutError:
                pass

    listener = threading.Thread(target=accept)
    listener.start()
    program = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('never printed')"
    reason = rejected(sandbox, program)
    listener.join()
    server.close()
    assert "Connection refused" in reason or "unreachable" in reason
    assert connected == []


def test_sandbox_cannot_read_a_host_file(sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the-secret-value")
    secret.chmod(0o644)
    outcome = check_program(sandbox, fenced(f"print(open({str(secret)!r}).read())"), ANY_OUTPUT)
    assert not outcome.correct and "FileNotFoundError" in outcome.reason
    for path in ("/root/.ssh", "/etc/passwd", str(PROJECT / "README.md"), os.path.expanduser("~")):
        read = f"os.listdir({path!r}) if os.path.isdir({path!r}) else open({path!r}).read()"
        reason = rejected(sandbox, f"import os\nprint({read})")
        assert "FileNotFoundError" in reason, path


def test_sandbox_cannot_write_into_the_project_folder(sandbox):
    target = PROJECT / f"sandbox-escape-{uuid.uuid4().hex}.txt"
    before = sorted(p.name for p in PROJECT.iterdir())
    reason = rejected(sandbox, f"open({str(target)!r}, 'w').write('escaped')")
    assert "FileNotFoundError" in reason or "Read-only" in reason or "Permission" in reason
    assert not target.exists()
    assert sorted(p.name for p in PROJECT.iterdir()) == before


def test_sandbox_cannot_write_into_the_store_folder(sandbox, store, tmp_path):
    store.create_run("r", {})
    folder = tmp_path  # the fixture's catalog (lake.sqlite) and data folder (data/)
    before = sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
    assert "lake.sqlite" in before and "data" in before
    program = (
        "import os\n"
        f"for root in ({str(folder)!r}, {str(folder / 'data')!r}):\n"
        "    os.makedirs(root, exist_ok=True)\n"
        "    open(os.path.join(root, 'planted.parquet'), 'w').write('x')\n"
        "print('planted')"
    )
    # Under /tmp, the path exists only in the sandbox's own tmpfs: the plant lands there and is gone.
    assert rejected(sandbox, program) == "case 1: wrong output"
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) == before


def test_sandbox_cannot_kill_its_parent(sandbox):
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for pid in (os.getpid(), os.getppid(), victim.pid):
            reason = rejected(sandbox, f"import os, signal\nos.kill({pid}, signal.SIGKILL)\nprint('never printed')")
            assert "ProcessLookupError" in reason or "wrong output" in reason
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_sandbox_cannot_kill_pid_1(sandbox):
    reason = rejected(sandbox, "import os, signal\nos.kill(1, signal.SIGKILL)\nos.kill(-1, signal.SIGKILL)")
    assert reason
    assert Path("/proc/1").exists()


def test_sandbox_kills_a_child_that_left_the_session(sandbox):
    marker = f"orphan-{uuid.uuid4().hex}"
    program = (
        "import subprocess, sys, time\n"
        f"child = 'import time; time.sleep(120)  # {marker}'\n"
        "subprocess.Popen([sys.executable, '-c', child], start_new_session=True)\n"
        "time.sleep(120)"
    )
    reason = rejected(sandbox, program, CodeTests(cases=(("", ""),), time_limit_s=2))
    assert "timeout" in reason
    time.sleep(0.5)
    assert processes_with(marker) == []


def test_sandbox_caps_100_mb_of_output(sandbox):
    start = time.monotonic()
    reason = rejected(sandbox, "import sys\nsys.stdout.write('x' * (100 << 20))")
    assert reason == "case 1: output limit exceeded"
    assert time.monotonic() - start < 10
    result = sandbox.run("import sys\nsys.stdout.write('x' * (100 << 20))")
    assert result.output_capped and len(result.stdout) == sandbox.limits.output_bytes


def test_sandbox_environment_is_empty(sandbox, monkeypatch):
    monkeypatch.setenv("MARSRL_TEST_CREDENTIAL", "hunter2")
    result = sandbox.run("import os\nprint(sorted(os.environ))\nprint(os.getcwd())")
    assert result.ok
    assert "MARSRL_TEST_CREDENTIAL" not in result.stdout and "hunter2" not in result.stdout
    assert result.stdout.splitlines()[-1] == "/tmp"


def test_sandbox_refuses_to_start_without_namespaces():
    tmp_path = Path(tempfile.mkdtemp())  # not under pytest's 0700 folder: `nobody` runs it
    tmp_path.chmod(0o755)
    fake = tmp_path / "bwrap"  # what bubblewrap prints where user namespaces are disabled
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(SandboxUnavailable, match="cannot create user, pid and network namespaces") as err:
        Sandbox(bwrap=str(fake))
    assert "\n" not in str(err.value)
    with pytest.raises(SandboxUnavailable, match="not installed"):
        os.environ["PATH"], path = str(tmp_path / "empty"), os.environ["PATH"]
        try:
            Sandbox()
        finally:
            os.environ["PATH"] = path


def test_sandbox_signal_names_a_killed_program(sandbox):
    result = sandbox.run("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert result.returncode == -signal.SIGKILL and result.reason() == "killed by signal SIGKILL"
    assert sandbox.run("raise SystemExit(3)").reason() == "exit status 3"
