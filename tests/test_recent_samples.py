"""The samples a process stored, kept in memory for its learner: the same as the store rebuilds them."""

from __future__ import annotations

import numpy as np
import pytest

from marsrl_core.store import RewardRow, SampleRow, SegmentRow, SegmentStore, StoreError
from marsrl_core.store.recent import RecentSamples, RecentStore

RUN = "run-1"


def _sample(sid, group="g", prompt=(7, 8, 9)):
    return SampleRow(sid, "p1", "solver", 0, group, 4, list(prompt))


def _same(a, b):
    """Two `StoredSample`s equal field by field, arrays in value and dtype."""
    for name in ("prompt_tokens", "token_ids", "logprobs", "versions"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    for name in ("sample_id", "agent", "group_id", "finish_reason", "reward", "parsed", "num_segments"):
        assert getattr(a, name) == getattr(b, name), name


@pytest.fixture
def stores(tmp_path):
    store = SegmentStore(f"sqlite:{tmp_path}/c.sqlite", str(tmp_path / "data"))
    yield store, RecentStore(store, RecentSamples(max_bytes=2**20))
    store.close()


def test_a_sample_comes_from_memory_exactly_as_the_store_rebuilds_it(stores):
    store, recent = stores
    rng = np.random.default_rng(0)
    recent.append(RUN, samples=[_sample(f"s{i}") for i in range(4)])
    # s0: three segments over two versions; s1: one, cut by its budget; s2: decoding; s3: finished, no reward yet
    recent.append(
        RUN,
        segments=[
            SegmentRow("s0", 0, rng.integers(0, 50, 5), rng.normal(size=5), 0, "length"),
            SegmentRow("s1", 0, [3, 4], [-0.123456789, -2.5], 0, "budget"),
            SegmentRow("s2", 0, [1], [-0.1], 0, "length"),
            SegmentRow("s3", 0, [9], [-0.3], 0, "stop"),
        ],
        rewards=[RewardRow("s1", 0.1, False, "truncated", None)],
    )
    recent.append(RUN, segments=[SegmentRow("s0", 1, rng.integers(0, 50, 5), rng.normal(size=5), 1, "length")])
    recent.append(
        RUN,
        segments=[SegmentRow("s0", 2, [11], np.array([-1.0 / 3]), 1, "stop")],
        rewards=[RewardRow("s0", 1.0 / 3, True, "ok", "42")],
    )
    held = recent.recent.take(RUN, ["s0", "s1", "s2", "s3"])
    assert sorted(held) == ["s0", "s1"]  # s2 is decoding, s3 has no reward: not whole in memory
    from_store = store.load_samples(RUN, ["s0", "s1"])
    for sid in ("s0", "s1"):
        _same(held[sid], from_store[sid])
    assert from_store["s0"].num_segments == 3 and from_store["s0"].versions.tolist() == [0] * 5 + [1] * 6
    recent.append(RUN, rewards=[RewardRow("s3", 0.0, False)])
    loaded = recent.load_samples(RUN, ["s3", "s1", "s0"])  # s3 and the others from memory
    for sid, sample in store.load_samples(RUN, ["s3", "s1", "s0"]).items():
        _same(loaded[sid], sample)
    assert (recent.recent.served, recent.recent.fetched) == (3, 0)


def test_what_memory_lacks_is_read_from_the_store_and_a_commit_forgets_what_it_consumed(stores, tmp_path):
    store, recent = stores
    store.append(RUN, samples=[_sample("old")])  # stored before this process kept anything
    recent.append(RUN, samples=[_sample("new")])
    rows = [SegmentRow(s, 0, [5], [-0.5], 0, "stop") for s in ("old", "new")]
    recent.append(RUN, segments=rows, rewards=[RewardRow(s, 1.0, True) for s in ("old", "new")])
    assert sorted(recent.recent.take(RUN, ["old", "new"])) == ["new"]
    loaded = recent.load_samples(RUN, ["old", "new"])
    assert sorted(loaded) == ["new", "old"] and (recent.recent.served, recent.recent.fetched) == (1, 1)
    with pytest.raises(StoreError, match="unknown sample id"):  # what neither holds is the store's error
        recent.load_samples(RUN, ["new", "nowhere"])
    recent.commit_step(RUN, 1, {"solver": ["new"]}, str(tmp_path / "v1"), dropped={"solver": ["old"]})
    assert len(recent.recent) == 0 and recent.recent.nbytes == 0
    assert store.latest_version(RUN)[0] == 1  # the commit itself went to the store
    _same(recent.load_samples(RUN, ["new"])["new"], store.load_samples(RUN, ["new"])["new"])


def test_a_write_the_store_refused_is_not_kept_and_memory_stays_within_its_size(stores):
    store, recent = stores
    recent.append(RUN, samples=[_sample("a")])
    refused = recent.append(RUN, samples=[_sample("a"), _sample("b")])  # "a" is stored: nothing is written
    assert not refused.written and recent.recent.take(RUN, ["b"]) == {}
    small = RecentStore(store, RecentSamples(max_bytes=2000))
    ids = [f"x{i}" for i in range(8)]
    small.append(RUN, samples=[_sample(s, prompt=range(20)) for s in ids])  # 160 bytes of prompt each
    small.append(
        RUN,
        segments=[SegmentRow(s, 0, list(range(30)), [-0.5] * 30, 0, "stop") for s in ids],  # 360 bytes each
        rewards=[RewardRow(s, 1.0, True) for s in ids],
    )
    assert small.recent.nbytes <= 2000 and 0 < len(small.recent) < len(ids)
    kept = sorted(small.recent.take(RUN, ids))
    assert kept == ids[-len(kept) :]  # the newest are kept
    assert sorted(small.load_samples(RUN, ids)) == ids  # the others come from the store
