"""Running model-written Python in a sandbox: bubblewrap namespaces plus resource limits.

A program runs as

    bwrap (user, pid, network, mount, IPC and UTS namespaces; as `nobody` when the caller is root)
      -> a launcher that lowers the resource limits (hard limits: the program cannot raise them)
        -> /usr/bin/python3 -I -S program.py   (or `python` in `SandboxLimits`)

What the program sees: `/usr` read-only (the system's Python and libraries), a fresh `/proc` of its
own pid namespace, a minimal `/dev`, and `/tmp`, a size-capped tmpfs that is its only writable place
and its working folder, gone when it ends. Nothing else of the host is mounted: not the project, the
store, checkpoints, the home folder, `/etc` or credentials. Its network namespace has only a
loopback interface of its own, so it reaches no host port. Its environment is empty but for `PATH`,
`HOME=/tmp` and `LANG`.

Limits (`SandboxLimits`): CPU seconds, address space, the size of a file it writes, open files and
processes (counted in its own user namespace, so concurrent sandboxes do not share the count; the
caller runs as `nobody` when it is root, since the kernel exempts root from the process limit), wall
time (the whole tree is killed at the limit: bwrap's process group is killed and the pid namespace dies
with its first process, which takes every descendant with it, including one that left the session)
and captured output (stdout and stderr, each cut at `output_bytes`; the program is killed once it
has written more than that).

`Sandbox()` checks on construction that bubblewrap is installed and can create the namespaces, and
raises `SandboxUnavailable` with one line saying why and how to enable it otherwise: the code
verifier never runs a program unsandboxed.

Deliberate simplifications: no seccomp filter (the namespaces and limits contain the program, a kernel
exploit is not contained: docs/reliability.md, "Running model-written code"); the tmpfs is capped in
size but counts against the host's memory while the program runs.
"""

from __future__ import annotations

import os
import resource
import selectors
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534
LAUNCHER = """\
import os, resource, sys
for name, value in {limits}:
    resource.setrlimit(getattr(resource, name), (value, value))
os.execv(sys.executable, [sys.executable, "-I", "-S", "/tmp/program.py"])
"""


class SandboxUnavailable(RuntimeError):
    """Bubblewrap is missing or cannot create the namespaces a sandbox needs."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one program may use."""

    wall_s: float = 10.0  # wall-clock, then the whole process tree is killed
    cpu_s: int = 10  # CPU seconds (RLIMIT_CPU)
    memory_mb: int = 1024  # address space of each process (RLIMIT_AS)
    file_mb: int = 16  # the largest file it may write (RLIMIT_FSIZE)
    tmp_mb: int = 64  # the size of its writable /tmp
    processes: int = 32  # processes and threads in its namespace (RLIMIT_NPROC)
    open_files: int = 64  # RLIMIT_NOFILE
    output_bytes: int = 1 << 20  # stdout and stderr are each kept up to this size
    python: str = "/usr/bin/python3"  # the interpreter inside (under /usr: nothing else is mounted)


@dataclass(frozen=True)
class SandboxResult:
    """How a program ended: `returncode` (negative: killed by that signal; a program that exits with a
    status over 128 reads as killed too, as bubblewrap reports a signal), whether the wall-clock
    limit or the output cap ended it, its output (cut at the cap) and its duration."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    output_capped: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.output_capped

    def reason(self) -> str:
        """One line: why the program did not pass ('' when it did)."""
        if self.timed_out:
            return f"timeout after {self.seconds:.1f} s"
        if self.output_capped:
            return "output limit exceeded"
        if self.returncode == 0:
            return ""
        if self.returncode is not None and self.returncode < 0:
            return f"killed by signal {signal.Signals(-self.returncode).name}"
        last = self.stderr.strip().splitlines()[-1:] or [f"exit status {self.returncode}"]
        return last[0][:300]


class Sandbox:
    """Runs Python programs under bubblewrap with `SandboxLimits`; see the module docstring."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), bwrap: str | None = None):
        self.limits = limits
        self.bwrap = bwrap or shutil.which("bwrap")
        if self.bwrap is None:
            raise SandboxUnavailable(
                "sandbox: bubblewrap (bwrap) is not installed; install Debian's `bubblewrap` package "
                "(apt-get install bubblewrap): model-written code is never run without it"
            )
        if not Path(limits.python).is_file():
            raise SandboxUnavailable(f"sandbox: python={limits.python!r} does not exist (it must lie under /usr)")
        probe = self.run("pass", limits=SandboxLimits(wall_s=30, python=limits.python))
        if not probe.ok:
            raise SandboxUnavailable(
                "sandbox: bubblewrap cannot create user, pid and network namespaces here "
                f"({probe.reason() or probe.stderr.strip()[:200]}); enable unprivileged user namespaces "
                "(sysctl kernel.unprivileged_userns_clone=1, or user.max_user_namespaces > 0) or run the "
                "code verifier in a container that allows them"
            )

    def command(self, limits: SandboxLimits) -> list[str]:
        """The bwrap command line (before the launcher)."""
        return [
            self.bwrap,
            "--unshare-user",
            "--unshare-pid",
            "--unshare-net",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--die-with-parent",
            "--new-session",
            "--ro-bind", "/usr", "/usr",
            "--symlink", "usr/lib", "/lib",
            "--symlink", "usr/lib64", "/lib64",
            "--symlink", "usr/bin", "/bin",
            "--proc", "/proc",
            "--dev", "/dev",
            "--size", str(limits.tmp_mb << 20),
            "--tmpfs", "/tmp",
            "--chdir", "/tmp",
            "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin",
            "--setenv", "HOME", "/tmp",
            "--setenv", "LANG", "C.UTF-8",
        ]  # fmt: skip

    def run(self, program: str, stdin: str = "", limits: SandboxLimits | None = None) -> SandboxResult:
        """Run `program` (Python source) with `stdin`; never raises for what the program does."""
        limits = limits or self.limits
        rlimits = [
            ("RLIMIT_CPU", limits.cpu_s),
            ("RLIMIT_AS", limits.memory_mb << 20),
            ("RLIMIT_FSIZE", limits.file_mb << 20),
            ("RLIMIT_NPROC", limits.processes),
            ("RLIMIT_NOFILE", limits.open_files),
            ("RLIMIT_CORE", 0),
        ]
        # The program and the launcher go in through file descriptors bwrap copies into /tmp
        # (`--file FD DEST`), so nothing of the host is bound for them.
        launcher_r, launcher_w = os.pipe()
        program_r, program_w = os.pipe()
        argv = [
            *self.command(limits),
            "--file", str(launcher_r), "/tmp/launch.py",
            "--file", str(program_r), "/tmp/program.py",
            limits.python, "-I", "-S", "/tmp/launch.py",
        ]  # fmt: skip
        start = time.monotonic()
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(launcher_r, program_r),
            preexec_fn=_unprivileged,
            cwd="/",
        )
        os.close(launcher_r)
        os.close(program_r)
        for fd, text in ((launcher_w, LAUNCHER.format(limits=rlimits)), (program_w, program)):
            _write_all(fd, text.encode())
        returncode, *rest = _collect(proc, stdin.encode(), limits)
        if returncode is not None and returncode > 128:  # bwrap exits 128 + n when the program died of signal n
            returncode = 128 - returncode
        return SandboxResult(returncode, *rest, seconds=time.monotonic() - start)


def _unprivileged() -> None:
    """In the child before bwrap: a session of its own (its group is killed at the limit), and as root,
    `nobody` instead (the kernel exempts root from RLIMIT_NPROC)."""
    os.setsid()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)


def _write_all(fd: int, data: bytes) -> None:
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BrokenPipeError:  # bwrap ended before reading it: its result says why
        pass


def _collect(proc: subprocess.Popen, stdin: bytes, limits: SandboxLimits) -> tuple[int | None, str, str, bool, bool]:
    """Feed stdin, read stdout and stderr up to the cap, kill the tree at the wall-clock limit or the cap."""
    try:
        proc.stdin.write(stdin)
        proc.stdin.close()
    except BrokenPipeError:
        pass
    out = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    selector = selectors.DefaultSelector()
    for stream in out:
        selector.register(stream, selectors.EVENT_READ)
    deadline = time.monotonic() + limits.wall_s
    timed_out = capped = False
    while selector.get_map():
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        for key, _ in selector.select(timeout=min(left, 0.5)):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                selector.unregister(key.fileobj)
                continue
            buffer = out[key.fileobj]
            kept = chunk[: max(0, limits.output_bytes - len(buffer))]
            buffer += kept
            capped = len(kept) < len(chunk)
        if capped:
            break
    selector.close()
    if timed_out or capped:
        _kill_tree(proc)
    try:
        returncode = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_tree(proc)
        returncode = proc.wait()
    for stream in out:
        stream.close()
    decode = lambda b: bytes(b).decode("utf-8", errors="replace")  # noqa: E731
    return returncode, decode(out[proc.stdout]), decode(out[proc.stderr]), timed_out, capped


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL bwrap's process group; its pid namespace, and all in it, dies with it (`--die-with-parent`)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


__all__ = ["Sandbox", "SandboxLimits", "SandboxResult", "SandboxUnavailable"]
