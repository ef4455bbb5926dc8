"""One learner per run: a second learner of a run is refused with an error naming the run and the
holder, for as long as the holder lives; a holder that dies (SIGKILL) leaves no lease behind. On a
SQLite catalog and on a Postgres one (another process, as a learner on another machine would be)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from marsrl_core.runtime.context import runtime
from marsrl_core.store import StoreError
from marsrl_core.store.lease import LearnerLease
from tests.configs import process_config_file, small_config

CATALOGS = ("sqlite", "postgres")  # a file lock beside SQLite, an advisory lock in Postgres (conftest)


def test_a_second_lease_of_a_run_is_refused_until_the_first_ends(store_paths):
    catalog, _ = store_paths
    first = LearnerLease(catalog, "r")
    with pytest.raises(StoreError, match=rf"run 'r' already has a learner \(pid {os.getpid()} on "):
        LearnerLease(catalog, "r")
    other = LearnerLease(catalog, "another run")  # other runs are free
    first.release()
    LearnerLease(catalog, "r").release()
    other.release()


def test_a_killed_holder_leaves_no_lease(store_paths, tmp_path):
    catalog, _ = store_paths
    script = textwrap.dedent(f"""
        import time
        from marsrl_core.store.lease import LearnerLease
        lease = LearnerLease({catalog!r}, "r")
        print("held", flush=True)
        time.sleep(600)
    """)
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StoreError, match=rf"pid {holder.pid} on "):
            LearnerLease(catalog, "r")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    LearnerLease(catalog, "r").release()  # the OS ended the dead holder's lease


@pytest.mark.slow
def test_marsrl_learn_refuses_a_run_whose_learner_is_running(tmp_path):
    """This process holds run `busy`'s learner (as a running `marsrl train` does); `marsrl learn` of
    the same run exits 2 with one line naming the run and this process, and trains nothing."""
    path = process_config_file(tmp_path, "lease", learner={"max_steps": 1})
    cfg = small_config(tmp_path)
    learner = runtime().learner(cfg, "busy")
    env = {**os.environ, "PREFECT_LOGGING_LEVEL": "WARNING", "PREFECT_HOME": str(tmp_path / "prefect")}
    command = [
        sys.executable,
        "-m",
        "flows.cli",
        "learn",
        "--config",
        str(path),
        "--run-id",
        "busy",
        "--idle-timeout",
        "1",
    ]
    refused = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert f"run 'busy' already has a learner (pid {os.getpid()} on " in refused.stderr
    assert "Traceback" not in refused.stderr
    assert learner.step == 0 and runtime().store(cfg).latest_version("busy") is None
