"""The store's connection: DuckDB with the DuckLake catalog attached, and its retrying primitives.

Why DuckLake: a plain DuckDB file is locked by one process, while rollout flows, learner flows and a
user's SQL session run in different processes. DuckLake keeps the catalog in SQLite (or Postgres) and
the data in Parquet, so all of them can read and write at once. The extensions are loaded from the
installed PyPI packages (`duckdb-extension-*`), never downloaded.

Concurrency: a SQLite catalog runs in WAL mode with one writing transaction at a time across processes
(`sqlite_catalog.py`); a commit that meets a lock or a DuckLake conflict is rolled back and retried
with jittered exponential backoff (counted in `lock_retries`).

Deliberate simplification: one DuckDB connection per store guarded by a lock (tasks in threads share it).
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from marsrl_core.store.guard import refusal
from marsrl_core.store.maintenance_lock import MaintenanceLock
from marsrl_core.store.rows import StoreError
from marsrl_core.store.run_index import Indexes, RunIndex, load_sql
from marsrl_core.store.schema import table_ddl, view_ddl
from marsrl_core.store.sqlite_catalog import WriterLock, attaching

CATALOG = "lake"
KNOWN_SAMPLES_CACHE = 100_000  # sample ids remembered per store for the unknown-id checks
_TRANSIENT = ("database is locked", "conflict", "failed to commit", "busy", "could not serialize")


def _extension_files() -> dict[str, str]:
    """Extension name -> file path, for every installed `duckdb-extension-*` package."""
    found = {}
    for module_name in (
        "duckdb_extension_sqlite_scanner",
        "duckdb_extension_ducklake",
        "duckdb_extension_postgres_scanner",
        "duckdb_extension_httpfs",
    ):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        pattern = os.path.join(os.path.dirname(module.__file__), "extensions", "*", "*.duckdb_extension")
        for path in glob.glob(pattern):
            found[Path(path).name.split(".")[0]] = path
    return found


@contextlib.contextmanager
def registered(con: duckdb.DuckDBPyConnection, name: str, table: pa.Table) -> Iterator[None]:
    """`table` (Arrow) queryable as `name` on `con` for the block."""
    con.register(name, table)
    try:
        yield
    finally:
        con.unregister(name)


def _is_transient(err: Exception) -> bool:
    text = str(err).lower()
    return any(marker in text for marker in _TRANSIENT)


class StoreConnection:
    """One DuckDB connection with the lake attached as `CATALOG`; safe to share between threads.

    `read_only` (the SQL console): an existing store attached with DuckLake's READ_ONLY, file access
    limited to its data path and configuration locked after the attach, and `query` runs only what
    reads (`guard.py`), so nothing a user types can change the ledger."""

    def __init__(
        self,
        catalog_url: str,
        data_path: str,
        *,
        max_retries: int = 200,
        create: bool = True,
        read_only: bool = False,
        threads: int | None = None,
    ):
        self.catalog_url = catalog_url
        self.data_path = data_path
        self.read_only = read_only
        self.threads = threads
        self.max_retries = max_retries
        self.lock_retries = 0
        self._lock = threading.RLock()
        self._setup()
        self._con = self._connect(create)

    def _setup(self) -> None:
        """State of the parts built on this connection, set before it opens."""
        self._known_samples: set[tuple[str, str]] = set()  # (run_id, sample_id) seen in the store
        self.indexes = Indexes(CATALOG)  # the polled reads' answers, per run (`run_index.py`)
        self._written: list[tuple[str, pa.Table]] | None = None  # the open transaction's inserts

    @classmethod
    def from_config(cls, store_config: Any, **kwargs: Any) -> StoreConnection:
        return cls(store_config.catalog_url, store_config.data_path, threads=store_config.threads, **kwargs)

    def _connect(self, create: bool) -> duckdb.DuckDBPyConnection:
        kind, _, target = self.catalog_url.partition(":")
        if kind not in ("sqlite", "postgres") or not target:
            raise StoreError(f"catalog_url={self.catalog_url!r}: expected 'sqlite:<file>' or 'postgres:<dsn>'")
        with attaching(Path(target), create) if kind == "sqlite" else contextlib.nullcontext():
            self._maintenance = MaintenanceLock(Path(target) if kind == "sqlite" else None)
            self._writer = WriterLock(Path(target) if kind == "sqlite" and not self.read_only else None)
            return self._attach(kind)

    def _attach(self, kind: str) -> duckdb.DuckDBPyConnection:
        if "://" not in self.data_path and not self.read_only:
            try:
                Path(self.data_path).mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise StoreError(f"data_path={self.data_path!r}: cannot create folder ({err.strerror})") from None
        extensions = _extension_files()
        needed = ["sqlite_scanner" if kind == "sqlite" else "postgres_scanner", "ducklake"]
        if self.data_path.startswith(("s3://", "gs://", "http")):
            needed.insert(0, "httpfs")
        con = duckdb.connect()
        if self.threads is not None and not self.read_only:  # `store.threads`; the SQL console keeps every core
            con.execute(f"SET threads = {int(self.threads)}")
        if "://" not in self.data_path:
            # DuckDB's external file cache keeps the bytes of every Parquet file a query has read, until
            # memory_limit (80% of RAM). Every append adds files and the rollout and learner re-read the
            # whole run, so in a long-lived process the cache grows with the run's data, without bound.
            # Local files are in the OS page cache anyway; remote data paths keep the cache.
            con.execute("SET enable_external_file_cache = false")
        for name in needed:
            if name not in extensions:
                raise StoreError(
                    f"catalog_url={self.catalog_url!r}: the duckdb extension {name!r} is not installed "
                    f"(pip install duckdb-extension-{name.replace('_', '-')}=={duckdb.__version__})"
                )
            con.execute(f"LOAD '{extensions[name]}'")
        if self.data_path.startswith("s3://"):  # S3-compatible storage: credentials from the usual variables
            endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
            host = endpoint.split("://", 1)[-1]
            options = [
                f"KEY_ID '{os.environ.get('AWS_ACCESS_KEY_ID', '')}'",
                f"SECRET '{os.environ.get('AWS_SECRET_ACCESS_KEY', '')}'",
                f"REGION '{os.environ.get('AWS_REGION', 'us-east-1')}'",
            ]
            if host:
                options += [
                    f"ENDPOINT '{host}'",
                    "URL_STYLE 'path'",
                    f"USE_SSL {str(endpoint.startswith('https')).lower()}",
                ]
            con.execute(f"CREATE OR REPLACE SECRET marsrl_s3 (TYPE s3, {', '.join(options)})")
        data_path = self.data_path if "://" in self.data_path else str(Path(self.data_path).resolve()) + "/"
        try:
            # Nothing is inlined in the catalog: every commit writes Parquet. With inlining, DuckLake
            # 1.5.5's `ducklake_flush_inlined_data` (compaction) hides rows from readers in other
            # processes for a moment: a rollout turn that resumed then decoded a stored segment again.
            options = f"DATA_PATH '{data_path}', DATA_INLINING_ROW_LIMIT 0" + (", READ_ONLY" if self.read_only else "")
            con.execute(f"ATTACH 'ducklake:{self.catalog_url}' AS {CATALOG} ({options})")
        except duckdb.Error as err:
            raise StoreError(f"catalog_url={self.catalog_url!r}: cannot attach DuckLake catalog ({err})") from None
        self._con = con
        if self.read_only:  # files: the data path only (and the catalog DuckLake opened); no setting changes
            con.execute("SET temp_directory = ''")
            con.execute("SET allowed_directories = ?", [[data_path]])
            con.execute("SET enable_external_access = false")
            con.execute("SET lock_configuration = true")
            return con
        self._transaction(lambda c: [c.execute(sql) for sql in table_ddl(CATALOG) + view_ddl(CATALOG)])
        return con

    def close(self) -> None:
        with self._lock:
            self._con.close()
            self._maintenance.close()
            self._writer.close()

    @contextlib.contextmanager
    def _using(self) -> Iterator[None]:
        """This connection for one query or transaction: this thread's, and shared with other
        connections but not with a compaction's catalog rewrite (`maintenance_lock.py`)."""
        with self._lock, self._maintenance.shared():
            yield

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
        """Run `body` in one transaction, all or nothing, retried on transient lock errors. What it
        inserted (`_insert`) goes to the run indexes once it has committed (`Indexes.committed`)."""

        def attempt() -> Any:
            with self._using(), self._writer.held():
                before = self._lake_snapshot() if self.indexes.runs else None
                self._written, at = [], None
                self._con.execute("BEGIN TRANSACTION")
                try:
                    result = body(self._con)
                    if before is not None and self._written:
                        at = self._con.execute("SELECT current_timestamp").fetchone()[0]
                    self._con.execute("COMMIT")
                except BaseException:
                    self._rollback_quietly()
                    raise
                finally:
                    written, self._written = self._written, None
                if at is not None:  # committed: nothing after this line may fail the call (a retry would write again)
                    try:
                        self.indexes.committed(before, self._lake_snapshot(), written, at)
                    except duckdb.Error:
                        self.indexes.drop()  # the next read loads them again
                return result

        return self._retry(attempt)

    def _rollback_quietly(self) -> None:
        """End a failed transaction so the connection can run the retry (there may be none to end)."""
        try:
            self._con.execute("ROLLBACK")
        except duckdb.Error:
            pass

    def _read(self, sql: str, params: Sequence[Any] = (), tables: dict[str, pa.Table] | None = None) -> pa.Table:
        def attempt() -> pa.Table:
            with self._using():
                for name, table in (tables or {}).items():
                    self._con.register(name, table)
                try:
                    return self._con.execute(sql, list(params)).to_arrow_table()
                finally:
                    for name in tables or {}:
                        self._con.unregister(name)

        return self._retry(attempt)

    def _index(self, run_id: str) -> RunIndex:
        """The run's index at the lake's newest snapshot (`run_index.py`)."""
        with self._using():
            return self.indexes.current(run_id, self._lake_snapshot(), self._read, lambda: self._load_index(run_id))

    def _refresh_index(self, run_id: str) -> None:
        """Bring the run's index up to date if this connection keeps one, so that a write's checks can
        ask it instead of the SQL (`_index_in`); a write never loads one."""
        if run_id in self.indexes.runs:
            self._index(run_id)

    def _load_index(self, run_id: str) -> RunIndex:
        """A new index of the run, read at one snapshot (one read transaction)."""

        def attempt() -> RunIndex:
            with self._using():
                self._con.execute("BEGIN TRANSACTION")
                try:
                    snapshot = self._con.execute(f"SELECT id FROM {CATALOG}.current_snapshot()").fetchone()[0]
                    index = RunIndex(run_id, snapshot)
                    for table, sql in load_sql(CATALOG).items():
                        index.add(table, self._con.execute(sql, [run_id]).to_arrow_table())
                finally:
                    self._rollback_quietly()
                return index

        return self._retry(attempt)

    def _index_in(self, con: duckdb.DuckDBPyConnection, run_id: str) -> RunIndex | None:
        """The run's index if it holds what the open transaction on `con` reads (the same snapshot),
        so that the transaction's checks can ask it; None: they ask the SQL."""
        index = self.indexes.runs.get(run_id)
        if index is None or index.snapshot != con.execute(f"SELECT id FROM {CATALOG}.current_snapshot()").fetchone()[0]:
            return None
        self.indexes.checked += 1
        return index

    def _lake_snapshot(self) -> int:
        """The lake's newest snapshot (DuckLake gives every commit, of any process, a new one), read from
        the catalog's own table: a third of the cost of `current_snapshot()`."""
        with self._using():
            return self._con.execute(
                f"SELECT max(snapshot_id) FROM __ducklake_metadata_{CATALOG}.ducklake_snapshot"
            ).fetchone()[0]

    def _remember(self, run_id: str, sample_ids: Iterable[str]) -> None:
        """Cache sample ids known to exist; the cache is dropped when full (a miss costs one query), so a
        days-long run does not hold every id it ever wrote."""
        if len(self._known_samples) > KNOWN_SAMPLES_CACHE:
            self._known_samples.clear()
        self._known_samples |= {(run_id, sid) for sid in sample_ids}

    def _insert(self, con: duckdb.DuckDBPyConnection, table: str, batch: pa.Table) -> None:
        """Insert `batch` into `table` inside the open transaction, stamped with its time."""
        name = f"_batch_{table}"
        with registered(con, name, batch):
            con.execute(f"INSERT INTO {CATALOG}.{table} SELECT *, current_timestamp FROM {name}")
        if self._written is not None:
            self._written.append((table, batch))

    def query(self, sql: str, params: Sequence[Any] = ()) -> pa.Table:
        """Run any SQL with the lake as the default catalog (tables and views unqualified); a read-only
        store runs only what reads (`guard.refusal`; StoreError for the rest), and reads no file
        outside its data path (StoreError naming the file)."""
        if self.read_only:
            with self._using():
                reason = refusal(self._con, sql)
            if reason:
                raise StoreError(f"the store is open read-only: {reason}")

        def attempt() -> pa.Table:
            with self._using():
                self._con.execute(f"USE {CATALOG}")
                try:
                    result = self._con.execute(sql, list(params))
                    return result.to_arrow_table() if result.description else pa.table({})
                except duckdb.PermissionException as err:
                    raise StoreError(
                        f"the store is open read-only and reads only its data path {self.data_path!r}: "
                        f"{str(err).splitlines()[0].removeprefix('Permission Error: ').split(' - ')[0]}"
                    ) from None
                finally:
                    self._con.execute("USE memory")

        return self._retry(attempt)
