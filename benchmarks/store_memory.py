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
with `compact()` every 250 appends, as `marsrl compact` or the maintenance flow would). Growth is RSS
after the last call minus RSS after the first 250 (past warm-up), per call. It is how the soak's
remaining memory growth was traced to queries over lake tables and to the store's growth.

Run: `python benchmarks/store_memory.py`. Writes benchmarks/results/store_memory.json with, per
variant, rss_start_mb, rss_end_mb and kb_per_operation. Each variant runs in its own process.
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
VARIANTS = ("select_1", "lake_count", "lake_count_unfiltered", "lake_count_int_filter", "lake_count_unpushed_filter",
            "trainable_groups", "append", "append_compacted")


def finished(rows) -> dict[str, list]:
    """A 20-token segment and a reward for each sample row: what finishing them appends."""
    from marsrl_core.store import RewardRow, SegmentRow

    return {"segments": [SegmentRow(r.sample_id, 0, [1] * 20, [-0.1] * 20, 0, "stop") for r in rows],
            "rewards": [RewardRow(r.sample_id, 1.0, True) for r in rows]}


def measure(variant: str) -> dict[str, float]:
    import psutil

    from marsrl_core.store import SampleRow, SegmentStore

    with tempfile.TemporaryDirectory() as tmp:
        store = SegmentStore(f"sqlite:{tmp}/lake.sqlite", f"{tmp}/data")
        for b in range(30):
            rows = [SampleRow(uuid.uuid4().hex, f"b{b}", "solver", 0, f"g{b}-{i // 16}", 16, [1, 2, 3])
                    for i in range(64)]
            store.append("r", samples=rows)
            store.append("r", **finished(rows))

        def append(call: int) -> None:
            rows = [SampleRow(uuid.uuid4().hex, f"a{call}", "verifier", 1, f"a{call}", 4, [1, 2, 3]) for _ in range(4)]
            store.append("r", samples=rows, **finished(rows))
            if variant == "append_compacted" and call % 250 == 0:
                store.compact()

        operations = {
            "select_1": lambda call: store.query("SELECT 1"),
            "lake_count": lambda call: store.count("samples", "r"),  # WHERE run_id = ?: a text filter
            "lake_count_unfiltered": lambda call: store.query("SELECT count(*) FROM samples"),
            "lake_count_int_filter": lambda call: store.query("SELECT count(*) FROM samples WHERE turn = ?", [0]),
            # the text filter written so that DuckDB cannot push it into the DuckLake scan
            "lake_count_unpushed_filter": lambda call: store.query(
                "SELECT count(*) FROM samples WHERE concat(run_id, '') = ?", ["r"]),
            "trainable_groups": lambda call: store.trainable_groups_by_agent("r", ["solver", "verifier", "corrector"], 4),
            "append": append,
            "append_compacted": append,
        }
        process, rss = psutil.Process(), {}
        for call in range(1, CALLS + 1):
            operations[variant](call)
            if call in (WARMUP, CALLS):
                gc.collect()
                rss[call] = process.memory_info().rss / 2**20
    return {"rss_start_mb": rss[WARMUP], "rss_end_mb": rss[CALLS],
            "kb_per_operation": (rss[CALLS] - rss[WARMUP]) * 1024 / (CALLS - WARMUP)}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--variant":  # the child process of one variant
        print(json.dumps(measure(sys.argv[2])))
        return
    figures = {}
    for variant in VARIANTS:
        out = subprocess.run([sys.executable, __file__, "--variant", variant], capture_output=True, text=True,
                             check=True).stdout.strip().splitlines()[-1]
        figures[variant] = json.loads(out)
    print_rows(f"RSS growth over {CALLS - WARMUP} repeated operations", ["operation", "RSS after warm-up MB",
               "RSS at end MB", "KB per operation"],
               [[v, f["rss_start_mb"], f["rss_end_mb"], f["kb_per_operation"]] for v, f in figures.items()])
    print(f"written to {write_results('store_memory', figures)}")


if __name__ == "__main__":
    main()
