"""Write-behind (`rollout.write_behind`): a stage's append runs while the next stage decodes, and the
progress the scheduler reports is what the store holds. Real store, scripted engine."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from marsrl_core.rollout.samples import RolloutBehindStore
from marsrl_core.rollout.scheduler import RolloutScheduler
from marsrl_core.store import SegmentStore
from tests.configs import assert_exactly_once
from tests.scripted import ScriptedEngine
from tests.test_rollout import ROLES, RUN, _cfg, _problems, _script


class SlowAppends(SegmentStore):
    """A store whose appends take `delay_s` longer (a store process under load), and which tells whether
    one is running."""

    delay_s = 0.05

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.appending = threading.Event()

    def append(self, *args, **kwargs):
        self.appending.set()
        try:
            time.sleep(self.delay_s)
            return super().append(*args, **kwargs)
        finally:
            self.appending.clear()


def _scheduler(cfg, store, engine, problems, **kw):
    ids = itertools.count()
    sched = RolloutScheduler(
        cfg, store, RUN, engine, engine.tokenizer, ROLES, (), new_group_id=lambda: f"g{next(ids)}", **kw
    )
    sched.add_problems(problems, batch=0, resume=False)
    return sched


def _rows(store):
    return {
        table: sorted(map(tuple, map(dict.values, store.query(sql).to_pylist())))
        for table, sql in {
            "samples": "SELECT sample_id, problem_id, agent, turn, group_id, parent_sample_id FROM samples",
            "segments": "SELECT sample_id, segment_index, token_ids, finish_reason FROM segments",
            "rewards": "SELECT sample_id, reward, parsed FROM rewards",
        }.items()
    }


def test_write_behind_stores_what_stage_by_stage_appends_store(tmp_path):
    stored = {}
    for write_behind in (False, True):
        cfg = _cfg(tmp_path / str(write_behind), segment_tokens=6)
        store = SegmentStore.from_config(cfg.store)
        sched = _scheduler(cfg, store, ScriptedEngine(_script()), _problems(3), write_behind=write_behind)
        sched.run()
        assert sched.finished() and not (write_behind and sched.writer.pending)
        assert_exactly_once(store, RUN)
        stored[write_behind] = _rows(store)
    assert stored[True] == stored[False]
    assert len(stored[True]["samples"]) == 3 * (4 + 4 * 2 * 3)  # every turn of every problem ran


@pytest.mark.parametrize("write_behind", [False, True])
def test_a_stage_decodes_while_the_last_stage_append_is_stored(tmp_path, write_behind):
    cfg = _cfg(tmp_path, max_turns=2, segment_tokens=4)
    store = SlowAppends.from_config(cfg.store)
    during_append = []
    engine = ScriptedEngine(_script(), before_decode=lambda: during_append.append(store.appending.is_set()))
    sched = _scheduler(cfg, store, engine, _problems(2), write_behind=write_behind)
    sched.run()
    assert len(during_append) > 5
    # Stage by stage, each decode starts after the last append returned; write-behind decodes beside it.
    assert any(during_append) == write_behind
    assert_exactly_once(store, RUN)


def test_progress_reports_only_what_the_store_holds(tmp_path):
    cfg = _cfg(tmp_path, max_turns=3, segment_tokens=4)
    store = SlowAppends.from_config(cfg.store)
    sched = _scheduler(cfg, store, ScriptedEngine(_script()), _problems(2), write_behind=True)
    lagged = False
    while not sched.finished():
        sched.stage()
        reported, live = sched.batch_progress(0), sched._live_progress(0)
        stored_rewards = store.count("rewards", RUN)
        assert sum(reported.finished.values()) <= stored_rewards  # finished: its reward is stored
        assert not reported.ended or store.count("samples", RUN) == stored_rewards
        lagged |= sum(live.finished.values()) > sum(reported.finished.values())
    assert lagged  # the live state was ahead of the store while an append was in flight
    assert sched.batch_progress(0).ended and sched.batch_progress(0) == sched._live_progress(0)


def test_an_append_that_finds_its_rows_stored_fails_the_next_stage_and_writes_nothing(tmp_path):
    """A scheduler behind the store (its state misses a stored segment) decodes that segment again; its
    append, in the writer's thread, writes nothing; the next stage raises, and a scheduler resumed
    from the store finishes the run exactly once."""
    cfg = _cfg(tmp_path, max_turns=2, segment_tokens=3)
    store = SegmentStore.from_config(cfg.store)
    engine = ScriptedEngine(lambda p: "Answer: 12345" if p.startswith("S|") else "Correctness: Correct")
    problems = _problems(1)
    first = _scheduler(cfg, store, engine, problems, write_behind=True)
    for _ in range(3):
        first.stage()
    first.release()  # lets its append land
    stored = {table: store.count(table, RUN) for table in ("samples", "segments", "rewards")}

    behind = RolloutScheduler(cfg, store, RUN, engine, engine.tokenizer, ROLES, (), write_behind=True)
    behind.resume({p.problem_id: p for p in problems})
    solver = next(s for s in behind.in_flight() if s.segments > 0)
    solver.token_ids, solver.versions = solver.token_ids[:-3], solver.versions[:-3]  # one stored segment missed
    solver.segments -= 1
    again = f"segments {solver.sample_id}#{solver.segments}"
    behind.stage()  # decodes the stored segment again; its append fails in the writer's thread
    with pytest.raises(RolloutBehindStore, match=again):
        behind.stage()
    assert {table: store.count(table, RUN) for table in stored} == stored

    retry = RolloutScheduler(cfg, store, RUN, engine, engine.tokenizer, ROLES, (), write_behind=True)
    retry.resume({p.problem_id: p for p in problems})
    retry.run()
    assert_exactly_once(store, RUN)
    assert store.count("rewards", RUN) == store.count("samples", RUN) > stored["rewards"]
