"""Prefect deployments of the MarsRL flows: `marsrl serve` (serve.py) or a worker (prefect.yaml)."""
