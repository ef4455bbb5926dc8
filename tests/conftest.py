"""Shared fixtures: a fresh DuckLake store per test in a temporary folder, and a test run that leaves
the working tree as it found it.

Every test runs in its own temporary folder (the working directory is `tmp_path`), so a relative
default (the store under `marsrl/`, `mlflow.db`, `benchmarks/results/`) lands there; the whole session
shares one Prefect home outside the tree, set before Prefect is imported.
"""

from __future__ import annotations

import os
import sys
import tempfile

import pytest

os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="marsrl-tests-prefect-")
from marsrl_core.cli import offline_and_quiet  # noqa: E402

offline_and_quiet()  # as the `marsrl` command does: before transformers is imported
# The flows tested in this process run against Prefect's temporary server, which gets 20 s to start by
# default; a busy 2-core machine has taken longer, and the first flow of the session then failed.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
# Prefect's console log handler binds the stderr of the moment Prefect is first imported. Imported here,
# that is the session's stream; first imported inside a test that captures output (capsys), it would be
# that test's stream, closed after it, and every later Prefect log line would fail.
import prefect.main  # noqa: E402, F401

from marsrl_core.store import SegmentStore  # noqa: E402  (after PREFECT_HOME: it may import Prefect's settings)
from tests import worktree  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def working_tree_unchanged():
    """Fails the run if any test created, changed or deleted a file of the working tree."""
    before = worktree.snapshot()
    yield
    changed = worktree.changes(before, worktree.snapshot())
    if changed:
        pytest.fail("the test run changed the working tree:\n  " + "\n  ".join(changed[:50]), pytrace=False)


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def postgres_server():
    """A throw-away PostgreSQL server for the session (`tests/postgres.py`)."""
    from tests.postgres import PostgresServer, server_binaries

    bin_dir = server_binaries()
    if bin_dir is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl): install Debian's postgresql (make test does)")
    server = PostgresServer(bin_dir)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_server():
    """An S3-compatible endpoint for the session: moto's standalone server on a free port."""
    import shutil
    import subprocess
    from pathlib import Path

    from tests.servers import free_port, stop_process, wait_http

    binary = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
    if not Path(binary).exists():
        pytest.skip("no moto_server (the dev extra's moto[server]): the data-on-S3 leg needs an S3 endpoint")
    port = free_port()
    server = subprocess.Popen(
        [binary, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/moto-api/", server, 60)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(server)


@pytest.fixture
def prefect_server(tmp_path):
    """A real Prefect server for the test; yields its API URL and the environment that points a process
    at it."""
    from tests.servers import start_prefect_server, stop_process

    server, api, env = start_prefect_server(tmp_path)
    try:
        yield api, env
    finally:
        stop_process(server)


@pytest.fixture
def catalog_kind():
    """The DuckLake catalog of `store_paths`: SQLite, unless the module lists `CATALOGS`."""
    return "sqlite"


def pytest_generate_tests(metafunc):
    """A module with `CATALOGS = ("sqlite", "postgres")` runs each of its store tests on each catalog."""
    kinds = getattr(metafunc.module, "CATALOGS", None)
    chosen = any(m.args and m.args[0] == "catalog_kind" for m in metafunc.definition.iter_markers("parametrize"))
    if kinds and "catalog_kind" in metafunc.fixturenames and not chosen:
        metafunc.parametrize("catalog_kind", kinds)


@pytest.fixture
def store_paths(tmp_path, catalog_kind, request):
    """(catalog URL, data path) of a new store: a SQLite file, or a fresh database on the session's
    PostgreSQL server; with "postgres+s3" the data goes to a fresh bucket of the session's S3 endpoint
    (the cluster shape), its credentials in the environment as a deployment sets them."""
    if catalog_kind == "sqlite":
        return f"sqlite:{tmp_path}/lake.sqlite", str(tmp_path / "data")
    catalog = "postgres:" + request.getfixturevalue("postgres_server").new_database()
    if catalog_kind == "postgres":
        return catalog, str(tmp_path / "data")
    import uuid

    import boto3

    endpoint = request.getfixturevalue("s3_server")
    monkeypatch = request.getfixturevalue("monkeypatch")
    for name, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"), ("AWS_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    bucket = f"lake-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    return catalog, f"s3://{bucket}/data/"


@pytest.fixture
def store(store_paths):
    catalog, data = store_paths
    s = SegmentStore(catalog, data)
    yield s
    s.close()


@pytest.fixture(autouse=True)
def close_worker_stores():
    """After each test, close the stores the process's runtime opened (each serves from a child process)."""
    yield
    context = sys.modules.get("marsrl_core.runtime.context")
    if context is not None:
        context.runtime().close()
