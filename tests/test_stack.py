"""The compose stack lets no one in: every credential from the environment (the stack refuses to start
while one is unset or empty), ports on 127.0.0.1, and the two servers it runs asking for their
credentials: a real Prefect server with its API auth string and a real MLflow server with basic auth,
started here as `docker-compose.yml` starts them."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.servers import free_port, start_prefect_server, stop_process, wait_http

ROOT = Path(__file__).parents[1]
COMPOSE = shutil.which("docker-compose") or str(Path(sys.executable).with_name("docker-compose"))


def credentials() -> list[str]:
    """The variables `.env.example` lists (each must be given a value)."""
    lines = (ROOT / ".env.example").read_text().splitlines()
    return [line.split("=")[0] for line in lines if re.match(r"^[A-Z_]+=$", line)]


def given(**extra: str) -> dict[str, str]:
    values = {name: f"value-of-{name.lower()}" for name in credentials()}
    return {"PATH": "/usr/bin:/bin", **values, **extra}


def compose_config(env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess:
    # Run from a folder of its own with a copy of the file: a developer's own `.env` beside the
    # project's file must not fill in what the test leaves out.
    shutil.copy(ROOT / "docker-compose.yml", tmp_path / "docker-compose.yml")
    return subprocess.run(
        [COMPOSE, "-f", str(tmp_path / "docker-compose.yml"), "config", "--format", "json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )


def test_every_credential_comes_from_the_environment_and_none_is_written_in_the_file(tmp_path):
    names = credentials()
    assert len(names) >= 6
    required = set(re.findall(r"\$\{([A-Z_]+):\?", (ROOT / "docker-compose.yml").read_text()))
    assert required == set(names)  # .env.example lists exactly what the stack requires
    ok = compose_config(given(), tmp_path)
    assert ok.returncode == 0 and not ok.stderr.strip(), ok.stderr
    rendered = ok.stdout
    for name in names:
        assert f"value-of-{name.lower()}" in rendered, name
    services = json.loads(rendered)["services"]
    assert {"postgres", "minio", "prefect-server", "mlflow", "worker"} <= set(services)
    assert services["worker"]["environment"]["PREFECT_API_URL"].startswith("http://prefect-server")
    broken = subprocess.run([COMPOSE, "-f", "-", "config"], input="services: [a]\n", capture_output=True, text=True)
    assert broken.returncode != 0 or "services must be a mapping" in broken.stderr  # the parser really validates
    for service in services.values():
        for key, value in (service.get("environment") or {}).items():
            secret = any(word in key for word in ("PASSWORD", "SECRET", "AUTH_STRING"))
            assert not secret or value.startswith("value-of-"), f"{key}={value!r} is written in the file"
    # The servers are started with their credentials (as the tests below start them) and clients use them.
    assert services["prefect-server"]["environment"]["PREFECT_SERVER_API_AUTH_STRING"] == "value-of-prefect_auth_string"
    assert services["worker"]["environment"]["PREFECT_API_AUTH_STRING"] == "value-of-prefect_auth_string"
    assert "--app-name basic-auth" in services["mlflow"]["command"][-1]
    assert services["worker"]["environment"]["MLFLOW_TRACKING_PASSWORD"] == "value-of-mlflow_tracking_password"
    assert "password" not in (ROOT / "deployments" / "cluster.yaml").read_text().split("catalog_url")[1].split("\n")[0]
    for name in names:
        for missing in (given(**{name: ""}), {k: v for k, v in given().items() if k != name}):
            result = compose_config(missing, tmp_path)
            assert result.returncode != 0 or result.stderr.strip(), name
            assert name in result.stderr and "missing a value" in result.stderr, result.stderr


def test_services_publish_on_localhost_unless_told_otherwise(tmp_path):
    def host_ips(env):
        services = json.loads(compose_config(env, tmp_path).stdout)["services"]
        return {port["host_ip"] for s in services.values() for port in s.get("ports", [])}

    assert host_ips(given()) == {"127.0.0.1"}
    assert host_ips(given(MARSRL_BIND_ADDRESS="10.0.0.5")) == {"10.0.0.5"}


def test_dot_env_is_ignored_by_git_and_its_example_is_empty():
    assert subprocess.run(["git", "check-ignore", "-q", ".env"], cwd=ROOT).returncode == 0
    assert subprocess.run(["git", "check-ignore", "-q", ".env.example"], cwd=ROOT).returncode == 1
    assert all(
        line.endswith("=")
        for line in (ROOT / ".env.example").read_text().splitlines()
        if "=" in line[:40] and not line.startswith("#")
    )


@pytest.mark.slow
def test_the_prefect_api_asks_for_its_auth_string(tmp_path):
    server, api, _ = start_prefect_server(tmp_path, {"PREFECT_SERVER_API_AUTH_STRING": "marsrl:s3cret"})
    try:
        basic = lambda text: {"Authorization": "Basic " + base64.b64encode(text.encode()).decode()}  # noqa: E731
        assert httpx.post(f"{api}/flows/filter", json={}).status_code == 401
        assert httpx.post(f"{api}/flows/filter", json={}, headers=basic("marsrl:wrong")).status_code == 401
        assert httpx.post(f"{api}/flows/filter", json={}, headers=basic("marsrl:s3cret")).status_code == 200
    finally:
        stop_process(server)


@pytest.mark.slow
def test_mlflow_asks_for_a_user_and_password(tmp_path):
    port = free_port()
    (tmp_path / "basic_auth.ini").write_text(
        "[mlflow]\ndefault_permission = NO_PERMISSIONS\n"
        f"database_uri = sqlite:///{tmp_path}/auth.db\nadmin_username = admin\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "MLFLOW_AUTH_CONFIG_PATH": str(tmp_path / "basic_auth.ini"),
        "MLFLOW_AUTH_ADMIN_PASSWORD": "s3cret-admin",
        "MLFLOW_FLASK_SERVER_SECRET_KEY": "test-key",
    }
    mlflow = str(Path(sys.executable).with_name("mlflow"))
    command = [mlflow, "server", "--app-name", "basic-auth", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--backend-store-uri", f"sqlite:///{tmp_path}/mlflow.db", "--workers", "1"]
    log = tmp_path / "mlflow.log"
    server = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        url = f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/search?max_results=1"
        try:
            wait_http(url, server, 180, accept=(200, 401))
        except AssertionError as err:
            raise AssertionError(f"{err}\n{log.read_text()[-3000:]}") from None
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, auth=("admin", "wrong")).status_code == 401
        assert httpx.get(url, auth=("admin", "s3cret-admin")).status_code == 200
    finally:
        stop_process(server)
