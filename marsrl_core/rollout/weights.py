"""The weight channel: how a committed policy version reaches the rollout's engines, whether the learner
runs in this process or elsewhere.

- `publish(version, weights)`: the learner in this process hands over the weights of a version it has
  committed (a state dict, or {agent: state dict}), so the engines load it from memory
  (`engine.weight_sync=memory`); a copy lives until the engines hold that version or a newer one.
- `committed(version, folder)`: the learner in this process has committed `version`; from then on
  `poll` takes the run's newest version from here instead of asking the store at every stage (a run
  has one learner: its lease).
- `poll(engine_version)`: asked at every stage boundary. The newest version committed in the store
  (or told by `committed`), when newer than the engines', is offered: its published weights if this
  process has them, else its checkpoint folder (one folder for a shared policy, {agent: folder} for
  per-agent ones). A learner in another process or machine is seen this way.
- `rolled_back(version)`: the run's learner resumed at `version` and voided the later ones: the
  channel forgets them.
- `offer(version, weights)`: a version for the engines directly (tests, the simulator); the newest
  offer is kept.
- `apply(...)`: at a stage boundary, the pending version is loaded into the engines unless an
  in-flight sample started more than `max_version_span` versions before it (it would then span too
  many versions); it then waits while those samples drain.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from marsrl_core.learn.checkpoint_folders import agent_folders


class WeightChannel:
    """A run's policy versions on their way to the engines (see the module docstring)."""

    def __init__(self, store: Any = None, run_id: str | None = None, per_agent: bool = False):
        """`store`, `run_id`: where committed versions are found (None: only what is offered)."""
        self.store, self.run_id, self.per_agent = store, run_id, per_agent
        self.pending: tuple[int, Any] | None = None  # (version, weights or {agent: weights})
        self._published: tuple[int, Any] | None = None
        self._committed: tuple[int, str] | None = None  # from a learner in this process
        self._lock = threading.Lock()

    def publish(self, version: int, weights: Any) -> None:
        """The weights of committed version `version`, from this process's learner."""
        with self._lock:
            self._published = (version, weights)

    def committed(self, version: int, folder: str) -> None:
        """The learner in this process committed `version` (its folder): the run's newest version."""
        with self._lock:
            self._committed = (version, str(folder))

    def rolled_back(self, version: int) -> None:
        """The run's learner resumed at `version`, voiding the versions after it (`learner.save_every`):
        what this channel holds of those is forgotten, so `poll` asks the store again."""
        with self._lock:
            if self._committed is not None and self._committed[0] > version:
                self._committed = None
            if self._published is not None and self._published[0] > version:
                self._published = None
            if self.pending is not None and self.pending[0] > version:
                self.pending = None

    def offer(self, version: int, weights: Any) -> None:
        """Keep `version` if it is newer than what is pending. Safe to call from any thread."""
        with self._lock:
            if self.pending is None or version > self.pending[0]:
                self.pending = (version, weights)

    def poll(self, engine_version: int) -> tuple[int, str] | None:
        """Offer the store's newest committed version if it is newer than `engine_version`; returns what
        the store answered ((version, folder), or None before the first step, or without a store)."""
        if self.store is None:
            return None
        latest = self._committed or self.store.latest_version(self.run_id)
        with self._lock:
            published = self._published
            if published is not None and engine_version >= published[0]:
                self._published = published = None  # the engines hold it: drop the copy
        if latest is None or latest[0] <= engine_version:
            return latest
        version, uri = latest
        if published is not None and published[0] == version:
            self.offer(version, published[1])
            return latest
        folders = agent_folders(Path(uri))
        self.offer(version, folders if self.per_agent else folders["solver"])
        return latest

    def apply(self, engines: dict[str, Any], engine_version: int, oldest_in_flight: int | None, span: int) -> bool:
        """Load the pending version into `engines` ({agent: engine}; agents may share one) unless it is
        more than `span` versions newer than `oldest_in_flight` (the start version of the oldest sample
        in flight; None when none is); False when it must wait."""
        with self._lock:
            offered = self.pending
        if offered is None:
            return True
        version, weights = offered
        if version <= engine_version:  # an engine shared with another scheduler already has it
            self._clear(offered)
            return True
        oldest = version if oldest_in_flight is None else oldest_in_flight
        # After a restart the engine may hold weights older than the restored samples themselves; then
        # any newer policy is closer to them than what it has, so it is applied at once.
        if version - oldest > span and engine_version >= oldest:
            return False
        done: set[int] = set()
        for agent, engine in engines.items():
            if id(engine) not in done:
                own = weights[agent] if isinstance(weights, dict) and agent in weights else weights
                engine.update_weights(version, own)
                done.add(id(engine))
        self._clear(offered)
        return True

    def _clear(self, applied: tuple[int, Any]) -> None:
        """Forget the applied offer, unless a newer one arrived meanwhile."""
        with self._lock:
            if self.pending is applied:
                self.pending = None
