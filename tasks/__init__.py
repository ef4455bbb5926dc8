"""Prefect tasks: thin wrappers, one call into `marsrl_core` each; they pass ids, never tensors."""
