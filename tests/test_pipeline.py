"""The agentic pipeline: streaming within a batch (a problem's next agent starts when its own inputs
exist), the decode loop that every batch feeds, and the admission gate that paces the rollouts to the
learner. Scripted outputs with chosen lengths, a real DuckLake store."""

from __future__ import annotations

import threading
import time

import pytest

from marsrl_core.agents.problems import Problem
from marsrl_core.agents.roles import TINY_TEMPLATES, Roles
from marsrl_core.config import AGENTS
from marsrl_core.rollout.gate import AdmissionGate
from marsrl_core.rollout.loop import RolloutLoop
from marsrl_core.rollout.scheduler import RolloutScheduler
from marsrl_core.rollout.weights import WeightChannel
from marsrl_core.store import SegmentStore
from tests.configs import assert_exactly_once, rollout_config
from tests.scripted import ScriptedEngine

ROLES = Roles.from_config(base=TINY_TEMPLATES)
RUN = "pipe"


ROLLOUT = {  # two samples a group, one downstream input, 16-token segments, two turns
    **{"num_generations": 2, "downstream_generations": 2, "select_inputs": 1, "segment_tokens": 16},
    **dict.fromkeys(("solver_max_tokens", "verifier_max_tokens", "corrector_max_tokens"), 64),
    **{"problems_per_batch": 2, "max_turns": 2, "explore": 0.0},
}


def _cfg(tmp_path, **rollout):
    return rollout_config(tmp_path, ROLLOUT, **rollout)


def _lengths_script(long_problem: str):
    """Solvers of `long_problem` write 45 characters and an end token (3 segments of 16), the others 9
    (one segment); Verifiers flag every solution in two segments."""

    def script(prompt: str) -> str:
        role, problem = prompt.split("|")[:2]
        if role == "S":
            return "Answer: 1" if problem != long_problem else "thinking " * 4 + "Answer: 1"
        return "Correctness: Wrong"

    return script


def _problems(n, batch="b0"):
    return [Problem(f"{batch}-{i}", f"{i}+0", str(i)) for i in range(n)]


@pytest.mark.parametrize("barrier", [False, True])
def test_a_problems_verifier_decodes_while_another_problems_solver_is_still_going(tmp_path, barrier):
    """Batch of two: problem 0's Solvers finish in the first stage, problem 1's need three. Streaming,
    problem 0's Verifiers decode from the second stage on, beside problem 1's Solvers; with the turn
    barrier (the rule the simulator compares against) they wait for problem 1's Solvers."""
    cfg = _cfg(tmp_path)
    store = SegmentStore.from_config(cfg.store)
    engine = ScriptedEngine(_lengths_script("1+0"))
    scheduler = RolloutScheduler(cfg, store, RUN, engine, engine.tokenizer, ROLES, turn_barrier=barrier)
    scheduler.add_problems(_problems(2), batch=0)
    overlapped_at = None
    for stage in range(1, 12):
        scheduler.stage()
        p0, p1 = scheduler.states["b0-0"], scheduler.states["b0-1"]
        verifier_decoding = any(s.token_ids for s in p0.turns.get(1, []))
        long_solver_going = any(s.finish is None for s in p1.turns[0])
        progress = scheduler.batch_progress(0)
        if verifier_decoding and long_solver_going and overlapped_at is None:
            overlapped_at = stage
            assert progress.started(1) and not progress.final(0)
        if scheduler.finished():
            break
    assert scheduler.finished()
    assert (overlapped_at is None) == barrier
    if not barrier:
        assert overlapped_at == 2  # the first stage boundary after its own inputs were complete
    assert_exactly_once(store, RUN)


def test_the_decode_loop_decodes_batches_together_and_reports_each_turn(tmp_path):
    """Two batches join one loop: their samples decode in the same stages (one engine batch), a turn's
    waiter wakes when its batch's turn has started and again when it has finished, and a batch that
    has ended can be forgotten."""
    cfg = _cfg(tmp_path, batches_in_flight=2)
    store = SegmentStore.from_config(cfg.store)
    engine = ScriptedEngine(_lengths_script("1+0"))
    calls = []
    decode = engine.decode_segment

    def counting(requests):
        calls.append({engine.tokenizer.decode(list(r.prompt_ids)).split("|")[1] for r in requests})
        return decode(requests)

    engine.decode_segment = counting
    loop = RolloutLoop(lambda: RolloutScheduler(cfg, store, RUN, engine, engine.tokenizer, ROLES))
    loop.add_batch(0, _problems(2, "b0"))
    loop.add_batch(1, _problems(2, "b1"))
    assert loop.wait(0, lambda p: p.started(1), timeout_s=60).started(1)
    for batch in (0, 1):
        progress = loop.wait(batch, lambda p: p.ended, timeout_s=60)
        assert progress.complete and progress.final(0) and progress.final(1)
        assert progress.samples[0] == 4 and progress.finished[1] == progress.samples[1] == 4
        loop.forget_batch(batch)
    # Problems of both batches (both have a "1+0") in one engine call: one batch of segments.
    assert any(len(problems) >= 2 for problems in calls) and loop.decode_batch_sizes
    assert max(loop.decode_batch_sizes) > 4
    loop.close()
    assert_exactly_once(store, RUN)
    # Problem b0-0's Verifiers decoded while b0-1's Solvers were still going (stage commit times).
    first_verifier, last_solver = (
        store.query(
            """SELECT min(g.created_at) FILTER (WHERE s.agent = 'verifier' AND s.problem_id = 'b0-0'),
                  max(g.created_at) FILTER (WHERE s.agent = 'solver' AND s.problem_id = 'b0-1')
           FROM segments g JOIN samples s USING (run_id, sample_id)"""
        )
        .to_pylist()[0]
        .values()
    )
    assert first_verifier < last_solver


def test_a_failed_stage_resumes_from_the_store_and_repeated_failures_reach_the_waiters(tmp_path):
    cfg = _cfg(tmp_path)
    store = SegmentStore.from_config(cfg.store)
    engine = ScriptedEngine(_lengths_script("1+0"))
    decode, failures = engine.decode_segment, {"left": 1}

    def flaky(requests):
        if failures["left"] and any(r.prefix_ids for r in requests):  # mid-sample, after a stage stored
            failures["left"] -= 1
            raise RuntimeError("engine went away")
        return decode(requests)

    engine.decode_segment = flaky
    loop = RolloutLoop(lambda: RolloutScheduler(cfg, store, RUN, engine, engine.tokenizer, ROLES))
    loop.add_batch(0, _problems(2))
    assert loop.wait(0, lambda p: p.ended, timeout_s=60).complete
    assert loop.restarts == 1
    assert_exactly_once(store, RUN)
    loop.close()

    failures["left"] = 10**6
    broken = RolloutLoop(lambda: RolloutScheduler(cfg, store, "broken", engine, engine.tokenizer, ROLES))
    broken.add_batch(0, _problems(2, "c0"))
    with pytest.raises(RuntimeError, match="engine went away"):
        broken.wait(0, lambda p: p.ended, timeout_s=60)
    assert broken.restarts == broken.max_restarts and broken.ended


def test_a_stop_lets_the_samples_in_flight_finish_and_starts_no_next_turn(tmp_path):
    """Once the loop's stop condition holds (the run's learner has its steps), a problem still decoding
    finishes the samples it has started but starts no next turn: its batch ends cut short, every
    stored sample has its reward, and a problem not admitted yet never starts."""
    cfg = _cfg(tmp_path, max_turns=2, problems_per_batch=1, batches_in_flight=1)
    store = SegmentStore.from_config(cfg.store)
    engine = ScriptedEngine(_lengths_script("0+0"))  # b0-0's Solvers need three segments
    loop = RolloutLoop(lambda: RolloutScheduler(cfg, store, RUN, engine, engine.tokenizer, ROLES), stop_check_s=0.0)
    loop.stop_when(lambda: loop.stages >= 1)
    loop.add_batch(0, _problems(2))  # b0-1 waits: one problem in flight at a time
    progress = loop.wait(0, lambda p: p.ended, timeout_s=60)
    assert not progress.complete and progress.samples[0] == progress.finished[0] == 2
    assert progress.samples[1] == 0  # no Verifier group started after the stop
    rows = store.query("SELECT s.problem_id FROM segments g JOIN samples s USING (run_id, sample_id)").to_pylist()
    assert [r["problem_id"] for r in rows] == ["b0-0"] * 6  # each Solver sample's three segments
    assert store.count("rewards", RUN) == store.count("samples", RUN) == 2
    loop.close()
    assert_exactly_once(store, RUN)


class _LateLearner:
    """A scripted learner: it starts `delay_s` late, then every `step_s` commits a step that takes up to
    its groups-per-step of the complete groups of each agent that the learner's poll ranks first."""

    def __init__(self, store, cfg, delay_s: float, step_s: float, steps: int):
        self.store, self.cfg, self.delay_s, self.step_s, self.steps = store, cfg, delay_s, step_s, steps
        self.version = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        time.sleep(self.delay_s)
        per_step = self.cfg.learner.groups_per_step_by_agent()
        while self.version < self.steps:
            groups = self.store.trainable_groups_by_agent(RUN, AGENTS, limit=per_step)
            consumed = {agent: [sid for g in gs for sid in g.sample_ids] for agent, gs in groups.items() if gs}
            if consumed:
                self.version += 1
                self.store.commit_step(RUN, self.version, consumed, f"ckpt/{self.version}")
            time.sleep(self.step_s)


@pytest.mark.parametrize("gated", [True, False])
def test_the_gate_holds_a_late_learners_backlog_to_max_trained_age(tmp_path, gated):
    """The learner starts 3 s after the rollouts. Gated, the rollouts wait at eta + 1 steps' worth of
    groups, and no group is trained more than eta versions after the version it started under; without
    the gate they run ahead and the learner trains on a backlog older than that."""
    eta = 1
    cfg = _cfg(tmp_path, max_turns=1, problems_per_batch=4, batches_in_flight=2)
    cfg = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"groups_per_step": 2})})
    store = SegmentStore.from_config(cfg.store)
    engine = ScriptedEngine(lambda prompt: "Answer: 1")
    learner = _LateLearner(store, cfg, delay_s=3.0, step_s=0.3, steps=8)
    gate = AdmissionGate(store, RUN, cfg.learner.groups_per_step_by_agent(), eta, refresh_s=0.1) if gated else None
    scheduler = RolloutScheduler(
        cfg, store, RUN, engine, engine.tokenizer, ROLES, weights=WeightChannel(store, RUN), gate=gate
    )
    scheduler.add_problems(_problems(16), batch=0)
    learner.thread.start()
    deadline = time.monotonic() + 120
    while learner.thread.is_alive() and time.monotonic() < deadline:
        if scheduler.finished():
            time.sleep(0.05)
        else:
            scheduler.stage()
    learner.thread.join(timeout=10)
    assert learner.version == 8
    ages = store.query("SELECT max(staleness) AS oldest, avg(staleness) AS mean FROM staleness").to_pylist()[0]
    if gated:
        assert ages["oldest"] <= eta and scheduler.stats["gated_stages"] > 0
    else:
        assert ages["oldest"] > eta
    assert_exactly_once(store, RUN)


def test_a_commit_wakes_an_idle_decode_loop_that_the_gate_holds(tmp_path, monkeypatch):
    """The gate holds the rollouts for a learner that commits a step and calls `wake()`, as the process's
    learner does: the idle loop goes on at once. Its back-off is made ten minutes here, so a loop that
    waited it out would miss the test's one-minute deadline."""
    monkeypatch.setattr("marsrl_core.rollout.loop.MAX_IDLE_S", 600.0)
    cfg = _cfg(tmp_path, max_turns=1, problems_per_batch=8, batches_in_flight=1)
    cfg = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"groups_per_step": 2})})
    store = SegmentStore.from_config(cfg.store)
    engine = ScriptedEngine(lambda prompt: "Answer: 1")
    gate = AdmissionGate(store, RUN, cfg.learner.groups_per_step_by_agent(), 0, refresh_s=600.0)
    loop = RolloutLoop(
        lambda: RolloutScheduler(
            cfg, store, RUN, engine, engine.tokenizer, ROLES, weights=WeightChannel(store, RUN), gate=gate
        ),
        idle_s=600.0,
    )
    done, version = threading.Event(), 0
    loop.add_batch(0, _problems(8))

    def learner():
        nonlocal version
        while not done.is_set():
            groups = store.trainable_groups_by_agent(RUN, AGENTS, limit=cfg.learner.groups_per_step_by_agent())
            if ids := {agent: [s for g in gs for s in g.sample_ids] for agent, gs in groups.items() if gs}:
                version += 1
                store.commit_step(RUN, version, ids, f"ckpt/{version}")
                loop.wake()
            time.sleep(0.2)

    thread = threading.Thread(target=learner, daemon=True)
    thread.start()
    try:
        assert loop.wait(0, lambda p: p.ended, timeout_s=60).complete
    finally:
        done.set()
        thread.join(timeout=10)
        loop.close()
    assert gate.closed_reads > 0 and version >= 3  # the gate held the loop between steps
    assert_exactly_once(store, RUN)


def test_a_learner_being_built_leaves_the_processs_store_engines_and_decode_loop_serving(tmp_path, monkeypatch):
    """A new run's learner builds beside its first rollouts (`flows/train.py`): while the build is held
    inside its resume, another thread gets the process's store, its loaded engines and the run's decode
    loop (a model load waits for the build: they take turns)."""
    from marsrl_core.learn.learner import Learner
    from marsrl_core.runtime import work
    from marsrl_core.runtime.context import runtime
    from tests.configs import small_config

    cfg, rt = small_config(tmp_path), runtime()
    inside, release = threading.Event(), threading.Event()
    resume = Learner.resume

    def held_resume(self):
        inside.set()
        assert release.wait(120)
        return resume(self)

    monkeypatch.setattr(Learner, "resume", held_resume)
    engines = rt.engines(cfg)
    builder = threading.Thread(target=rt.learner, args=(cfg, RUN))
    builder.start()
    try:
        assert inside.wait(120), "the learner's build never reached its resume"
        served = {}

        def serve():
            served["latest"] = rt.store(cfg).latest_version(RUN)
            served["engine"] = rt.engines(cfg)
            served["loop"] = work.rollout_loop(cfg, RUN)

        other = threading.Thread(target=serve)
        other.start()
        other.join(120)
        assert not other.is_alive(), "the process's services waited for the learner's build"
        assert served["latest"] is None and served["engine"] is engines and not served["loop"].ended
        assert builder.is_alive()  # still held inside its resume
    finally:
        release.set()
        builder.join(120)
    assert rt.learner(cfg, RUN).step == 0  # built once, resumed from nothing
