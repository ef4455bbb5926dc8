"""Worker processes for the store's multi-process tests (run as scripts, not collected by pytest).

writer CATALOG DATA RUN SECONDS   append samples + segments + rewards; print the running totals
reader CATALOG DATA RUN SECONDS   read the views and commit consumptions of trainable groups
stager CATALOG DATA RUN SECONDS   append one small stage at a time (a few rows, as a rollout stage writes)
counter CATALOG DATA RUN SECONDS  count the rows of the appended tables again and again; print how often a
                                  count went down (rows already read that a later read missed)
killme CATALOG DATA RUN           append big batches forever, announcing each one on stdout
open CATALOG DATA RUN AT          open the store (creating it if new) at time AT, print a row count
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from marsrl_core.store import RewardRow, SampleRow, SegmentRow, SegmentStore

GROUP = 4


def batch(tag: str, groups: int, tokens: int, rng: np.random.Generator):
    samples, segments, rewards = [], [], []
    for g in range(groups):
        for m in range(GROUP):
            sid = f"{tag}-g{g}-m{m}"
            samples.append(SampleRow(sid, f"p{g}", "solver", 0, f"{tag}-g{g}", GROUP, [1, 2, 3]))
            segments.append(
                SegmentRow(sid, 0, rng.integers(0, 100, tokens), -rng.random(tokens).astype(np.float32), 0, "stop")
            )
            rewards.append(RewardRow(sid, float(m % 2), bool(m % 2)))
    return samples, segments, rewards


def writer(store: SegmentStore, run: str, seconds: float) -> None:
    rng = np.random.default_rng(0)
    total_segments = k = 0
    end = time.time() + seconds
    while time.time() < end:
        samples, segments, rewards = batch(f"w{k}", 4, 64, rng)
        store.append(run, samples, segments, rewards)
        total_segments += len(segments)
        k += 1
        print(json.dumps({"segments": total_segments, "lock_retries": store.lock_retries}), flush=True)


def reader(store: SegmentStore, run: str, seconds: float) -> None:
    consumed = step = 0
    end = time.time() + seconds
    while time.time() < end:
        assert store.query("SELECT * FROM rewards_per_agent").num_rows >= 0  # the views answer while written
        assert store.query("SELECT count(*) FROM in_flight_decodes").num_rows == 1
        groups = store.trainable_groups(run, "solver", limit=3)
        if not groups:
            time.sleep(0.05)
            continue
        step += 1
        ids = [sid for g in groups for sid in g.sample_ids]
        store.commit_step(run, step, {"solver": ids}, f"ckpt/{step}")
        consumed += len(ids)
        print(json.dumps({"consumed": consumed, "steps": step, "lock_retries": store.lock_retries}), flush=True)


def stager(store: SegmentStore, run: str, seconds: float) -> None:
    rng = np.random.default_rng(2)
    k = 0
    end = time.time() + seconds
    while time.time() < end:
        sid = f"st{k}"
        tokens = rng.integers(0, 100, 16)
        store.append(
            run,
            [SampleRow(sid, f"p{k}", "verifier", 1, f"g{k}", 1, [1, 2])],
            [SegmentRow(sid, 0, tokens, -rng.random(16).astype(np.float32), 0, "stop")],
            [RewardRow(sid, 1.0, True)],
        )
        k += 1
    print(json.dumps({"stages": k}), flush=True)


def counter(store: SegmentStore, run: str, seconds: float) -> None:
    last = dict.fromkeys(("samples", "segments", "rewards"), 0)
    decreases, reads = [], 0
    end = time.time() + seconds
    while time.time() < end:
        for table in last:
            n = store.count(table, run)
            if n < last[table]:
                decreases.append(f"{table} {last[table]} -> {n}")
            last[table] = max(n, last[table])
            reads += 1
    print(json.dumps({"reads": reads, "decreases": decreases}), flush=True)


def marker(store: SegmentStore, run: str, count: int) -> None:
    """Record `count` events of this process; print the store's lock retries."""
    for k in range(count):
        store.mark(run, f"m{os.getpid()}-{k}")
    print(json.dumps({"lock_retries": store.lock_retries}), flush=True)


def killme(store: SegmentStore, run: str) -> None:
    rng = np.random.default_rng(1)
    k = 0
    while True:
        samples, segments, rewards = batch(f"k{os.getpid()}x{k}", 50, 2000, rng)
        print(f"begin {k}", flush=True)
        store.append(run, samples, segments, rewards)
        print(f"done {k}", flush=True)
        k += 1


if __name__ == "__main__":
    role, catalog, data, run = sys.argv[1:5]
    if role == "open":  # open (creating it if new) at the given time.time(), then count a table
        while time.time() < float(sys.argv[5]):
            pass
        print(SegmentStore(catalog, data).count("samples"), flush=True)
        sys.exit(0)
    s = SegmentStore(catalog, data)
    if role == "writer":
        writer(s, run, float(sys.argv[5]))
    elif role == "reader":
        reader(s, run, float(sys.argv[5]))
    elif role == "stager":
        stager(s, run, float(sys.argv[5]))
    elif role == "marker":  # from the given time.time() on
        while time.time() < float(sys.argv[5]):
            time.sleep(0.01)
        marker(s, run, int(sys.argv[6]))
    elif role == "counter":
        counter(s, run, float(sys.argv[5]))
    else:
        killme(s, run)
