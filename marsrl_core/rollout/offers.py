"""Newer policies offered to a rollout's engines, applied at a stage boundary within the staleness bound.

A learner (in this process, or elsewhere through the store's committed versions) offers each new
version; only the newest offer is kept. At a stage boundary the scheduler asks to apply it: it is
applied unless an in-flight sample started more than `max_version_span` versions before it (the
sample would then span too many versions), in which case it waits while those samples drain.
"""

from __future__ import annotations

import threading
from typing import Any


class PolicyOffers:
    """The newest policy offered to `engines` ({agent: engine}; agents may share one) and not yet applied."""

    def __init__(self, engines: dict[str, Any]):
        self.engines = engines
        self.pending: tuple[int, Any] | None = None  # (version, weights or {agent: weights})
        self._lock = threading.Lock()

    def offer(self, version: int, weights: Any) -> None:
        """Keep `version` if it is newer than what is pending. Safe to call from any thread."""
        with self._lock:
            if self.pending is None or version > self.pending[0]:
                self.pending = (version, weights)

    def apply(self, current_version: int, oldest_in_flight: int | None, max_version_span: int) -> bool:
        """Load the pending policy into the engines unless it is more than `max_version_span` versions newer
        than `oldest_in_flight` (the start version of the oldest sample in flight; None when none is);
        False when it must wait."""
        with self._lock:
            offered = self.pending
        if offered is None:
            return True
        version, weights = offered
        if version <= current_version:  # an engine shared with another scheduler already has it
            self._clear(offered)
            return True
        oldest = version if oldest_in_flight is None else oldest_in_flight
        # After a restart the engine may hold weights older than the restored samples themselves; then
        # any newer policy is closer to them than what it has, so it is applied at once.
        if version - oldest > max_version_span and current_version >= oldest:
            return False
        done: set[int] = set()
        for agent, engine in self.engines.items():
            if id(engine) not in done:
                engine.update_weights(
                    version, weights[agent] if isinstance(weights, dict) and agent in weights else weights
                )
                done.add(id(engine))
        self._clear(offered)
        return True

    def _clear(self, applied: tuple[int, Any]) -> None:
        """Forget the applied offer, unless a newer one arrived meanwhile."""
        with self._lock:
            if self.pending is applied:
                self.pending = None
