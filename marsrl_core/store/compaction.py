"""Compaction of the store: merge the small Parquet files every commit writes, expire old snapshots,
delete the files nothing needs any more. A long run's polls stay as fast late in the run as early."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import duckdb

from marsrl_core.store.connection import CATALOG, StoreConnection, registered
from marsrl_core.store.rows import StoreError
from marsrl_core.store.schema import ARROW_SCHEMAS

COMPACTED_FILE_BYTES = 16 * 2**20  # compaction merges files smaller than this (DuckLake's default: 512 MB)


class StoreCompaction(StoreConnection):
    """The maintenance of `SegmentStore`."""

    def data_file_count(self) -> int:
        """Parquet data files referenced by the current snapshot, over all tables."""
        total = 0
        for table in ARROW_SCHEMAS:
            total += (
                self._read(f"SELECT count(*) AS n FROM ducklake_list_files('{CATALOG}', '{table}')")
                .column("n")[0]
                .as_py()
            )
        return total

    def compact(self, retention_s: float = 0.0) -> dict[str, int]:
        """Merge small Parquet files, expire snapshots older than `retention_s` seconds and delete the files
        that nothing unexpired needs once they have been unneeded that long, and the files no commit ever
        referenced (a failed merge's output) once they are that old.

        Safe beside live writers and readers when `retention_s` exceeds the longest query: the flush,
        merge and expiry hold the maintenance lock exclusive (`maintenance_lock.py`: on a SQLite
        catalog, no query of any process overlaps them, as one that did could miss rows), merging keeps
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
        - a merge (or the flush of rows a store written before inlining was switched off holds in its
          catalog) reports a concurrent commit as an aborted transaction: a failed call is rolled back
          and retried like a lock conflict."""
        if retention_s < 0:
            raise StoreError(f"retention_s={retention_s}: must be >= 0")
        before = self.data_file_count()

        def run(sql: str) -> list:
            with self._lock, self._maintenance.exclusive():
                try:
                    return self._con.execute(sql).fetchall()
                except duckdb.Error:
                    self._rollback_quietly()
                    raise

        def call(sql: str) -> list:
            return self._retry(lambda: run(sql), transient=("transaction is aborted",))

        call(f"CALL ducklake_flush_inlined_data('{CATALOG}')")
        call(f"CALL ducklake_merge_adjacent_files('{CATALOG}', max_file_size => {COMPACTED_FILE_BYTES})")
        expired = (
            self._read(
                f"""SELECT coalesce(list(snapshot_id ORDER BY snapshot_id), []) AS ids
                FROM ducklake_snapshots('{CATALOG}')
                WHERE snapshot_time < now() - INTERVAL '{float(retention_s)} seconds'
                  AND snapshot_id < (SELECT max(snapshot_id) FROM ducklake_snapshots('{CATALOG}'))""",
            )
            .column("ids")[0]
            .as_py()
        )
        if expired:
            call(f"CALL ducklake_expire_snapshots('{CATALOG}', versions => {[int(v) for v in expired]})")
        deleted = self._delete_replaced_files(retention_s, call)
        return {
            "files_before": before,
            "files_after": self.data_file_count(),
            "snapshots_expired": len(expired),
            "files_deleted": deleted,
            "orphans_deleted": self._delete_orphaned_files(retention_s),
        }

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
        known = {
            Path(p).name
            for p in self._read(
                f"""SELECT path FROM {meta}.ducklake_data_file UNION ALL SELECT path FROM {meta}.ducklake_delete_file
                UNION ALL SELECT path FROM {meta}.ducklake_files_scheduled_for_deletion"""
            )
            .column("path")
            .to_pylist()
        }
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
            horizon = datetime.now(UTC) - timedelta(seconds=retention_s)
            day_before = horizon.replace(hour=0, minute=0, second=0, microsecond=0) - timedelta(microseconds=1)
            return len(
                call(
                    f"CALL ducklake_cleanup_old_files('{CATALOG}', "
                    f"older_than => TIMESTAMPTZ '{day_before.isoformat()}')"
                )
            )
        scheduled = f"__ducklake_metadata_{CATALOG}.ducklake_files_scheduled_for_deletion"
        due = self._read(f"""SELECT data_file_id, path, path_is_relative FROM {scheduled}
                             WHERE schedule_start::TIMESTAMPTZ < now() - INTERVAL '{float(retention_s)} seconds'""")
        root = Path(self.data_path).resolve()
        for row in due.to_pylist():
            path = root / row["path"] if row["path_is_relative"] else Path(row["path"])
            path.unlink(missing_ok=True)  # a file deleted by an earlier, interrupted cleanup is gone already

        def forget(con: duckdb.DuckDBPyConnection) -> None:
            with registered(con, "_due", due):
                con.execute(f"DELETE FROM {scheduled} WHERE data_file_id IN (SELECT data_file_id FROM _due)")

        if due.num_rows:
            self._transaction(forget)
        return due.num_rows
