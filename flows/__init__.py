"""Prefect flows: compositions of tasks; each takes the pydantic config so the UI renders a form."""

import os

# No telemetry: these machines have no route to it, and each failed attempt costs time in the server.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
