"""The Prefect server that `marsrl` commands start for themselves (`flows/server.py`), for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# A `marsrl` command in a process of its own, whose first Prefect API is its own server. Run in the
# pytest process after other tests' servers, the task's state events did not reach this server (the
# cause inside Prefect's events client was not traced), so the check runs as a command does.
COMMAND = """
import json, sys, time
from prefect import flow, get_client, task
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from flows.server import local_server

@task(name="double")
def double(x):
    return 2 * x

@flow(name="doubled")
def doubled(x):
    return double(x)

with local_server() as url:
    state = doubled(3, return_state=True)
    only_this_run = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
    deadline = time.monotonic() + 30
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(flow_run_filter=only_this_run)
            if (runs and runs[0].state.is_completed()) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
print("RESULT " + json.dumps({
    "url": url,
    "value": state.result(),
    "tasks": [[r.name.rsplit("-", 1)[0], r.state.type.value, r.end_time is not None] for r in runs],
}))
"""


def test_the_commands_local_server_records_task_runs(tmp_path):
    """A Prefect 3 task run reaches the server's database only through the task run recorder: a
    `marsrl train` whose server lacked it would show each rollout batch with no agent tasks and the
    learner with no steps. Here a flow's task is recorded, with its final state, within seconds."""
    env = {
        key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"
    }  # no API configured: the command starts its own server
    env |= {
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{tmp_path}/prefect.db",
        "PYTHONPATH": str(Path(__file__).parents[1]),
    }
    done = subprocess.run(
        [sys.executable, "-c", COMMAND], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert done.returncode == 0 and line is not None, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(line.removeprefix("RESULT "))
    assert result["url"].startswith("http://127.0.0.1:") and result["value"] == 6
    assert result["tasks"] == [["double", "COMPLETED", True]], done.stderr[-3000:]
