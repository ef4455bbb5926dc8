"""A throw-away PostgreSQL server for the tests: `initdb` and `pg_ctl` in a temporary folder, on a free
port of 127.0.0.1, trust authentication for local connections, stopped at the end of the session.

The server binaries are Debian's `postgresql` package (`make test` installs it) or any `initdb` on
PATH. PostgreSQL refuses to run as root: as root the server runs as the `postgres` user (which the
package creates), else as the caller. Each test that asks for a catalog gets a database of its own.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from tests.servers import free_port


def server_binaries() -> Path | None:
    """A folder holding initdb, pg_ctl and createdb (Debian's newest, else one on PATH), or None."""
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[4]))
    candidates = [Path(p).parent for p in reversed(versions)]
    if shutil.which("initdb"):
        candidates.append(Path(shutil.which("initdb")).parent)
    tools = ("initdb", "pg_ctl", "createdb")
    return next((c for c in candidates if all((c / tool).exists() for tool in tools)), None)


class PostgresServer:
    def __init__(self, bin_dir: Path):
        self.bin_dir = bin_dir
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="marsrl-pg-"))
        self.data = self.root / "data"
        self.user = "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
        if os.geteuid() == 0:
            os.chown(self.root, pwd.getpwnam("postgres").pw_uid, pwd.getpwnam("postgres").pw_gid)
        self._run("initdb", "-D", str(self.data), "-U", self.user, "-A", "trust", "--no-sync", "-E", "UTF8")
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off -c max_connections=200"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-o", options, "-w", "start")

    def _run(self, tool: str, *args: str) -> str:
        command = [str(self.bin_dir / tool), *args]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        result = subprocess.run(command, capture_output=True, text=True, cwd=self.root)
        if result.returncode != 0:
            raise RuntimeError(f"{tool} failed: {result.stderr.strip() or result.stdout.strip()}")
        return result.stdout

    def dsn(self, dbname: str) -> str:
        return f"dbname={dbname} host=127.0.0.1 port={self.port} user={self.user}"

    def new_database(self) -> str:
        """A fresh, empty database; its libpq connection string."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user, name)
        return self.dsn(name)

    def stop(self) -> None:
        """Stop the server (immediately: its data is thrown away) and remove its folder."""
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "stop")
        except RuntimeError as err:  # already gone: nothing is left to stop
            print(f"postgres test server: {err}", file=sys.stderr)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
