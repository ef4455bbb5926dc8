"""Evaluation progress, by phase (an agent's turn) and segment: a rich bar on a terminal, log lines elsewhere.

`agents.evaluation.evaluate` announces each phase (`phase`: the Solver's samples, the Verifier's
reports, the Corrector's revisions, each V-C round's Verifier and Corrector calls) and each decoded
segment of it (`segment`: segments so far, tokens decoded, outputs still decoding). Progress only
watches: the same seeds give the same report with or without it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol


class Progress(Protocol):
    def phase(self, label: str, outputs: int) -> None:
        """A phase starts: `outputs` completions to decode (an agent's batched call)."""

    def segment(self, segments: int, tokens: int, active: int) -> None:
        """One more segment of the current phase: totals so far, and the outputs still decoding."""

    def close(self) -> None:
        """The evaluation's phases are over."""


class LogProgress:
    """One line when a phase starts and when it ends, and one every `every_s` seconds in between (Prefect's
    log, the UI's run page)."""

    def __init__(self, log: Callable[[str], None], every_s: float = 15.0):
        self.log, self.every_s = log, every_s
        self.label, self.outputs, self.last = "", 0, (0, 0, 0)
        self.logged_at = 0.0

    def _line(self, done: bool = False) -> str:
        segments, tokens, active = self.last
        state = "done" if done else f"{self.outputs - active}/{self.outputs} finished"
        return f"evaluation {self.label}: {state}, {segments} segments, {tokens} tokens decoded"

    def phase(self, label: str, outputs: int) -> None:
        self.close()
        self.label, self.outputs, self.last = label, outputs, (0, 0, outputs)
        self.logged_at = time.monotonic()
        self.log(f"evaluation {label}: {outputs} outputs to decode")

    def segment(self, segments: int, tokens: int, active: int) -> None:
        self.last = (segments, tokens, active)
        if active and time.monotonic() - self.logged_at >= self.every_s:
            self.logged_at = time.monotonic()
            self.log(self._line())

    def close(self) -> None:
        """The current phase's last line (also called by the next phase; again, a no-op)."""
        if self.label:
            self.log(self._line(done=True))
            self.label = ""


class BarProgress:
    """A rich progress bar per phase on a terminal: outputs finished of the phase's total, with its
    segments and tokens decoded. Use as a context manager."""

    def __init__(self, console):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bars = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[detail]}"),
            TimeElapsedColumn(),
            console=console,
        )
        self.task = None

    def __enter__(self) -> BarProgress:
        self.bars.start()
        return self

    def __exit__(self, *exc) -> None:
        self.bars.stop()

    def phase(self, label: str, outputs: int) -> None:
        self.task = self.bars.add_task(label, total=outputs, detail="")

    def segment(self, segments: int, tokens: int, active: int) -> None:
        total = self.bars.tasks[-1].total or 0
        self.bars.update(self.task, completed=total - active, detail=f"{segments} segments, {tokens} tokens")

    def close(self) -> None:
        """Nothing to add: each phase's bar already shows its end; `__exit__` stops the display."""
