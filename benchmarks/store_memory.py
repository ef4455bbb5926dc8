"""Store memory per operation: resident memory (RSS) growth of one process repeating one operation.

Each variant opens a fresh DuckLake store (SQLite catalog) with 30 batches of 64 finished samples
appended (about 60 data files), then repeats one operation 2,000 times. Reads of the unchanging
store: `select_1` (`SELECT 1`, no lake table), `lake_count` (a count over the samples table with the
store's `run_id = ?` filter, on a text column), the same count unfiltered, with an integer filter
(`turn = ?`) and with the text filter written so that DuckDB cannot push it into the DuckLake scan
(`concat(run_id, '') = ?`), and `trainable_groups` (the learner's poll, three lake tables, one
registered Arrow key table). Writes, which grow the store as a run does: `append` (one transaction
of 4 samples with their segments and rewards, what a rollout stage commits, so 3 new data files
each), and `append_compacted` (the same,
with `compact()` every 250 appends, as `marsrl compact` or the maintenance flow would), and
`append_reopened` (the same appends, the store closed and reopened every 300 calls, which empties
DuckDB's object cache), and `duckdb_join` (no store: a join of two 20,000-row tables in a plain
in-memory DuckDB, the base case), and `trainable_groups_served` and `append_served` (the poll and the
append through `StoreProcess`, the store in a child process replaced when it has grown 64 MB, as the
training processes run it: the caller's growth, and the child's size and replacements). Growth is RSS
after the last call minus RSS after the first 250 (past warm-up), per call. Beside RSS, each variant
reports the growth of live `malloc` memory (glibc's `mallinfo2`, what C++ `new` in DuckDB and
DuckLake allocates) and of DuckDB's own jemalloc (its resident bytes, read through the exported
`duckdb_je_mallctl`), which tells a native allocation that stays live from pages an allocator keeps.
It is how the soak's remaining memory growth was traced to queries over lake tables and to the
store's growth.

Run: `python benchmarks/store_memory.py` (`--only append,append_reopened` runs some variants).
Writes benchmarks/results/store_memory.json with, per variant, rss_start_mb, rss_end_mb,
kb_per_operation, malloc_in_use_kb_per_operation, duckdb_allocator_resident_kb_per_operation, and
object_cache_mb and object_cache_kb_per_operation
(DuckDB's object cache, by its own estimate, at the end and its growth per call; DuckLake keeps each
table's statistics there per snapshot), ms_per_operation (wall clock, side by side in one run), and
for the served variants store_process_rss_end_mb and store_process_replacements. Each variant runs in
its own process.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

from benchmarks.common import print_rows, write_results  # noqa: E402

CALLS, WARMUP = 2000, 250
VARIANTS = (
    "select_1",
    "lake_count",
    "lake_count_unfiltered",
    "lake_count_int_filter",
    "lake_count_unpushed_filter",
    "trainable_groups",
    "append",
    "append_compacted",
    "append_reopened",
    "duckdb_join",
    "trainable_groups_served",
    "append_served",
)
REOPEN_EVERY = 300


def finished(rows) -> dict[str, list]:
    """A 20-token segment and a reward for each sample row: what finishing them appends."""
    from marsrl_core.store import RewardRow, SegmentRow

    return {
        "segments": [SegmentRow(r.sample_id, 0, [1] * 20, [-0.1] * 20, 0, "stop") for r in rows],
        "rewards": [RewardRow(r.sample_id, 1.0, True) for r in rows],
    }


def malloc_in_use_mb() -> float:
    """Live bytes allocated through glibc's malloc, over all arenas (Linux; NaN elsewhere)."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in (
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            )
        ]

    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return float("nan")
    mallinfo2.restype = MallInfo2
    info = mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20


def duckdb_allocator_resident_mb() -> float:
    """Resident bytes of the jemalloc bundled in DuckDB's Linux wheel (NaN where it is not there)."""
    import ctypes
    import glob
    import os

    import duckdb

    try:
        library = ctypes.CDLL(glob.glob(os.path.join(os.path.dirname(duckdb.__file__), "..", "_duckdb*.so"))[0])
        mallctl = library.duckdb_je_mallctl
    except (IndexError, OSError, AttributeError):
        return float("nan")
    epoch, value, size = ctypes.c_uint64(1), ctypes.c_size_t(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_size_t))
    mallctl(b"epoch", None, None, ctypes.byref(epoch), ctypes.c_size_t(ctypes.sizeof(epoch)))  # refresh the stats
    if mallctl(b"stats.resident", ctypes.byref(value), ctypes.byref(size), None, ctypes.c_size_t(0)) != 0:
        return float("nan")
    return value.value / 2**20


def measure(variant: str) -> dict[str, float]:
    import time

    import psutil

    from marsrl_core.store import SampleRow, SegmentStore
    from marsrl_core.store.process import StoreProcess

    with tempfile.TemporaryDirectory() as tmp:
        paths = (f"sqlite:{tmp}/lake.sqlite", f"{tmp}/data")
        store = StoreProcess(*paths) if variant.endswith("_served") else SegmentStore(*paths)
        for b in range(30):
            rows = [
                SampleRow(uuid.uuid4().hex, f"b{b}", "solver", 0, f"g{b}-{i // 16}", 16, [1, 2, 3]) for i in range(64)
            ]
            store.append("r", samples=rows)
            store.append("r", **finished(rows))

        def append(call: int) -> None:
            nonlocal store
            rows = [SampleRow(uuid.uuid4().hex, f"a{call}", "verifier", 1, f"a{call}", 4, [1, 2, 3]) for _ in range(4)]
            store.append("r", samples=rows, **finished(rows))
            if variant == "append_compacted" and call % 250 == 0:
                store.compact()
            if variant == "append_reopened" and call % REOPEN_EVERY == 0:
                store.close()
                store = SegmentStore(*paths, create=False)

        def object_cache_mb() -> float:
            return (
                store.query(
                    "SELECT coalesce(sum(memory_usage_bytes), 0) / 2**20 AS mb FROM duckdb_memory() "
                    "WHERE tag = 'OBJECT_CACHE'"
                )
                .column("mb")[0]
                .as_py()
            )

        plain = duckdb_connection_with_join_tables() if variant == "duckdb_join" else None
        operations = {
            "duckdb_join": lambda call: plain.execute("SELECT count(*) FROM a JOIN b USING (s)").fetchall(),
            "select_1": lambda call: store.query("SELECT 1"),
            "lake_count": lambda call: store.count("samples", "r"),  # WHERE run_id = ?: a text filter
            "lake_count_unfiltered": lambda call: store.query("SELECT count(*) FROM samples"),
            "lake_count_int_filter": lambda call: store.query("SELECT count(*) FROM samples WHERE turn = ?", [0]),
            # the text filter written so that DuckDB cannot push it into the DuckLake scan
            "lake_count_unpushed_filter": lambda call: store.query(
                "SELECT count(*) FROM samples WHERE concat(run_id, '') = ?", ["r"]
            ),
            "trainable_groups": lambda call: store.trainable_groups_by_agent(
                "r", ["solver", "verifier", "corrector"], 4
            ),
            "append": append,
            "append_compacted": append,
            "append_reopened": append,
        }
        operations["trainable_groups_served"] = operations["trainable_groups"]
        operations["append_served"] = append
        process, rss, cache, in_use, jemalloc, clock = psutil.Process(), {}, {}, {}, {}, {}
        for call in range(1, CALLS + 1):
            operations[variant](call)
            if call in (WARMUP, CALLS):
                clock[call] = time.perf_counter()
                gc.collect()
                rss[call], cache[call] = process.memory_info().rss / 2**20, object_cache_mb()
                in_use[call], jemalloc[call] = malloc_in_use_mb(), duckdb_allocator_resident_mb()
        served = isinstance(store, StoreProcess)
        child_mb = psutil.Process(store.pid).memory_info().rss / 2**20 if served and store.pid else float("nan")
        replacements = store.recycled if served else 0
        store.close()
    per_call = 1024 / (CALLS - WARMUP)
    return {
        "ms_per_operation": 1000 * (clock[CALLS] - clock[WARMUP]) / (CALLS - WARMUP),
        "store_process_rss_end_mb": child_mb,
        "store_process_replacements": replacements,
        "rss_start_mb": rss[WARMUP],
        "rss_end_mb": rss[CALLS],
        "kb_per_operation": (rss[CALLS] - rss[WARMUP]) * per_call,
        "malloc_in_use_kb_per_operation": (in_use[CALLS] - in_use[WARMUP]) * per_call,
        "duckdb_allocator_resident_kb_per_operation": (jemalloc[CALLS] - jemalloc[WARMUP]) * per_call,
        "object_cache_mb": cache[CALLS],
        "object_cache_kb_per_operation": (cache[CALLS] - cache[WARMUP]) * per_call,
    }


def duckdb_connection_with_join_tables():
    """A plain in-memory DuckDB (no store) with two 20,000-row tables joined on a text column."""
    import duckdb

    con = duckdb.connect()
    con.execute("CREATE TABLE a AS SELECT i, 'x' || i AS s FROM range(20000) t(i)")
    con.execute("CREATE TABLE b AS SELECT i, 'x' || (i * 3) AS s FROM range(20000) t(i)")
    return con


COLUMNS = (
    "rss_start_mb",
    "rss_end_mb",
    "kb_per_operation",
    "malloc_in_use_kb_per_operation",
    "duckdb_allocator_resident_kb_per_operation",
    "object_cache_mb",
    "object_cache_kb_per_operation",
    "ms_per_operation",
    "store_process_rss_end_mb",
    "store_process_replacements",
)  # printed, in order


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--variant":  # the child process of one variant
        print(json.dumps(measure(sys.argv[2])))
        return
    selected = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else list(VARIANTS)
    if unknown := sorted(set(selected) - set(VARIANTS)):
        raise SystemExit(f"--only: unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    figures = {}
    for variant in selected:
        out = (
            subprocess.run([sys.executable, __file__, "--variant", variant], capture_output=True, text=True, check=True)
            .stdout.strip()
            .splitlines()[-1]
        )
        figures[variant] = json.loads(out)
    print_rows(
        f"Memory growth over {CALLS - WARMUP} repeated operations",
        [
            "operation",
            "RSS after warm-up MB",
            "RSS at end MB",
            "RSS KB per operation",
            "live malloc KB per operation",
            "DuckDB jemalloc resident KB per operation",
            "object cache MB",
            "object cache KB per operation",
            "ms per operation",
            "store process MB at end",
            "store process replacements",
        ],
        [[v, *[f[key] for key in COLUMNS]] for v, f in figures.items()],
    )
    print(f"written to {write_results('store_memory', figures)}")


if __name__ == "__main__":
    main()
