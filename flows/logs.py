"""What the `marsrl` command shows on the terminal, and what goes to Prefect (the UI) either way.

Quiet by default: Prefect's INFO lines of its own (a task run created, a run finished in a state) and
vLLM's start-up INFO lines stay off the terminal; MarsRL's own lines (`say`: a learner step, evaluation
progress, a run's end) and every warning and error show. `-v` shows everything. Only the terminal is
quieted: Prefect's API handler still receives every line, so the UI's logs are complete.
"""

from __future__ import annotations

import logging

from tasks.logs import MARK


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
