"""The segment store: an append-only DuckLake lakehouse shared by rollout, learner and users.

Why DuckLake: a plain DuckDB file is locked by one process, while rollout flows, learner flows and a
user's SQL session run in different processes. DuckLake keeps the catalog in SQLite (or Postgres) and
the data in Parquet, so all of them can read and write at once. The extensions are loaded from the
installed PyPI packages (`duckdb-extension-*`), never downloaded.

How it is used:
- `append(...)` writes samples, segments and rewards of one rollout stage in one transaction, in bulk
  through Arrow (binding Python lists row by row is ~1000x slower);
- `trainable_groups(...)` lists complete, unconsumed same-input groups for an agent (or, in one
  query, for several: `trainable_groups_by_agent`);
- `commit_step(...)` records a learner step's consumptions, its policy version and its metrics in one
  transaction (exactly-once: a sample consumed by a committed step is never listed again; a step that
  never committed leaves its samples trainable). Samples the learner dropped as too stale are
  consumptions too, with `learner_step = DROPPED_STALE` (-1), so they are accounted for and never
  listed again;
- `load_samples(...)` rebuilds sample token sequences and behaviour log-probs from their segments.

Concurrency: the SQLite catalog runs in WAL mode; a commit that meets a lock or a DuckLake conflict is
rolled back and retried with jittered exponential backoff (counted in `lock_retries`). Appends never
conflict logically, so a retry always converges.

Deliberate simplifications: one DuckDB connection per Store guarded by a lock (tasks in threads
share it); unknown-sample checks use a bounded in-process cache and fall back to one query.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import importlib
import json
import os
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from marsrl_core.store_schema import ARROW_SCHEMAS, table_ddl, view_ddl

CATALOG = "lake"
KNOWN_SAMPLES_CACHE = 100_000  # sample ids remembered per store for the unknown-id checks
_TRANSIENT = ("database is locked", "conflict", "failed to commit", "busy", "could not serialize")


class StoreError(RuntimeError):
    """A store operation failed; the message names the input or path at fault."""


@dataclass
class SampleRow:
    """A sample was started: one agent's output for one prompt, member of one same-input group."""

    sample_id: str
    problem_id: str
    agent: str
    turn: int
    group_id: str
    group_size: int
    prompt_tokens: Sequence[int]
    parent_sample_id: str | None = None


@dataclass
class SegmentRow:
    """One decoded segment of a sample: its tokens, their behaviour log-probs, and the policy version."""

    sample_id: str
    segment_index: int
    token_ids: Sequence[int]
    logprobs: Sequence[float]
    policy_version: int
    finish_reason: str  # "stop" (EOS / stop string), "length" (segment full, continues), "budget" (truncated)


@dataclass
class RewardRow:
    """A sample finished: its reward and what was parsed from it."""

    sample_id: str
    reward: float
    correct: bool | None = None
    outcome: str = "ok"
    parsed: str | None = None
    text: str | None = None


@dataclass
class StoredSample:
    """A sample rebuilt from the store: prompt, response tokens, behaviour log-probs and versions."""

    sample_id: str
    agent: str
    group_id: str
    prompt_tokens: np.ndarray
    token_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray  # policy version of each response token
    finish_reason: str | None
    reward: float | None = None
    parsed: str | None = None
    num_segments: int = 0


COMPACTED_FILE_BYTES = 16 * 2**20  # compaction merges files smaller than this (DuckLake's default: 512 MB)
DROPPED_STALE = -1  # consumptions.learner_step of a sample the learner dropped untrained as too stale


@dataclass
class TrainableGroup:
    group_id: str
    agent: str
    sample_ids: list[str] = field(default_factory=list)
    oldest_version: int = 0  # the policy version of the group's oldest segment
    stale: bool = False  # older than the learner's staleness bound: to be dropped, not trained on


def _extension_files() -> dict[str, str]:
    """Extension name -> file path, for every installed `duckdb-extension-*` package."""
    found = {}
    for module_name in ("duckdb_extension_sqlite_scanner", "duckdb_extension_ducklake",
                        "duckdb_extension_postgres_scanner", "duckdb_extension_httpfs"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        pattern = os.path.join(os.path.dirname(module.__file__), "extensions", "*", "*.duckdb_extension")
        for path in glob.glob(pattern):
            found[Path(path).name.split(".")[0]] = path
    return found


def _key_table(column: str, values: Iterable[str]) -> pa.Table:
    """A one-column table of string keys, registered beside a query to join against (an IN list of
    thousands of bound parameters is slow)."""
    return pa.table({column: pa.array(list(values), pa.string())})


def _is_transient(err: Exception) -> bool:
    text = str(err).lower()
    return any(marker in text for marker in _TRANSIENT)


def _list_array(arrays: Sequence[np.ndarray], value_type: pa.DataType) -> pa.ListArray:
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(arrays) if arrays else np.zeros(0)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values.astype(value_type.to_pandas_dtype())))


def _as_array(values: Any, kind: str, name: str) -> np.ndarray:
    """`values` as a 1-D numpy array of the wanted kind ('i' integers, 'f' floats), else StoreError."""
    array = np.asarray(values)
    if array.ndim != 1 and array.size != 0:
        raise StoreError(f"{name}: expected a flat sequence, got shape {array.shape}")
    if array.size == 0:
        return array.reshape(0)
    if kind == "i" and array.dtype.kind not in "iu":
        raise StoreError(f"{name}: expected integer token ids, got dtype {array.dtype}")
    if kind == "f" and array.dtype.kind not in "f":
        raise StoreError(f"{name}: expected float log-probs, got dtype {array.dtype}")
    if kind == "f" and not np.all(np.isfinite(array)):
        raise StoreError(f"{name}: log-probs must be finite")
    return array


class SegmentStore:
    """The DuckLake segment store. Open one per process; it is safe to share between threads."""

    def __init__(self, catalog_url: str, data_path: str, *, max_retries: int = 200, create: bool = True):
        self.catalog_url = catalog_url
        self.data_path = data_path
        self.max_retries = max_retries
        self.lock_retries = 0
        self._lock = threading.RLock()
        self._known_samples: set[tuple[str, str]] = set()  # (run_id, sample_id) seen in the store
        self._con = self._connect(create)

    @classmethod
    def from_config(cls, store_config: Any, **kwargs: Any) -> "SegmentStore":
        return cls(store_config.catalog_url, store_config.data_path, **kwargs)

    # ------------------------------------------------------------------ connection
    def _connect(self, create: bool) -> duckdb.DuckDBPyConnection:
        kind, _, target = self.catalog_url.partition(":")
        if kind not in ("sqlite", "postgres") or not target:
            raise StoreError(f"catalog_url={self.catalog_url!r}: expected 'sqlite:<file>' or 'postgres:<dsn>'")
        with self._sqlite_catalog(Path(target), create) if kind == "sqlite" else contextlib.nullcontext():
            return self._attach(kind)

    def _attach(self, kind: str) -> duckdb.DuckDBPyConnection:
        if "://" not in self.data_path:
            try:
                Path(self.data_path).mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise StoreError(f"data_path={self.data_path!r}: cannot create folder ({err.strerror})") from None
        extensions = _extension_files()
        needed = ["sqlite_scanner" if kind == "sqlite" else "postgres_scanner", "ducklake"]
        if self.data_path.startswith(("s3://", "gs://", "http")):
            needed.insert(0, "httpfs")
        con = duckdb.connect()
        if "://" not in self.data_path:
            # DuckDB's external file cache keeps the bytes of every Parquet file a query has read, until
            # memory_limit (80% of RAM). Every append adds files and the rollout and learner re-read the
            # whole run, so in a long-lived process the cache grows with the run's data, without bound.
            # Local files are in the OS page cache anyway; remote data paths keep the cache.
            con.execute("SET enable_external_file_cache = false")
        for name in needed:
            if name not in extensions:
                raise StoreError(f"catalog_url={self.catalog_url!r}: the duckdb extension {name!r} is not installed "
                                 f"(pip install duckdb-extension-{name.replace('_', '-')}=={duckdb.__version__})")
            con.execute(f"LOAD '{extensions[name]}'")
        if self.data_path.startswith("s3://"):  # S3-compatible storage: credentials from the usual variables
            endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
            host = endpoint.split("://", 1)[-1]
            options = [f"KEY_ID '{os.environ.get('AWS_ACCESS_KEY_ID', '')}'",
                       f"SECRET '{os.environ.get('AWS_SECRET_ACCESS_KEY', '')}'",
                       f"REGION '{os.environ.get('AWS_REGION', 'us-east-1')}'"]
            if host:
                options += [f"ENDPOINT '{host}'", "URL_STYLE 'path'", f"USE_SSL {str(endpoint.startswith('https')).lower()}"]
            con.execute(f"CREATE OR REPLACE SECRET marsrl_s3 (TYPE s3, {', '.join(options)})")
        data_path = self.data_path if "://" in self.data_path else str(Path(self.data_path).resolve()) + "/"
        try:
            con.execute(f"ATTACH 'ducklake:{self.catalog_url}' AS {CATALOG} (DATA_PATH '{data_path}')")
        except duckdb.Error as err:
            raise StoreError(f"catalog_url={self.catalog_url!r}: cannot attach DuckLake catalog ({err})") from None
        self._con = con
        self._transaction(lambda c: [c.execute(sql) for sql in table_ddl(CATALOG) + view_ddl(CATALOG)])
        return con

    @staticmethod
    @contextlib.contextmanager
    def _sqlite_catalog(path: Path, create: bool) -> Iterator[None]:
        """Prepare a SQLite catalog (WAL, so readers run beside one writer) and hold an exclusive lock on
        `<catalog>.lock` while the caller attaches it: processes attach one at a time. Two processes
        creating a new catalog at once collide: in a measured 10 tries of two processes opening a new
        store together, one failed 8 times (DuckLake's initialisation: "database is locked"), and a
        reader polling a catalog still being created once saw "database disk image is malformed". A
        split run's rollout and learner processes start together on a new store."""
        if not path.exists() and not create:
            raise StoreError(f"catalog {str(path)!r}: no such store")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            lock = open(path.with_name(path.name + ".lock"), "a")
        except OSError as err:
            raise StoreError(f"catalog {str(path)!r}: not writable ({err})") from None
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                try:
                    with sqlite3.connect(path, timeout=30) as db:
                        db.execute("PRAGMA journal_mode=WAL")
                except sqlite3.Error as err:
                    raise StoreError(f"catalog {str(path)!r}: not writable ({err})") from None
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def close(self) -> None:
        with self._lock:
            self._con.close()

    # ------------------------------------------------------------------ retrying primitives
    def _retry(self, operation: Callable[[], Any], transient: Sequence[str] = ()) -> Any:
        """Run `operation`, retrying it with jittered backoff on a transient error (`_TRANSIENT`, plus
        the `transient` markers given)."""
        for attempt in range(self.max_retries + 1):
            try:
                return operation()
            except duckdb.Error as err:
                retriable = _is_transient(err) or any(marker in str(err).lower() for marker in transient)
                if not retriable or attempt == self.max_retries:
                    raise
                self.lock_retries += 1
                time.sleep(random.uniform(0.5, 1.0) * min(1.0, 0.005 * 2**attempt))
        raise AssertionError("unreachable")

    def _transaction(self, body: Callable[[duckdb.DuckDBPyConnection], Any]) -> Any:
        """Run `body` in one transaction, all or nothing, retried on transient lock errors."""

        def attempt() -> Any:
            with self._lock:
                self._con.execute("BEGIN TRANSACTION")
                try:
                    result = body(self._con)
                    self._con.execute("COMMIT")
                    return result
                except BaseException:
                    self._rollback_quietly()
                    raise

        return self._retry(attempt)

    def _rollback_quietly(self) -> None:
        """End a failed transaction so the connection can run the retry (there may be none to end)."""
        try:
            self._con.execute("ROLLBACK")
        except duckdb.Error:
            pass

    def _read(self, sql: str, params: Sequence[Any] = (), tables: dict[str, pa.Table] | None = None) -> pa.Table:
        def attempt() -> pa.Table:
            with self._lock:
                for name, table in (tables or {}).items():
                    self._con.register(name, table)
                try:
                    return self._con.execute(sql, list(params)).to_arrow_table()
                finally:
                    for name in tables or {}:
                        self._con.unregister(name)

        return self._retry(attempt)

    @staticmethod
    def _insert(con: duckdb.DuckDBPyConnection, table: str, batch: pa.Table) -> None:
        name = f"_batch_{table}"
        con.register(name, batch)
        try:
            con.execute(f"INSERT INTO {CATALOG}.{table} SELECT *, current_timestamp FROM {name}")
        finally:
            con.unregister(name)

    # ------------------------------------------------------------------ writes
    def create_run(self, run_id: str, config: dict[str, Any]) -> None:
        batch = pa.table({"run_id": [run_id], "config_json": [json.dumps(config, default=str)]},
                         schema=ARROW_SCHEMAS["runs"])
        self._transaction(lambda c: self._insert(c, "runs", batch))

    def add_problems(self, run_id: str, problems: Iterable[Any]) -> int:
        """Record problems (objects with problem_id, prompt, answer, source)."""
        rows = list(problems)
        if not rows:
            return 0
        batch = pa.table(
            {
                "run_id": [run_id] * len(rows),
                "problem_id": [p.problem_id for p in rows],
                "prompt": [p.prompt for p in rows],
                "answer": [p.answer for p in rows],
                "source": [p.source for p in rows],
            },
            schema=ARROW_SCHEMAS["problems"],
        )
        self._transaction(lambda c: self._insert(c, "problems", batch))
        return len(rows)

    def record_evaluation(self, run_id: str, label: str, dataset: str, metrics: dict[str, Any]) -> None:
        """Append one evaluation's metrics (e.g. label 'before' / 'after')."""
        batch = pa.table({"run_id": [run_id], "label": [label], "dataset": [dataset],
                          "metrics_json": [json.dumps(metrics)]}, schema=ARROW_SCHEMAS["evaluations"])
        self._transaction(lambda c: self._insert(c, "evaluations", batch))

    def evaluation(self, run_id: str, label: str) -> dict[str, Any] | None:
        """The metrics of the run's last evaluation with `label`, or None if it has none."""
        rows = self._read(f"SELECT metrics_json FROM {CATALOG}.evaluations WHERE run_id = ? AND label = ?",
                          [run_id, label]).column("metrics_json").to_pylist()
        return json.loads(rows[-1]) if rows else None

    def run_config(self, run_id: str) -> dict[str, Any] | None:
        """The config a run was started with (as recorded by `create_run`), or None for an unknown run."""
        rows = self._read(f"SELECT config_json FROM {CATALOG}.runs WHERE run_id = ?", [run_id]).column(
            "config_json").to_pylist()
        return json.loads(rows[0]) if rows else None

    def mark(self, run_id: str, event: str, detail: str = "") -> None:
        """Record a run event (e.g. 'rollouts_finished'), visible to every process."""
        batch = pa.table({"run_id": [run_id], "event": [event], "detail": [detail]}, schema=ARROW_SCHEMAS["run_events"])
        self._transaction(lambda c: self._insert(c, "run_events", batch))

    def has_event(self, run_id: str, event: str) -> bool:
        return self._read(f"SELECT count(*) AS n FROM {CATALOG}.run_events WHERE run_id = ? AND event = ?",
                          [run_id, event]).column("n")[0].as_py() > 0

    def reject(self, run_id: str, source: str, location: str, reason: str, payload: str = "") -> None:
        """Record a rejected input (what and why); the run goes on without it."""
        self.reject_many(run_id, [(source, location, reason, payload)])

    def reject_many(self, run_id: str, rows: Sequence[tuple[str, str, str, str]]) -> None:
        if not rows:
            return
        columns = list(zip(*rows))
        batch = pa.table(
            {"run_id": [run_id] * len(rows), "source": columns[0], "location": columns[1],
             "reason": columns[2], "payload": [p[:2000] for p in columns[3]]},
            schema=ARROW_SCHEMAS["rejected_inputs"],
        )
        self._transaction(lambda c: self._insert(c, "rejected_inputs", batch))

    def append(
        self,
        run_id: str,
        samples: Sequence[SampleRow] = (),
        segments: Sequence[SegmentRow] = (),
        rewards: Sequence[RewardRow] = (),
    ) -> None:
        """Append one stage's new samples, decoded segments and rewards in a single transaction."""
        batches = {}
        if samples:
            batches["samples"] = self._samples_batch(run_id, samples)
        new_ids = {s.sample_id for s in samples}
        referenced = {s.sample_id for s in segments} | {r.sample_id for r in rewards}
        self._check_known(run_id, referenced - new_ids)
        if segments:
            batches["segments"] = self._segments_batch(run_id, segments)
        if rewards:
            batches["rewards"] = self._rewards_batch(run_id, rewards)
        if not batches:
            return

        def body(con: duckdb.DuckDBPyConnection) -> None:
            for table, batch in batches.items():
                self._insert(con, table, batch)

        self._transaction(body)
        self._remember(run_id, new_ids)

    def commit_step(
        self,
        run_id: str,
        step: int,
        consumed: dict[str, Sequence[str]],
        checkpoint_uri: str,
        mlflow_run_id: str | None = None,
        metrics: dict[str, dict[str, float]] | None = None,
        dropped: dict[str, Sequence[str]] | None = None,
    ) -> None:
        """Exactly-once commit of a learner step: consumptions + policy version + metrics together.

        `consumed` maps agent -> sample ids trained in this step; `dropped` (same shape) the samples this
        step dropped untrained as too stale (recorded with `learner_step = DROPPED_STALE`). Call it
        only after the checkpoint at
        `checkpoint_uri` is completely written. Raises StoreError (and writes nothing) if any sample
        was already consumed by a committed step or the version already exists.
        """
        pairs = [(sid, agent, step) for agent, ids in consumed.items() for sid in ids]
        pairs += [(sid, agent, DROPPED_STALE) for agent, ids in (dropped or {}).items() for sid in ids]
        ids = [sid for sid, _, _ in pairs]
        if len(set(ids)) != len(ids):
            raise StoreError(f"commit_step(step={step}): a sample id appears twice in consumed")
        self._check_known(run_id, set(ids))
        consumptions = pa.table(
            {"run_id": [run_id] * len(pairs), "sample_id": ids, "agent": [a for _, a, _ in pairs],
             "learner_step": [k for _, _, k in pairs]},
            schema=ARROW_SCHEMAS["consumptions"],
        )
        version = pa.table({"run_id": [run_id], "version": [step], "checkpoint_uri": [checkpoint_uri],
                            "mlflow_run_id": [mlflow_run_id]}, schema=ARROW_SCHEMAS["policy_versions"])
        metric_rows = metrics or {}
        steps = pa.table(
            {"run_id": [run_id] * len(metric_rows), "step": [step] * len(metric_rows),
             "agent": list(metric_rows), "metrics_json": [json.dumps(m) for m in metric_rows.values()]},
            schema=ARROW_SCHEMAS["train_steps"],
        )
        ids_table = _key_table("sample_id", ids)

        def body(con: duckdb.DuckDBPyConnection) -> None:
            con.register("_step_ids", ids_table)
            try:
                twice = con.execute(
                    f"SELECT count(*) FROM {CATALOG}.consumptions c JOIN _step_ids USING (sample_id) "
                    "WHERE c.run_id = ?", [run_id]).fetchone()[0]
            finally:
                con.unregister("_step_ids")
            exists = con.execute(f"SELECT count(*) FROM {CATALOG}.policy_versions WHERE run_id = ? AND version = ?",
                                 [run_id, step]).fetchone()[0]
            if twice or exists:
                raise StoreError(f"commit_step(step={step}): {twice} samples already consumed, "
                                 f"version {step} {'exists' if exists else 'is new'}; nothing written")
            self._insert(con, "consumptions", consumptions)
            self._insert(con, "policy_versions", version)
            if len(metric_rows):
                self._insert(con, "train_steps", steps)

        self._transaction(body)

    # ------------------------------------------------------------------ validation and batches
    def _remember(self, run_id: str, sample_ids: Iterable[str]) -> None:
        """Cache sample ids known to exist; the cache is dropped when full (a miss costs one query), so a
        days-long run does not hold every id it ever wrote."""
        if len(self._known_samples) > KNOWN_SAMPLES_CACHE:
            self._known_samples.clear()
        self._known_samples |= {(run_id, sid) for sid in sample_ids}

    def _check_known(self, run_id: str, sample_ids: set[str]) -> None:
        unknown = {sid for sid in sample_ids if (run_id, sid) not in self._known_samples}
        if not unknown:
            return
        found = self._read(
            f"SELECT DISTINCT s.sample_id FROM {CATALOG}.samples s JOIN _ids USING (sample_id) WHERE s.run_id = ?",
            [run_id], {"_ids": _key_table("sample_id", sorted(unknown))},
        ).column("sample_id").to_pylist()
        self._remember(run_id, found)
        missing = unknown - set(found)
        if missing:
            shown = ", ".join(sorted(missing)[:5])
            raise StoreError(f"sample_id: {len(missing)} unknown sample id(s) in run {run_id!r}: {shown}")

    @staticmethod
    def _samples_batch(run_id: str, samples: Sequence[SampleRow]) -> pa.Table:
        prompts = [_as_array(s.prompt_tokens, "i", f"samples[{i}].prompt_tokens") for i, s in enumerate(samples)]
        for i, s in enumerate(samples):
            if s.group_size < 1:
                raise StoreError(f"samples[{i}].group_size={s.group_size}: must be >= 1")
        return pa.table(
            {
                "run_id": [run_id] * len(samples),
                "sample_id": [s.sample_id for s in samples],
                "problem_id": [s.problem_id for s in samples],
                "agent": [s.agent for s in samples],
                "turn": pa.array([s.turn for s in samples], pa.int32()),
                "parent_sample_id": [s.parent_sample_id for s in samples],
                "group_id": [s.group_id for s in samples],
                "group_size": pa.array([s.group_size for s in samples], pa.int32()),
                "prompt_tokens": _list_array(prompts, pa.int32()),
            },
            schema=ARROW_SCHEMAS["samples"],
        )

    @staticmethod
    def _segments_batch(run_id: str, segments: Sequence[SegmentRow]) -> pa.Table:
        tokens, logprobs = [], []
        for i, s in enumerate(segments):
            t = _as_array(s.token_ids, "i", f"segments[{i}].token_ids")
            lp = _as_array(s.logprobs, "f", f"segments[{i}].logprobs")
            if len(t) != len(lp):
                raise StoreError(f"segments[{i}] (sample {s.sample_id}): token_ids has {len(t)} entries "
                                 f"but logprobs has {len(lp)}")
            if s.finish_reason not in ("stop", "length", "budget"):
                raise StoreError(f"segments[{i}].finish_reason={s.finish_reason!r}: expected stop, length or budget")
            tokens.append(t)
            logprobs.append(lp)
        return pa.table(
            {
                "run_id": [run_id] * len(segments),
                "sample_id": [s.sample_id for s in segments],
                "segment_index": pa.array([s.segment_index for s in segments], pa.int32()),
                "token_ids": _list_array(tokens, pa.int32()),
                "logprobs": _list_array(logprobs, pa.float32()),
                "policy_version": pa.array([s.policy_version for s in segments], pa.int32()),
                "finish_reason": [s.finish_reason for s in segments],
            },
            schema=ARROW_SCHEMAS["segments"],
        )

    @staticmethod
    def _rewards_batch(run_id: str, rewards: Sequence[RewardRow]) -> pa.Table:
        for i, r in enumerate(rewards):
            if not isinstance(r.reward, (int, float, np.floating, np.integer)) or not np.isfinite(r.reward):
                raise StoreError(f"rewards[{i}].reward={r.reward!r}: expected a finite number")
        return pa.table(
            {
                "run_id": [run_id] * len(rewards),
                "sample_id": [r.sample_id for r in rewards],
                "reward": pa.array([float(r.reward) for r in rewards], pa.float32()),
                "correct": [r.correct for r in rewards],
                "outcome": [r.outcome for r in rewards],
                "parsed": [r.parsed for r in rewards],
                "text": [r.text for r in rewards],
            },
            schema=ARROW_SCHEMAS["rewards"],
        )

    # ------------------------------------------------------------------ reads
    def trainable_groups(self, run_id: str, agent: str, limit: int | None = None) -> list[TrainableGroup]:
        """Complete (every member rewarded), unconsumed groups of `agent`, oldest completion first."""
        return self.trainable_groups_by_agent(run_id, [agent], limit)[agent]

    def trainable_groups_by_agent(self, run_id: str, agents: Sequence[str],
                                  limit: int | Mapping[str, int] | None = None,
                                  min_version: int | None = None) -> dict[str, list[TrainableGroup]]:
        """`trainable_groups` of several agents (at most `limit` each, or `limit[agent]`) in one query:
        the learner polls this, so it scans the run's samples, rewards and consumptions once, not once
        per agent.

        With `min_version`, groups with a segment sampled by an older policy version come back too,
        flagged `stale` and not counted against `limit` (all of them, so the learner can drop them)."""
        agent_table = _key_table("agent", agents)
        if limit is not None:
            limits = limit if isinstance(limit, Mapping) else {agent: limit for agent in agents}
            agent_table = agent_table.append_column(
                "max_groups", pa.array([int(limits[agent]) for agent in agents], pa.int64()))
        sql = f"""
            WITH members AS (
                SELECT s.agent, s.group_id, s.sample_id, s.group_size, r.created_at AS done_at
                FROM {CATALOG}.samples s JOIN _agents USING (agent)
                LEFT JOIN (SELECT sample_id, min(created_at) AS created_at FROM {CATALOG}.rewards
                           WHERE run_id = $1 GROUP BY sample_id) r USING (sample_id)
                WHERE s.run_id = $1),
            consumed AS (SELECT DISTINCT sample_id FROM {CATALOG}.consumptions c JOIN _agents USING (agent)
                         WHERE c.run_id = $1),
            complete AS (
                SELECT agent, group_id, list(sample_id ORDER BY sample_id) AS sample_ids, max(done_at) AS completed_at
                FROM members
                GROUP BY agent, group_id
                HAVING count(done_at) = any_value(group_size)
                   AND count(*) FILTER (WHERE sample_id IN (SELECT sample_id FROM consumed)) = 0),
            versions AS (
                SELECT c.agent, c.group_id, min(g.policy_version) AS oldest_version
                FROM (SELECT agent, group_id, unnest(sample_ids) AS sample_id FROM complete) c
                JOIN {CATALOG}.segments g ON g.run_id = $1 AND g.sample_id = c.sample_id
                GROUP BY c.agent, c.group_id),
            flagged AS (
                SELECT complete.*, coalesce(v.oldest_version, 0) AS oldest_version,
                       coalesce(v.oldest_version, 0) < $2 AS stale
                FROM complete LEFT JOIN versions v USING (agent, group_id))
            SELECT agent, group_id, sample_ids, oldest_version, stale FROM (
                SELECT *, row_number() OVER (PARTITION BY agent, stale ORDER BY completed_at, group_id) AS position
                FROM flagged){' JOIN _agents USING (agent) WHERE stale OR position <= max_groups' if limit is not None else ''}
            ORDER BY agent, stale, position"""
        floor = -1 if min_version is None else int(min_version)
        found: dict[str, list[TrainableGroup]] = {agent: [] for agent in agents}
        for r in self._read(sql, [run_id, floor], {"_agents": agent_table}).to_pylist():
            found[r["agent"]].append(TrainableGroup(r["group_id"], r["agent"], r["sample_ids"],
                                                    int(r["oldest_version"]), bool(r["stale"])))
        return found

    def load_samples(self, run_id: str, sample_ids: Sequence[str]) -> dict[str, StoredSample]:
        """Rebuild samples (prompt, tokens, behaviour log-probs, versions) from their segments."""
        ids = _key_table("sample_id", sample_ids)
        meta = self._read(
            f"""SELECT s.sample_id, s.agent, s.group_id, s.prompt_tokens, r.reward, r.parsed
                FROM {CATALOG}.samples s JOIN _ids USING (sample_id)
                LEFT JOIN {CATALOG}.rewards r ON r.run_id = s.run_id AND r.sample_id = s.sample_id
                WHERE s.run_id = ?""", [run_id], {"_ids": ids}).to_pylist()
        segs = self._read(
            f"""SELECT g.sample_id, g.segment_index, g.token_ids, g.logprobs, g.policy_version, g.finish_reason
                FROM {CATALOG}.segments g JOIN _ids USING (sample_id)
                WHERE g.run_id = ? ORDER BY g.sample_id, g.segment_index""", [run_id], {"_ids": ids}).to_pylist()
        by_sample: dict[str, list[dict[str, Any]]] = {}
        for seg in segs:
            by_sample.setdefault(seg["sample_id"], []).append(seg)
        result = {}
        for m in meta:
            parts = by_sample.get(m["sample_id"], [])
            tokens = [np.asarray(p["token_ids"], dtype=np.int64) for p in parts]
            result[m["sample_id"]] = StoredSample(
                sample_id=m["sample_id"], agent=m["agent"], group_id=m["group_id"],
                prompt_tokens=np.asarray(m["prompt_tokens"], dtype=np.int64),
                token_ids=np.concatenate(tokens) if tokens else np.zeros(0, np.int64),
                logprobs=np.concatenate([np.asarray(p["logprobs"], np.float32) for p in parts])
                if parts else np.zeros(0, np.float32),
                versions=np.concatenate([np.full(len(t), p["policy_version"], np.int64) for t, p in zip(tokens, parts)])
                if parts else np.zeros(0, np.int64),
                finish_reason=parts[-1]["finish_reason"] if parts else None,
                reward=m["reward"], parsed=m["parsed"], num_segments=len(parts),
            )
        missing = [sid for sid in sample_ids if sid not in result]
        if missing:
            raise StoreError(f"sample_id: unknown sample id(s) in run {run_id!r}: {', '.join(missing[:5])}")
        return result

    def samples_of_problems(self, run_id: str, problem_ids: Sequence[str]) -> list[dict[str, Any]]:
        """The stored samples of these problems (ids, agent, turn, group, parent, rewarded or not), by turn.

        Filtered in SQL, so a rollout task's cost does not grow with the run's size."""
        ids = _key_table("problem_id", problem_ids)
        return self._read(
            f"""SELECT s.sample_id, s.problem_id, s.agent, s.turn, s.group_id, s.parent_sample_id,
                       EXISTS (SELECT 1 FROM {CATALOG}.rewards r
                               WHERE r.run_id = s.run_id AND r.sample_id = s.sample_id) AS rewarded
                FROM {CATALOG}.samples s JOIN _ids USING (problem_id)
                WHERE s.run_id = ? ORDER BY s.turn, s.sample_id""", [run_id], {"_ids": ids}).to_pylist()

    def known_problems(self, run_id: str, problem_ids: Sequence[str]) -> set[str]:
        """Which of these problem ids the run has recorded already."""
        ids = _key_table("problem_id", problem_ids)
        return set(self._read(
            f"SELECT DISTINCT p.problem_id FROM {CATALOG}.problems p JOIN _ids USING (problem_id) WHERE p.run_id = ?",
            [run_id], {"_ids": ids}).column("problem_id").to_pylist())

    def latest_version(self, run_id: str) -> tuple[int, str] | None:
        """The newest committed policy version and its checkpoint, or None before the first step."""
        rows = self._read(
            f"SELECT version, checkpoint_uri FROM {CATALOG}.policy_versions WHERE run_id = ? "
            "ORDER BY version DESC LIMIT 1", [run_id]).to_pylist()
        return (rows[0]["version"], rows[0]["checkpoint_uri"]) if rows else None

    def query(self, sql: str, params: Sequence[Any] = ()) -> pa.Table:
        """Run any SQL with the lake as the default catalog (tables and views unqualified)."""
        def attempt() -> pa.Table:
            with self._lock:
                self._con.execute(f"USE {CATALOG}")
                try:
                    result = self._con.execute(sql, list(params))
                    return result.to_arrow_table() if result.description else pa.table({})
                finally:
                    self._con.execute("USE memory")
        return self._retry(attempt)

    def count(self, table: str, run_id: str | None = None) -> int:
        if table not in ARROW_SCHEMAS:
            raise StoreError(f"table={table!r}: unknown table; choose one of {sorted(ARROW_SCHEMAS)}")
        where = " WHERE run_id = ?" if run_id is not None else ""
        params = [run_id] if run_id is not None else []
        return self._read(f"SELECT count(*) AS n FROM {CATALOG}.{table}{where}", params).column("n")[0].as_py()

    # ------------------------------------------------------------------ maintenance
    def data_file_count(self) -> int:
        """Parquet data files referenced by the current snapshot, over all tables."""
        total = 0
        for table in ARROW_SCHEMAS:
            total += self._read(f"SELECT count(*) AS n FROM ducklake_list_files('{CATALOG}', '{table}')"
                                ).column("n")[0].as_py()
        return total

    def compact(self, retention_s: float = 0.0) -> dict[str, int]:
        """Merge small Parquet files, expire snapshots older than `retention_s` seconds and delete the files
        that nothing unexpired needs once they have been unneeded that long, and the files no commit ever
        referenced (a failed merge's output) once they are that old.

        Safe beside live writers and readers when `retention_s` exceeds the longest query: merging keeps
        every snapshot readable (a snapshot can refer to part of a merged file), and a file replaced by a
        merge stays on disk past the retention, so a query planned against the snapshot before the merge
        still finds it. `retention_s=0` deletes at once: only for a store nothing else is reading.

        Merged files are left alone once they reach `COMPACTED_FILE_BYTES`, so a compaction rewrites at
        most that much of a table's older data, not the whole table each time.

        Two workarounds, both measured on DuckLake 1.5.5 with the SQLite catalog:
        - its `older_than` compares timestamps as text, so a bound on the current UTC day matches every
          snapshot and file of that day (even those of the last second). Snapshots are therefore expired
          by id, and replaced files deleted by id (`_delete_replaced_files`), both chosen here with a real
          timestamp comparison;
        - its flush of inlined rows reports a concurrent commit as an aborted transaction: a failed call
          is rolled back and retried like a lock conflict."""
        if retention_s < 0:
            raise StoreError(f"retention_s={retention_s}: must be >= 0")
        before = self.data_file_count()

        def run(sql: str) -> list:
            with self._lock:
                try:
                    return self._con.execute(sql).fetchall()
                except duckdb.Error:
                    self._rollback_quietly()
                    raise

        def call(sql: str) -> list:
            return self._retry(lambda: run(sql), transient=("transaction is aborted",))

        call(f"CALL ducklake_flush_inlined_data('{CATALOG}')")
        call(f"CALL ducklake_merge_adjacent_files('{CATALOG}', max_file_size => {COMPACTED_FILE_BYTES})")
        expired = self._read(
            f"""SELECT coalesce(list(snapshot_id ORDER BY snapshot_id), []) AS ids FROM ducklake_snapshots('{CATALOG}')
                WHERE snapshot_time < now() - INTERVAL '{float(retention_s)} seconds'
                  AND snapshot_id < (SELECT max(snapshot_id) FROM ducklake_snapshots('{CATALOG}'))""",
        ).column("ids")[0].as_py()
        if expired:
            call(f"CALL ducklake_expire_snapshots('{CATALOG}', versions => {[int(v) for v in expired]})")
        deleted = self._delete_replaced_files(retention_s, call)
        return {"files_before": before, "files_after": self.data_file_count(), "snapshots_expired": len(expired),
                "files_deleted": deleted, "orphans_deleted": self._delete_orphaned_files(retention_s)}

    def _delete_orphaned_files(self, retention_s: float) -> int:
        """Delete the Parquet files of a local data path that the catalog does not know, once they are
        `retention_s` old. A merge whose commit fails (DuckLake's aborted transaction, retried above)
        leaves its output files behind: 313 files, 542 MB, in a 25-minute soak, against 21 MB of live
        data. A writer's file is unknown until its commit, seconds later, so younger files stay; the
        files are listed before the catalog is read, so one committed in between is known. Remote data
        paths are left alone (DuckLake's `ducklake_delete_orphaned_files` has the same `older_than`)."""
        if "://" in self.data_path:
            return 0
        horizon = time.time() - retention_s
        on_disk = list(Path(self.data_path).resolve().rglob("*.parquet"))
        meta = f"__ducklake_metadata_{CATALOG}"
        known = {Path(p).name for p in self._read(
            f"""SELECT path FROM {meta}.ducklake_data_file UNION ALL SELECT path FROM {meta}.ducklake_delete_file
                UNION ALL SELECT path FROM {meta}.ducklake_files_scheduled_for_deletion""").column("path").to_pylist()}
        deleted = 0
        for path in on_disk:
            try:
                if path.name not in known and path.stat().st_mtime < horizon:
                    path.unlink()
                    deleted += 1
            except FileNotFoundError:  # deleted meanwhile by a cleanup elsewhere
                pass
        return deleted

    def _delete_replaced_files(self, retention_s: float, call: Callable[[str], list]) -> int:
        """Delete the data files DuckLake scheduled for deletion (replaced by a merge, or needed only by
        expired snapshots) at least `retention_s` seconds ago, and forget them in its catalog: what
        `ducklake_cleanup_old_files(older_than => ...)` would do, with a real timestamp comparison.
        Remote data paths go through DuckLake's function with a bound on the UTC day before the horizon
        (its text comparison is right across days): their files stay up to a day longer."""
        if retention_s == 0:
            return len(call(f"CALL ducklake_cleanup_old_files('{CATALOG}', cleanup_all => true)"))
        if "://" in self.data_path:
            horizon = datetime.now(timezone.utc) - timedelta(seconds=retention_s)
            day_before = horizon.replace(hour=0, minute=0, second=0, microsecond=0) - timedelta(microseconds=1)
            return len(call(f"CALL ducklake_cleanup_old_files('{CATALOG}', "
                            f"older_than => TIMESTAMPTZ '{day_before.isoformat()}')"))
        scheduled = f"__ducklake_metadata_{CATALOG}.ducklake_files_scheduled_for_deletion"
        due = self._read(f"""SELECT data_file_id, path, path_is_relative FROM {scheduled}
                             WHERE schedule_start::TIMESTAMPTZ < now() - INTERVAL '{float(retention_s)} seconds'""")
        root = Path(self.data_path).resolve()
        for row in due.to_pylist():
            path = root / row["path"] if row["path_is_relative"] else Path(row["path"])
            path.unlink(missing_ok=True)  # a file deleted by an earlier, interrupted cleanup is gone already

        def forget(con: duckdb.DuckDBPyConnection) -> None:
            con.register("_due", due)
            try:
                con.execute(f"DELETE FROM {scheduled} WHERE data_file_id IN (SELECT data_file_id FROM _due)")
            finally:
                con.unregister("_due")

        if due.num_rows:
            self._transaction(forget)
        return due.num_rows
