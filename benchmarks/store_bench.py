"""Segment store benchmark: bulk vs row-by-row writes, trainable-group listing at 100K samples,
data files before/after compaction. Run: `python benchmarks/store_bench.py`.

Writes benchmarks/results/store.json with bulk_tokens_per_s, rowwise_tokens_per_s,
index_load_ms_100k (the run's first poll, which reads its index: `store/run_index.py`),
list_trainable_ms_100k (a poll from the index), list_trainable_after_other_commit_ms_100k (a poll
after another connection's stage, read back into the index), stage_append_ms_100k (a rollout stage's
append: 16 new samples with a segment and a reward each, its keys checked in the index),
append_key_check_ms_100k (the same check in SQL, which a write runs when the index cannot answer),
files_before_compaction, files_after_compaction.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1]))

from benchmarks.common import print_rows, write_results  # noqa: E402
from marsrl_core.store import CATALOG, RewardRow, SampleRow, SegmentRow, SegmentStore  # noqa: E402

RUN = "bench"
TOKENS = 2000


def samples_and_segments(prefix: str, n: int, tokens: int, group: int, rng):
    samples = [
        SampleRow(f"{prefix}{i}", f"p{i // group}", "solver", 0, f"{prefix}g{i // group}", group, [1, 2, 3])
        for i in range(n)
    ]
    segments = [
        SegmentRow(
            s.sample_id,
            0,
            rng.integers(0, 32000, tokens, dtype=np.int32),
            -rng.random(tokens, dtype=np.float32),
            0,
            "stop",
        )
        for s in samples
    ]
    return samples, segments


def main() -> None:
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        store = SegmentStore(f"sqlite:{tmp}/lake.sqlite", f"{tmp}/data")

        # Bulk path: the store API, 1,000 segments x 2,000 tokens per append, 3 appends.
        bulk_tokens, bulk_s = 0, 0.0
        for k in range(3):
            samples, segments = samples_and_segments(f"b{k}-", 1000, TOKENS, 8, rng)
            store.append(RUN, samples=samples)
            start = time.perf_counter()
            store.append(RUN, segments=segments)
            bulk_s += time.perf_counter() - start
            bulk_tokens += 1000 * TOKENS

        # Row-by-row: one INSERT per segment with Python lists bound as parameters.
        samples, segments = samples_and_segments("r-", 10, TOKENS, 8, rng)
        store.append(RUN, samples=samples)
        con = store._con
        start = time.perf_counter()
        for s in segments:
            con.execute(
                f"INSERT INTO {CATALOG}.segments VALUES (?, ?, ?, ?, ?, ?, ?, current_timestamp)",
                [RUN, s.sample_id, 0, s.token_ids.tolist(), s.logprobs.tolist(), 0, "stop"],
            )
        rowwise_s = time.perf_counter() - start
        rowwise_tokens = 10 * TOKENS

        # 100K samples (tiny segments), all rewarded, a tenth consumed; time "list trainable groups".
        for k in range(10):
            samples, segments = samples_and_segments(f"L{k}-", 10_000, 4, 8, rng)
            store.append(
                RUN, samples=samples, segments=segments, rewards=[RewardRow(s.sample_id, 1.0, True) for s in samples]
            )
        consumed = [f"L0-{i}" for i in range(10_000)]
        store.commit_step(RUN, 1, {"solver": consumed}, "ckpt/1")
        start = time.perf_counter()
        groups = store.trainable_groups(RUN, "solver", limit=64)  # the run's first poll reads its index
        load_ms = (time.perf_counter() - start) * 1000
        timings = []
        for _ in range(7):
            start = time.perf_counter()
            groups = store.trainable_groups(RUN, "solver", limit=64)
            timings.append((time.perf_counter() - start) * 1000)
        list_ms = statistics.median(timings)
        samples_total = store.count("samples", RUN)
        assert len(groups) == 64

        # The poll after another process's stage: the index reads back what that commit inserted.
        other, caught_up_ms = SegmentStore(f"sqlite:{tmp}/lake.sqlite", f"{tmp}/data"), []
        for k in range(7):
            samples, segments = samples_and_segments(f"O{k}-", 16, 32, 8, rng)
            other.append(
                RUN, samples=samples, segments=segments, rewards=[RewardRow(s.sample_id, 1.0) for s in samples]
            )
            start = time.perf_counter()
            store.trainable_groups(RUN, "solver", limit=64)
            caught_up_ms.append((time.perf_counter() - start) * 1000)
        other.close()
        assert store.indexes.loads == 1

        # A rollout stage's append at that size, and its key check (`append` writes no stored key twice).
        append_ms, check_ms = [], []
        for k in range(7):
            samples, segments = samples_and_segments(f"S{k}-", 16, 32, 8, rng)
            rewards = [RewardRow(s.sample_id, 1.0, True) for s in samples]
            keys = {
                "samples": [s.sample_id for s in samples],
                "segments": [f"{s.sample_id}#0" for s in samples],
                "rewards": [s.sample_id for s in samples],
            }
            start = time.perf_counter()  # the check in SQL (what a write asks when the index cannot answer)
            store._transaction(lambda con, keys=keys: store._stored_keys(con, RUN, keys))
            check_ms.append((time.perf_counter() - start) * 1000)
            start = time.perf_counter()
            assert store.append(RUN, samples=samples, segments=segments, rewards=rewards).written
            append_ms.append((time.perf_counter() - start) * 1000)

        # Many small appends, then compaction.
        for k in range(30):
            samples, segments = samples_and_segments(f"c{k}-", 16, 32, 8, rng)
            store.append(RUN, samples=samples, segments=segments)
        compaction = store.compact()

    bulk_tps, row_tps = bulk_tokens / bulk_s, rowwise_tokens / rowwise_s
    print_rows(
        "segment store",
        ["measure", "value"],
        [
            ["bulk write tokens/s (store API, Arrow)", bulk_tps],
            ["row-by-row tokens/s (bound list params)", row_tps],
            ["bulk / row-by-row", bulk_tps / row_tps],
            [f"the run's index read in full, {samples_total:,} samples (ms)", load_ms],
            ["list trainable groups at that size (median ms)", list_ms],
            ["  after another process's stage (median ms)", statistics.median(caught_up_ms)],
            ["a stage's append at that size (median ms)", statistics.median(append_ms)],
            ["its stored-key check in SQL, when the index cannot answer (median ms)", statistics.median(check_ms)],
            ["data files before compaction", compaction["files_before"]],
            ["data files after compaction", compaction["files_after"]],
        ],
    )
    path = write_results(
        "store",
        {
            "bulk_tokens_per_s": bulk_tps,
            "rowwise_tokens_per_s": row_tps,
            "bulk_over_rowwise": bulk_tps / row_tps,
            "index_load_ms_100k": load_ms,
            "list_trainable_ms_100k": list_ms,
            "list_trainable_after_other_commit_ms_100k": statistics.median(caught_up_ms),
            "samples_stored": samples_total,
            "stage_append_ms_100k": statistics.median(append_ms),
            "append_key_check_ms_100k": statistics.median(check_ms),
            "files_before_compaction": compaction["files_before"],
            "files_after_compaction": compaction["files_after"],
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
