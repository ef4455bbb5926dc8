"""The Prefect server that `marsrl` commands start for themselves (`flows/server.py`), for real."""

from __future__ import annotations

import time


def test_the_commands_local_server_records_task_runs(tmp_path, monkeypatch):
    """A Prefect 3 task run reaches the server's database only through the task run recorder: a
    `marsrl train` whose server lacked it would show each rollout batch with no agent tasks and the
    learner with no steps. Here a flow's task is recorded, with its final state, within seconds."""
    from prefect import flow, get_client, task
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.server import local_server

    @task(name="double")
    def double(x: int) -> int:
        return 2 * x

    @flow(name="doubled")
    def doubled(x: int) -> int:
        return double(x)

    # A database of its own: other tests' servers may be using the session's PREFECT_HOME.
    monkeypatch.setenv("PREFECT_API_DATABASE_CONNECTION_URL", f"sqlite+aiosqlite:///{tmp_path}/prefect.db")
    with temporary_settings(restore_defaults={PREFECT_API_URL}), local_server() as url:
        assert url is not None and url.startswith("http://127.0.0.1:")
        state = doubled(3, return_state=True)
        assert state.result() == 6
        only_this_run = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        deadline = time.monotonic() + 30
        with get_client(sync_client=True) as client:
            while True:
                runs = client.read_task_runs(flow_run_filter=only_this_run)
                if (runs and runs[0].state.is_completed()) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
    assert [r.name.rsplit("-", 1)[0] for r in runs] == ["double"]
    assert runs[0].state.is_completed() and runs[0].end_time is not None
