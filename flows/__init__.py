"""Prefect flows: compositions of tasks; each takes the pydantic config so the UI renders a form."""
