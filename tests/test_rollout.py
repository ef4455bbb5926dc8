"""The rollout scheduler: groups and selection, segments across versions, staleness, pipelining,
shared rewards and resume. Scripted outputs where the test must choose them, the tiny model elsewhere."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from marsrl_core.agents.problems import Problem
from marsrl_core.agents.roles import TINY_TEMPLATES, Roles
from marsrl_core.agents.selection import select_inputs
from marsrl_core.demo.tiny import build_tiny_model
from marsrl_core.engines.hf import HFEngine, load_safetensors_state
from marsrl_core.rollout.scheduler import RolloutScheduler
from marsrl_core.store import SegmentStore
from tests.configs import rollout_config
from tests.scripted import ScriptedEngine

ROLES = Roles.from_config(base=TINY_TEMPLATES)
RUN = "roll"


ROLLOUT = {
    "num_generations": 4,
    "downstream_generations": 3,
    "select_inputs": 2,
    "segment_tokens": 4,
    "solver_max_tokens": 40,
    "verifier_max_tokens": 40,
    "corrector_max_tokens": 40,
    "problems_per_batch": 2,
    "explore": 0.0,
}


def _cfg(tmp_path, **rollout):
    return rollout_config(tmp_path, ROLLOUT, **rollout)


def _problems(n):
    return [Problem(f"p{i}", f"{i}+1", str((i + 1) % 10)) for i in range(n)]


def _script():
    """Solvers alternate right/wrong; Verifiers alternate Wrong/Correct; Correctors fix."""
    solver, verifier = itertools.count(), itertools.count()

    def script(prompt):
        role, problem = prompt.split("|")[:2]
        right = str((int(problem.split("+")[0]) + 1) % 10)
        if role == "S":
            return f"Answer: {right if next(solver) % 2 == 0 else 'x'}"
        if role == "V":
            return f"ok\nCorrectness: {'Wrong' if next(verifier) % 2 == 0 else 'Correct'}"
        return f"fixed;Answer: {right}"

    return script


def _scheduler(cfg, store, engine, problems, **kw):
    return RolloutScheduler(cfg, store, RUN, engine, engine.tokenizer, ROLES, iter(problems), **kw)


def test_group_and_selection_counts_follow_the_config(tmp_path):
    cfg = _cfg(tmp_path)
    store = SegmentStore.from_config(cfg.store)
    engine = ScriptedEngine(_script())
    _scheduler(cfg, store, engine, _problems(3)).run()
    rows = store.query("SELECT problem_id, agent, turn, group_id, group_size FROM samples").to_pylist()
    per_turn = Counter((r["problem_id"], r["turn"]) for r in rows)
    groups = Counter((r["problem_id"], r["turn"], r["group_id"]) for r in rows)
    for p in ("p0", "p1", "p2"):
        assert per_turn[(p, 0)] == 4  # one Solver group of num_generations
        for turn in (1, 2, 3, 4):
            assert per_turn[(p, turn)] == 2 * 3  # select_inputs groups of downstream_generations
    assert all(size in (3, 4) for size in groups.values())
    assert {r["agent"] for r in rows if r["turn"] in (2, 4)} == {"corrector"}
    # Every sample finished and was rewarded at once (decoupled).
    assert store.count("rewards", RUN) == store.count("samples", RUN) == len(rows)
    # Correctors only ever read Verifier outputs with a Wrong verdict.
    parents = (
        store.query("""SELECT r.parsed FROM samples c JOIN rewards r ON r.sample_id = c.parent_sample_id
                             WHERE c.agent = 'corrector'""")
        .column("parsed")
        .to_pylist()
    )
    assert parents and set(parents) == {"Wrong"}


def test_no_wrong_verdict_ends_the_branch(tmp_path):
    cfg = _cfg(tmp_path)
    store = SegmentStore.from_config(cfg.store)
    engine = ScriptedEngine(lambda p: "Correctness: Correct" if p.startswith("V|") else "Answer: 2")
    _scheduler(cfg, store, engine, _problems(1)).run()
    turns = store.query("SELECT DISTINCT turn FROM samples ORDER BY turn").column("turn").to_pylist()
    assert turns == [0, 1]


def test_adaptive_selection_prefers_incorrect_and_still_explores():
    import random

    items = [("right", i) for i in range(6)] + [("wrong", i) for i in range(2)]
    wrong = lambda c: c[0] == "wrong"  # noqa: E731
    rng = random.Random(0)
    for _ in range(50):
        picks = select_inputs(items, 2, "adaptive", wrong, rng, explore=0.0)
        assert sorted(p[0] for p in picks) == ["wrong", "wrong"]
    explored = [p for _ in range(200) for p in select_inputs(items, 2, "adaptive", wrong, rng, explore=0.5)]
    share_right = sum(p[0] == "right" for p in explored) / len(explored)
    assert 0.1 < share_right < 0.6  # exploration picks some right ones, preference keeps most wrong
    balanced = [select_inputs(items, 2, "balanced", wrong, rng) for _ in range(20)]
    assert all(sorted(p[0] for p in b) == ["right", "wrong"] for b in balanced)


def test_adaptive_verifier_inputs_are_incorrect_solutions(tmp_path):
    cfg = _cfg(tmp_path, max_turns=2)
    store = SegmentStore.from_config(cfg.store)
    _scheduler(cfg, store, ScriptedEngine(_script()), _problems(4)).run()
    judged = (
        store.query("""SELECT r.correct FROM samples v JOIN rewards r ON r.sample_id = v.parent_sample_id
                            WHERE v.agent = 'verifier'""")
        .column("correct")
        .to_pylist()
    )
    assert judged and not any(judged)  # each Solver group has 2 wrong solutions: both picked


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return build_tiny_model(root / "a", max_position_embeddings=256), build_tiny_model(
        root / "b", seed=3, max_position_embeddings=256
    )


def test_long_samples_continue_across_segments_and_versions_and_reassemble(tmp_path, tiny):
    cfg = _cfg(tmp_path, max_turns=1, segment_tokens=3, solver_max_tokens=20, max_version_span=10)
    store = SegmentStore.from_config(cfg.store)
    engine = HFEngine.from_pretrained(tiny[0])
    engine.eos_id = -1  # never stop early: every sample spans 7 segments
    sched = _scheduler(cfg, store, engine, _problems(1))
    weights = [load_safetensors_state(tiny[1]), load_safetensors_state(tiny[0])]
    for stage in range(7):
        if stage in (2, 4):
            sched.offer_weights(stage // 2, weights[stage // 2 - 1])
        sched.stage()
    assert sched.finished()
    samples = sched.states["p0"].turns[0]
    stored = store.load_samples(RUN, [s.sample_id for s in samples])
    for s in samples:
        got = stored[s.sample_id]
        assert got.token_ids.tolist() == s.token_ids and len(s.token_ids) == 20
        assert got.versions.tolist() == s.versions and set(s.versions) == {0, 1, 2}
        assert got.num_segments == 7 and got.finish_reason == "budget"
    # The behaviour log-probs reassemble as the concatenation of the per-segment rows.
    segs = (
        store.query("SELECT logprobs FROM segments WHERE sample_id = ? ORDER BY segment_index", [samples[0].sample_id])
        .column("logprobs")
        .to_pylist()
    )
    assert [x for seg in segs for x in seg] == pytest.approx(stored[samples[0].sample_id].logprobs.tolist())


def test_staleness_bound_is_never_exceeded(tmp_path, tiny):
    budgets = {"solver_max_tokens": 12, "verifier_max_tokens": 12}
    cfg = _cfg(tmp_path, max_turns=2, segment_tokens=2, max_version_span=1, problems_per_batch=2, **budgets)
    store = SegmentStore.from_config(cfg.store)
    engine = HFEngine.from_pretrained(tiny[0])
    engine.eos_id = -1
    sched = _scheduler(cfg, store, engine, _problems(4))
    weights = [load_safetensors_state(tiny[1]), load_safetensors_state(tiny[0])]
    version = 0
    while not sched.finished():
        version += 1
        sched.offer_weights(version, weights[version % 2])  # a new policy every stage
        sched.stage()
    spans = (
        store.query("""SELECT max(policy_version) - min(policy_version) AS span FROM segments
                           GROUP BY sample_id""")
        .column("span")
        .to_pylist()
    )
    assert max(spans) <= 1 and sched.stats["deferred_updates"] > 0
    assert max(store.query("SELECT policy_version FROM segments").column("policy_version").to_pylist()) > 2


def test_finished_solver_group_is_trainable_while_verifiers_decode(tmp_path):
    cfg = _cfg(tmp_path, max_turns=2, segment_tokens=2)
    store = SegmentStore.from_config(cfg.store)
    engine = ScriptedEngine(lambda p: "Answer: 1" if p.startswith("S|") else "checking every step...Correctness: Wrong")
    sched = _scheduler(cfg, store, engine, _problems(1))
    overlap = False
    while not sched.finished():
        sched.stage()
        trainable = store.trainable_groups(RUN, "solver")
        decoding = (
            store.query("SELECT count(*) AS n FROM in_flight_decodes WHERE agent = 'verifier' AND segments > 0")
            .column("n")[0]
            .as_py()
        )
        overlap |= bool(trainable) and decoding > 0
    assert overlap
    # Timestamps tell the same story: the Solver rewards committed before the Verifiers' last segments.
    row = (
        store.query("""SELECT (SELECT max(r.created_at) FROM rewards r JOIN samples s USING (sample_id)
                                 WHERE s.agent = 'solver') <
                                (SELECT max(g.created_at) FROM segments g JOIN samples s USING (sample_id)
                                 WHERE s.agent = 'verifier') AS earlier""")
        .column("earlier")[0]
        .as_py()
    )
    assert row


def test_shared_rewards_arrive_when_the_trajectory_ends(tmp_path):
    cfg = _cfg(tmp_path, reward_mode="shared", max_turns=3, segment_tokens=40)
    store = SegmentStore.from_config(cfg.store)
    sched = _scheduler(cfg, store, ScriptedEngine(_script()), _problems(1))
    sched.stage()  # Solvers finish, but their trajectories have not ended: nothing is trainable
    assert store.count("rewards", RUN) == 0 and store.trainable_groups(RUN, "solver") == []
    sched.run()
    rewards = {r["sample_id"]: r["reward"] for r in store.query("SELECT sample_id, reward FROM rewards").to_pylist()}
    state = sched.states["p0"]
    for corrector in state.turns[2]:
        assert rewards[corrector.sample_id] == 1.0  # the Corrector fixed it: the trajectory ends right
    for solver in state.turns[0]:
        if not solver.children:  # a trajectory of one turn: its own outcome
            assert rewards[solver.sample_id] == float(solver.judgement.correct)


def test_resume_continues_without_redecoding(tmp_path, tiny):
    cfg = _cfg(tmp_path, max_turns=2, segment_tokens=3, solver_max_tokens=12, verifier_max_tokens=9)
    store = SegmentStore.from_config(cfg.store)
    engine = HFEngine.from_pretrained(tiny[0])
    engine.eos_id = -1
    problems = _problems(3)
    first = _scheduler(cfg, store, engine, problems)
    for _ in range(3):
        first.stage()
    before = store.count("segments", RUN)
    del first  # the process dies; only the store remains
    second = _scheduler(cfg, store, engine, problems)  # p0, p1 were admitted before: skipped
    restored = second.resume({p.problem_id: p for p in problems})
    assert restored == store.count("samples", RUN) > 0
    second.run()
    dupes = (
        store.query(
            "SELECT count(*) AS n FROM (SELECT sample_id, segment_index FROM segments GROUP BY ALL HAVING count(*) > 1)"
        )
        .column("n")[0]
        .as_py()
    )
    assert dupes == 0 and store.count("segments", RUN) > before
    lengths = store.query("""SELECT s.agent, sum(len(g.token_ids)) AS n FROM segments g JOIN samples s USING (sample_id)
                             GROUP BY s.agent, g.sample_id""").to_pylist()
    assert all(r["n"] == (12 if r["agent"] == "solver" else 9) for r in lengths)
    assert store.count("rewards", RUN) == store.count("samples", RUN)
    assert {r["problem_id"] for r in store.query("SELECT DISTINCT problem_id FROM samples").to_pylist()} == {
        "p0",
        "p1",
        "p2",
    }


def test_a_version_offered_during_an_update_is_not_lost(tmp_path):
    cfg = _cfg(tmp_path, max_turns=1)
    store = SegmentStore.from_config(cfg.store)
    engine = ScriptedEngine(lambda p: "Answer: 1")
    sched = _scheduler(cfg, store, engine, _problems(2))
    original = engine.update_weights

    def slow_update(version, weights):  # the learner publishes v2 while v1 is being loaded
        if version == 1:
            sched.offer_weights(2, "w2")
        original(version, weights)

    engine.update_weights = slow_update
    sched.offer_weights(1, "w1")
    sched.stage()
    assert engine.policy_version == 1 and sched.pending is not None and sched.pending[0] == 2
    sched.stage()
    assert engine.policy_version == 2 and sched.pending is None


def test_the_weight_channel_brings_committed_versions_at_the_next_stage(tmp_path):
    """A `WeightChannel` is how a rollout learns of versions its learner committed, here or elsewhere:
    polled with the engines' version before every stage, a version committed in the store is loaded
    at that stage, from the weights this process's learner published when it has them, else from the
    version's checkpoint folder."""
    from marsrl_core.rollout.weights import WeightChannel

    cfg = _cfg(tmp_path, max_turns=1, solver_max_tokens=12)
    store = SegmentStore.from_config(cfg.store)
    engine = ScriptedEngine(lambda p: "thinking... Answer: 1")
    loaded: list[tuple[int, object]] = []
    original = engine.update_weights
    engine.update_weights = lambda version, weights: (loaded.append((version, weights)), original(version, weights))
    channel = WeightChannel(store, RUN)
    sched = _scheduler(cfg, store, engine, _problems(2), weights=channel)
    sched.stage()
    (tmp_path / "ckpt" / "v1" / "policy").mkdir(parents=True)  # a shared policy's checkpoint layout
    store.commit_step(RUN, 1, {}, f"{tmp_path}/ckpt/v1")  # a learner elsewhere: only its folder
    sched.stage()
    assert loaded == [(1, tmp_path / "ckpt" / "v1" / "policy")] and engine.policy_version == 1
    store.commit_step(RUN, 2, {}, f"{tmp_path}/ckpt/v2")
    channel.publish(2, {"weights": "of v2"})  # this process's learner: its weights in memory
    sched.stage()
    assert loaded[-1] == (2, {"weights": "of v2"}) and engine.policy_version == 2
    sched.stage()  # the engines hold v2: the published copy is dropped
    assert len(loaded) == 2 and channel._published is None
    # This process's learner announced v3, then a resume rolled back to v2 (v3 was weights-only and its
    # folder is gone): the channel forgets v3 and asks the store, which holds v2.
    channel.committed(3, f"{tmp_path}/ckpt/v3")
    channel.rolled_back(2)
    sched.stage()
    assert len(loaded) == 2 and engine.policy_version == 2


def test_a_turn_behind_the_store_stores_nothing_twice_and_its_retry_resumes(tmp_path, tiny):
    """The fault behind segments stored twice: a turn resumes from a read that missed a segment it had
    stored (a finished Solver sample looks one segment short). Its first stage decodes that segment
    again; the store finds the keys stored and writes nothing of the stage; the turn raises, and its
    retry resumes from the store and finishes with every invariant intact."""
    from marsrl_core.rollout.samples import RolloutBehindStore
    from tests.configs import assert_exactly_once

    cfg = _cfg(tmp_path, max_turns=2, segment_tokens=3, solver_max_tokens=12, verifier_max_tokens=9)
    store = SegmentStore.from_config(cfg.store)
    engine = HFEngine.from_pretrained(tiny[0])
    engine.eos_id = -1  # every sample runs to its budget: 4 Solver segments, 3 Verifier segments
    problems = {p.problem_id: p for p in _problems(2)}
    first = _scheduler(cfg, store, engine, list(problems.values()))
    first.stage()
    while any(s.turn == 0 for s in first.in_flight()):  # the Solvers finish; the Verifiers are created
        first.stage()
    stored = {table: store.count(table, RUN) for table in ("samples", "segments", "rewards")}

    behind = _scheduler(cfg, store, engine, [])
    behind.resume(problems)
    solver = behind.states["p0"].turns[0][0]
    assert solver.finish == "budget" and solver.segments == 4
    solver.token_ids, solver.versions = solver.token_ids[:9], solver.versions[:9]  # the missed read
    solver.segments, solver.finish, solver.judgement = 3, None, None
    with pytest.raises(RolloutBehindStore, match=rf"segments {solver.sample_id}#3"):
        behind.stage()
    assert {table: store.count(table, RUN) for table in stored} == stored  # nothing of that stage written

    retry = _scheduler(cfg, store, engine, [])
    retry.resume(problems)
    retry.run()
    assert_exactly_once(store, RUN)
    per_sample = store.query(
        "SELECT s.agent, count(*) AS n FROM segments g JOIN samples s USING (sample_id) GROUP BY s.agent, g.sample_id"
    ).to_pylist()
    assert {(r["agent"], r["n"]) for r in per_sample} == {("solver", 4), ("verifier", 3)}
    assert store.count("rewards", RUN) == store.count("samples", RUN) > stored["rewards"]
