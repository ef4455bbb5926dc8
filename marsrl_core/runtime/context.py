"""The process context: what one worker process holds for the runs it works on.

A worker process (a `marsrl` command, a Prefect worker's flow run) keeps one store connection per
store, one engine per policy (wrapped in a `BatchingEngine`, shared by the decode loop and the
evaluations), one decode loop per training run (`RolloutLoop`: every batch in flight decodes in it,
the agentic pipeline), one learner and one MLflow run per training run, and the set of runs it is
stopping. `Runtime` holds them, created on first use and shared by every thread of the
process; `runtime()` is the process's one instance. Its first store also starts the process's
`MemoryTrimmer` (every `malloc_trim_every_s` of that first config).

Rollout and learner meet through the store and the checkpoint files: an engine picks up a newer
committed version from the store at stage boundaries, so rollout and learner can live in different
processes or machines, each with its own `Runtime`. When both are in this process, the learner also
publishes each committed version's weights to the run's `WeightChannel` (`engine.weight_sync=memory`),
and the engine takes them from memory instead of reading the version's folder back from disk.

Deliberate simplification: what it holds is keyed by run and model, never evicted (a worker serves
one run at a time).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import transformers  # noqa: F401  (imported here, once: lazy imports from several threads race)

from marsrl_core.agents.outcomes import OutcomeChecker
from marsrl_core.config import AGENTS, MarsRLConfig
from marsrl_core.engines.batching import BatchingEngine
from marsrl_core.learn.checkpoint_folders import checkpoint_root
from marsrl_core.policy import make_engine, policy_folder
from marsrl_core.rollout.loop import RolloutLoop
from marsrl_core.rollout.weights import WeightChannel
from marsrl_core.runtime.memory import MemoryTrimmer
from marsrl_core.store import SegmentStore, Store
from marsrl_core.store.lease import LearnerLease
from marsrl_core.store.process import StoreProcess
from marsrl_core.store.recent import RecentSamples, RecentStore
from marsrl_core.timings import timed

if TYPE_CHECKING:
    from marsrl_core.learn.learner import Learner
    from marsrl_core.runtime.tracking import Tracker

log = logging.getLogger(__name__)


class Runtime:
    """The stores, engines, learners and trackers of this process, and the runs it is stopping."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._stores: dict[tuple[str, str, str], Store] = {}
        self._recent: dict[tuple[str, str], RecentSamples] = {}  # (catalog, data path): shared by the lanes
        self._engines: dict[tuple[str, str, str], BatchingEngine] = {}
        self._learners: dict[str, Learner] = {}
        # Engines and learners load one at a time (transformers' lazy imports from two threads at once
        # race), outside `_lock`, so the stores and decode loops serve meanwhile.
        self._loading = threading.Lock()
        self.failed_steps: dict[str, int] = {}  # run -> the step that failed last, until one past it commits
        self._trackers: dict[str, Tracker] = {}
        self._leases: dict[str, LearnerLease] = {}
        self._interrupted: set[str] = set()
        self._trimmer: MemoryTrimmer | None = None
        self._channels: dict[tuple[str, str, str], WeightChannel] = {}  # (catalog, data path, run)
        self._loops: dict[tuple[str, str, str], RolloutLoop] = {}
        self._checkers: dict[str, OutcomeChecker] = {}

    # ------------------------------------------------------------------ services
    def store(self, cfg: MarsRLConfig, lane: str = "main") -> Store:
        """The store `cfg` names: in a child process of its own unless `store.separate_process` is off.
        With a child process, each `lane` has its own ("learner": the learner's; "main": everything
        else, the decode loop among it), so that the learner's calls do not wait for the decode loop's
        turn (a store process serves one call at a time). The lanes share the samples this process
        stored and no step has consumed yet (`store/recent.py`, `store.recent_samples_mb`)."""
        lane = lane if cfg.store.separate_process else "main"
        key = (cfg.store.catalog_url, cfg.store.data_path, lane)
        with self._lock:
            if self._trimmer is None and cfg.malloc_trim_every_s is not None:
                self._trimmer = MemoryTrimmer(cfg.malloc_trim_every_s)
            if key not in self._stores:
                kind = StoreProcess if cfg.store.separate_process else SegmentStore
                store = kind.from_config(cfg.store)
                if cfg.store.recent_samples_mb > 0:
                    recent = self._recent.setdefault(key[:2], RecentSamples(int(cfg.store.recent_samples_mb * 2**20)))
                    store = RecentStore(store, recent)
                self._stores[key] = store
            return self._stores[key]

    def recent_samples(self, cfg: MarsRLConfig) -> RecentSamples | None:
        """The samples this process stored in `cfg`'s store and no step has consumed yet (None: none kept)."""
        with self._lock:
            return self._recent.get((cfg.store.catalog_url, cfg.store.data_path))

    def engine(self, cfg: MarsRLConfig, agent: str = "policy") -> BatchingEngine:
        """The engine for `agent` ("policy" when one model serves all agents), loaded on first use."""
        folder = policy_folder(cfg)
        key = (str(folder), cfg.engine.name, agent)
        return self._load_once(self._engines, key, lambda: BatchingEngine(make_engine(cfg, folder)))

    def _load_once(self, loaded: dict, key: Any, build: Any, install: Any = None) -> Any:
        """`loaded[key]`, made by `build()` on first use. Loads run one at a time under the loading lock
        (transformers' lazy imports race across threads); the runtime's lock is held only to look up and
        to insert, with `install(value)` (when given) run under that same hold."""
        with self._lock:
            if key in loaded:
                return loaded[key]
        with self._loading:
            with self._lock:
                if key in loaded:  # another thread loaded it while this one waited
                    return loaded[key]
            value = build()
            with self._lock:
                if install is not None:
                    install(value)
                return loaded.setdefault(key, value)

    def use_engine(self, cfg: MarsRLConfig, engine: Any, agent: str = "policy") -> BatchingEngine:
        """Make `engine` (any object with the engine interface: `decode_segment`, `update_weights`,
        `tokenizer`, `policy_version`) the one this process uses for `cfg`'s policy and `agent`."""
        key = (str(policy_folder(cfg)), cfg.engine.name, agent)
        with self._lock:
            self._engines[key] = engine if isinstance(engine, BatchingEngine) else BatchingEngine(engine)
            return self._engines[key]

    def has_engine(self, cfg: MarsRLConfig) -> bool:
        """Whether this process holds an engine for `cfg`'s policy."""
        folder, name = str(policy_folder(cfg)), cfg.engine.name
        with self._lock:
            return any(key[:2] == (folder, name) for key in self._engines)

    def rollout_loop(self, cfg: MarsRLConfig, run_id: str, make_scheduler: Any) -> RolloutLoop:
        """The run's decode loop in this process (`rollout/loop.py`), made with `make_scheduler` when it
        has none or its last one ended (an interrupt, repeated failures). One that ended on
        `PolicyDiverged` is kept, so later batches of the run get that error instead of decoding on,
        until `clear_interrupt(run_id)`. Kept per store and run: a run id may recur in another store."""
        key = (cfg.store.catalog_url, cfg.store.data_path, run_id)
        with self._lock:
            loop = self._loops.get(key)
            if loop is None or (loop.ended and not loop.diverged):
                interrupted = lambda: self.interrupted(run_id)  # noqa: E731
                loop = self._loops[key] = RolloutLoop(make_scheduler, interrupted=interrupted)
            return loop

    def wake_rollouts(self, cfg: MarsRLConfig, run_id: str) -> None:
        """The run's learner in this process committed a version: its decode loop here, if any, looks
        at the gate and the weights now (`RolloutLoop.wake`)."""
        with self._lock:
            loop = self._loops.get((cfg.store.catalog_url, cfg.store.data_path, run_id))
        if loop is not None:
            loop.wake()

    def checker(self, cfg: MarsRLConfig, run_id: str) -> OutcomeChecker:
        """The run's outcome checker in this process (`agents/outcomes.py`: `outcome.workers` processes,
        each check cut at `outcome.timeout_s`), shared by its rollouts and evaluations until
        `end_checker`. A run whose problems include code builds the sandbox first (refused here where
        bubblewrap cannot run)."""
        with self._lock:
            if run_id not in self._checkers:
                code = "code" in (cfg.data.verifier, cfg.evaluation.verifier)
                self._checkers[run_id] = OutcomeChecker.from_config(cfg, code=code)
            return self._checkers[run_id]

    def end_checker(self, run_id: str) -> None:
        """Stop the run's checker workers (the run's end)."""
        with self._lock:
            checker = self._checkers.pop(run_id, None)
        if checker is not None:
            checker.close()

    # ------------------------------------------------------------------ weights
    def weight_channel(self, cfg: MarsRLConfig, run_id: str) -> WeightChannel:
        """The run's `WeightChannel` in this process: its learner publishes there, its engines take
        each committed version from there (from memory when published here, else its folder)."""
        key = (cfg.store.catalog_url, cfg.store.data_path, run_id)
        with self._lock:
            if key not in self._channels:
                per_agent = cfg.learner.policies == "per_agent"
                self._channels[key] = WeightChannel(self.store(cfg), run_id, per_agent=per_agent)
            return self._channels[key]

    def engines(self, cfg: MarsRLConfig) -> BatchingEngine | dict[str, BatchingEngine]:
        """One engine for all agents, or one per agent (`learner.policies=per_agent`)."""
        if cfg.learner.policies == "per_agent":
            return {agent: self.engine(cfg, agent) for agent in AGENTS}
        return self.engine(cfg)

    def tracker(self, cfg: MarsRLConfig, run_id: str) -> Tracker:
        """The MLflow run of a training run."""
        from marsrl_core.runtime.tracking import Tracker

        with self._lock:
            if run_id not in self._trackers:
                self._trackers[run_id] = Tracker(cfg.tracking, run_id, cfg.model_dump(mode="json"))
            return self._trackers[run_id]

    def end_tracker(self, run_id: str, status: str) -> None:
        """End the run's MLflow run in this process (FINISHED, FAILED or KILLED), if it has one."""
        with self._lock:
            tracker = self._trackers.pop(run_id, None)
        if tracker is not None:
            tracker.close(status)

    def lease(self, cfg: MarsRLConfig, run_id: str) -> None:
        """Take the run's learner lease (`store.lease`) for this process, once; StoreError naming the
        holder when another live process has it."""
        with self._lock:
            if run_id not in self._leases:
                self._leases[run_id] = LearnerLease(cfg.store.catalog_url, run_id)

    def learner(self, cfg: MarsRLConfig, run_id: str) -> Learner:
        """The run's learner (under the run's learner lease), resumed from its last committed version
        when first built. The build (seconds: model, optimizer, a resume's checkpoint) holds the
        model-loading lock, not the runtime's, so the process's stores and decode loops serve meanwhile."""

        def build() -> Learner:
            with timed("learner.build"):
                return self._build_learner(cfg, run_id)

        def rolled_back(learner: Learner) -> None:  # a resume voids the versions after the last durable one
            channel = self._channels.get((cfg.store.catalog_url, cfg.store.data_path, run_id))
            if channel is not None:
                channel.rolled_back(learner.step)

        return self._load_once(self._learners, run_id, build, rolled_back)

    def _build_learner(self, cfg: MarsRLConfig, run_id: str) -> Learner:
        from transformers import AutoTokenizer

        from marsrl_core.learn.distributed import current_ranks
        from marsrl_core.learn.learner import Learner

        self.lease(cfg, run_id)
        folder = policy_folder(cfg)
        learner = Learner(
            cfg,
            self.store(cfg, lane="learner"),
            run_id,
            folder,
            checkpoint_root(cfg.output_dir, run_id),
            AutoTokenizer.from_pretrained(folder),
            self.tracker(cfg, run_id),
            ranks=current_ranks(),  # rank 0 of several: the others follow its steps
        )
        learner.resume()
        if learner.tracker.resumed:  # the interruption, on the run's MLflow run
            learner.tracker.log_metrics({"resumed": 1.0}, step=learner.step)
        return learner

    def drop_learner(self, run_id: str) -> None:
        """Forget the run's learner: the next `learner()` rebuilds it from the last committed version
        (after a failed step, whose update may be in memory but was never committed)."""
        with self._lock:
            learner = self._learners.pop(run_id, None)
        if learner is not None:
            try:  # its background durable write ends before a new learner resumes from the folders
                learner.wait_for_durable()
            except Exception as exc:  # that version stays weights-only: the resume voids it
                log.warning("run %s: %s", run_id, exc)

    def has_tracker(self, run_id: str) -> bool:
        return run_id in self._trackers

    # ------------------------------------------------------------------ stopping
    def interrupt(self, run_id: str) -> None:
        """Stop `run_id`'s work in this process soon: rollout turns at their next stage boundary (they
        raise `RolloutInterrupted`; what they decoded is stored), the learner loop before its next step.
        Stays in force (later turns stop at once) until `clear_interrupt(run_id)`."""
        with self._lock:
            self._interrupted.add(run_id)

    def interrupted(self, run_id: str) -> bool:
        return run_id in self._interrupted

    def clear_interrupt(self, run_id: str) -> None:
        """Forget an earlier `interrupt(run_id)` (and a decode loop that ended on `PolicyDiverged`): called
        when the run's work starts in this process."""
        with self._lock:
            self._interrupted.discard(run_id)
            for key in [k for k, loop in self._loops.items() if k[2] == run_id and loop.diverged]:
                del self._loops[key]

    def close(self) -> None:
        """Close the stores (and their child processes), forget the learners that use them and end their
        leases; the next call opens afresh."""
        with self._lock:
            for loop in self._loops.values():
                loop.close()
            self._loops.clear()
            for checker in self._checkers.values():
                checker.close()
            self._checkers.clear()
            self._channels.clear()
            stores = list(self._stores.values())
            self._stores.clear()
            self._recent.clear()
            self._learners.clear()
            for lease in self._leases.values():
                lease.release()
            self._leases.clear()
            for store in stores:
                store.close()


_runtime = Runtime()


def runtime() -> Runtime:
    """This process's `Runtime`."""
    return _runtime
