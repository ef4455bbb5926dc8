"""Returning the allocator's free memory to the OS: measured on this process's resident memory."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from marsrl_core.config import default_config
from marsrl_core.runtime import work
from marsrl_core.runtime.context import runtime
from marsrl_core.runtime.memory import MemoryTrimmer

FRAGMENT_AND_TRIM = """
import sys, time
from marsrl_core.runtime.memory import trim
assert "duckdb" not in sys.modules  # DuckDB's own allocator thread calls malloc_trim too

def rss_mb():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20

# 300 MB in 1 KB blocks (malloc, not Python's small-object allocator); keep every 64th: the freed
# blocks lie between live ones, where glibc does not give them back by itself
blocks = [bytes(1024) for _ in range(300 * 1024)]
kept = blocks[::64]
del blocks
freed = rss_mb()
time.sleep(0.5)
idle = rss_mb()
print(freed, idle, trim(), rss_mb(), len(kept))
"""


def test_trim_returns_freed_pages_between_live_blocks():
    """In a fresh interpreter (no DuckDB, which trims on its own): freed memory stays resident until
    `trim()`, which gives most of it back."""
    out = subprocess.run([sys.executable, "-c", FRAGMENT_AND_TRIM], capture_output=True, text=True, check=True)
    freed, idle, trimmed, after, kept = out.stdout.split()
    assert trimmed == "True" and int(kept) == 300 * 1024 // 64  # glibc
    assert float(idle) > float(freed) - 20, "freed memory went back without a trim"
    returned = float(idle) - float(after)
    assert returned > 150, f"trim returned {returned:.0f} MB of the ~295 MB freed"


def test_trimmer_thread_trims_until_stopped():
    trimmer = MemoryTrimmer(0.02)
    deadline = time.monotonic() + 10
    while trimmer.trims < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    trimmer.stop()
    assert trimmer.trims >= 3
    stopped_at = trimmer.trims
    time.sleep(0.1)
    assert trimmer.trims == stopped_at
    with pytest.raises(ValueError, match="every_s=0 must be > 0"):
        MemoryTrimmer(0)


def test_a_worker_process_starts_one_trimmer_with_its_store(tmp_path):
    cfg = default_config()
    cfg.store.catalog_url, cfg.store.data_path = f"sqlite:{tmp_path}/lake.sqlite", str(tmp_path / "data")
    cfg.store.separate_process = False
    runtime().store(cfg)
    runtime().store(cfg)
    trimmers = [t for t in threading.enumerate() if t.name == "marsrl-memory-trimmer"]
    assert len(trimmers) == 1 and trimmers[0].is_alive()


def test_a_batchs_samples_are_freed_when_its_flow_is_done_with_it(tmp_path):
    """Freed by reference counting once the decode loop lets go of the batch, not left for a full
    garbage-collector pass: between two such passes a rollout worker would hold every finished batch's
    samples (a parent lists its children and each child names its parent: a reference cycle)."""
    import gc

    from marsrl_core.rollout.scheduler import Sample
    from tests.configs import small_config

    cfg = small_config(tmp_path, **{"learner.max_trained_age": "null"})  # no learner here: nothing gates
    for batch in (0, 1):
        work.record_batch(cfg, "freed", batch)
    work.start_batch(cfg, "freed", 0)
    work.end_batch(cfg, "freed", 0)  # warm-up: engine, tokenizer, store
    gc.collect()
    gc.disable()
    try:
        work.start_batch(cfg, "freed", 1)
        assert work.end_batch(cfg, "freed", 1)
        deadline, alive = time.monotonic() + 30, None
        while alive != 0 and time.monotonic() < deadline:  # the loop lets go at its next stage boundary
            time.sleep(0.1)
            alive = sum(type(o) is Sample for o in gc.get_objects())
    finally:
        gc.enable()
    assert alive == 0
