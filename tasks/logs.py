"""MarsRL's own lines for the user: in the current Prefect run's log (and on the terminal, however
quiet `flows/logs.py` makes Prefect's own lines), or printed outside a run."""

from __future__ import annotations

MARK = "marsrl_line"  # the attribute `say` puts on its log records


def say(message: str) -> None:
    """A line for the user: the current Prefect run's log (and the terminal, quiet or not); outside a run,
    a plain print."""
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        logger = get_run_logger()
    except MissingContextError:
        print(message, flush=True)
        return
    logger.info(message, extra={MARK: True})
