"""What the `marsrl` command shows on the terminal, and what goes to Prefect (the UI) either way.

Quiet by default: Prefect's INFO lines of its own (a task run created, a run finished in a state) and
vLLM's start-up INFO lines stay off the terminal; MarsRL's own lines (`say`: a learner step, evaluation
progress, a run's end) and every warning and error show. `-v` shows everything. Only the terminal is
quieted: Prefect's API handler still receives every line, so the UI's logs are complete.
"""

from __future__ import annotations

import logging

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


class _Quiet(logging.Filter):
    """Drops Prefect's own records below WARNING on the terminal while `enabled`."""

    enabled = True

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.enabled or record.levelno >= logging.WARNING or getattr(record, MARK, False):
            return True
        return not record.name.startswith("prefect")


_QUIET = _Quiet()


def set_verbosity(verbose: bool) -> None:
    """Prefect's lines on the terminal: quiet (the default) or verbose (`marsrl_core.cli` does vLLM's)."""
    from prefect.logging.configuration import ensure_logging_setup
    from prefect.logging.handlers import PrefectConsoleHandler

    ensure_logging_setup()  # Prefect makes its handlers lazily; the filter goes on its console handler
    _QUIET.enabled = not verbose
    for logger in (logging.getLogger(), logging.getLogger("uvicorn"), logging.getLogger("fastapi")):
        for handler in logger.handlers:
            if isinstance(handler, PrefectConsoleHandler) and _QUIET not in handler.filters:
                handler.addFilter(_QUIET)
