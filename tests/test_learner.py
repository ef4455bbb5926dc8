"""The learner on a tiny model: learning, per-agent isolation, on-policy ratios, resume, MLflow."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from marsrl_core.config import load_config
from marsrl_core.demo.tiny import build_tiny_model
from marsrl_core.engines.hf import HFEngine
from marsrl_core.learn.checkpoint_folders import is_durable
from marsrl_core.learn.learner import Learner
from marsrl_core.store import RewardRow, SampleRow, SegmentRow, SegmentStore
from tests.configs import assert_exactly_once
from tests.rollout_helpers import digit_fraction, sample_groups

RUN = "learn"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), max_position_embeddings=128, seed=0)


def _cfg(tmp_path, **learner):
    overrides = [
        f"store.catalog_url=sqlite:{tmp_path}/lake.sqlite",
        f"store.data_path={tmp_path}/data",
        "rollout.temperature=1.0",
    ] + [f"learner.{k}={v}" for k, v in learner.items()]
    return load_config("tiny", None, overrides)


def _process_cfg(tmp_path, folder, **learner):
    """`_cfg` for the process's runtime: starting from `folder`, outputs and MLflow under `tmp_path`."""
    cfg = _cfg(tmp_path, **learner)
    tracking = cfg.tracking.model_copy(update={"mlflow_tracking_uri": f"sqlite:///{tmp_path}/mlflow.db"})
    model = cfg.model.model_copy(update={"path": str(folder)})
    return cfg.model_copy(update={"output_dir": str(tmp_path / "out"), "model": model, "tracking": tracking})


def _learner(cfg, store, folder, tmp_path, run=RUN, tracker=None):
    engine = HFEngine.from_pretrained(folder)
    return Learner(cfg, store, run, folder, tmp_path / f"ckpt-{run}", engine.tokenizer, tracker), engine


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_learning_raises_the_reward_of_a_trivial_task(folder, tmp_path):
    torch.manual_seed(0)
    cfg = _cfg(tmp_path, learning_rate=3e-3, warmup_steps=0)
    store = SegmentStore.from_config(cfg.store)
    learner, engine = _learner(cfg, store, folder, tmp_path)

    def mean_reward(seed):
        groups = sample_groups(
            engine, store, "probe", "solver", "S|", groups=4, size=8, seed=seed, reward_fn=digit_fraction
        )
        rows = store.load_samples("probe", [s for g in groups for s in g.sample_ids])
        return float(np.mean([r.reward for r in rows.values()]))

    before = mean_reward(1000)
    for step in range(12):
        groups = sample_groups(
            engine, store, RUN, "solver", "S|", groups=4, size=8, seed=step, reward_fn=digit_fraction
        )
        report = learner.train_step(groups)
        engine.update_weights(report.step, learner.state_dict("solver"))
    after = mean_reward(2000)
    # A random 100-token vocabulary has ~10% digits; seed-to-seed spread of the probe mean is ~0.03.
    assert before < 0.25
    print(f"digit fraction before {before:.3f}, after {after:.3f}")
    assert after > before + 0.3, (before, after)
    assert store.latest_version(RUN)[0] == 12


def test_first_step_is_on_policy_and_metrics_are_recorded(folder, tmp_path):
    cfg = _cfg(tmp_path)
    store = SegmentStore.from_config(cfg.store)
    learner, engine = _learner(cfg, store, folder, tmp_path)
    groups = sample_groups(engine, store, RUN, "solver", "S|1+2|", groups=2, size=4, reward_fn=digit_fraction)
    report = learner.train_step(groups)
    m = report.metrics["solver"]
    # Behaviour log-probs come from the engine's KV-cached decode, the learner's from a chunked forward.
    assert abs(m["ratio_mean"] - 1.0) < 1e-5 and abs(m["ratio_max"] - 1.0) < 1e-4
    assert m["clip_fraction"] == 0.0 and m["staleness_max"] == 0.0 and m["entropy"] > 0
    stored = store.query("SELECT step, agent, metrics_json FROM train_steps").to_pylist()
    assert stored[0]["step"] == 1 and "ratio_mean" in stored[0]["metrics_json"]
    # The train_step_metrics view has a column for every metric a step records, holding its value.
    [row] = store.query("SELECT * FROM train_step_metrics WHERE step = 1 AND agent = 'solver'").to_pylist()
    recorded = json.loads(stored[0]["metrics_json"])
    assert recorded and {key: row.get(key) for key in recorded} == pytest.approx(recorded)
    assert store.trainable_groups(RUN, "solver") == []


def test_groups_older_than_max_trained_age_are_dropped_untrained_while_fresh_ones_arrive(folder, tmp_path):
    from marsrl_core.learn.groups import ready_groups

    cfg = _cfg(tmp_path, max_trained_age=1, groups_per_step=1, downstream_groups_per_step=1, stale_groups="drop")
    store = SegmentStore.from_config(cfg.store)
    learner, engine = _learner(cfg, store, folder, tmp_path)
    old = sample_groups(engine, store, RUN, "verifier", "V|1+2|", groups=2, size=4, reward_fn=digit_fraction)
    for step in range(2):  # two versions later, the verifier groups sampled by version 0 are stale
        report = learner.train_step(
            sample_groups(engine, store, RUN, "solver", "S|1|", groups=1, size=4, seed=step, reward_fn=digit_fraction)
        )
    engine.update_weights(report.step, learner.state_dict("solver"))
    assert ready_groups(learner) == []  # stale groups alone never make a step ready...
    at_end = ready_groups(learner, flush=True)  # ...unless the rollouts have finished: then they are all there is
    assert len(at_end) == 1 and not at_end[0].stale and at_end[0].group_id in {g.group_id for g in old}
    fresh = sample_groups(engine, store, RUN, "solver", "S|2|", groups=1, size=4, reward_fn=digit_fraction)
    groups = ready_groups(learner)
    assert sorted((g.group_id, g.stale) for g in groups) == sorted(
        [(fresh[0].group_id, False)] + [(g.group_id, True) for g in old]
    )
    report = learner.train_step(groups)
    assert report.consumed == {"solver": fresh[0].sample_ids}
    assert report.metrics["verifier"] == {"dropped_stale_samples": 8.0} and "loss" in report.metrics["solver"]
    dropped = store.query("SELECT sample_id FROM consumptions WHERE learner_step = -1 ORDER BY 1")
    assert dropped.column("sample_id").to_pylist() == sorted(s for g in old for s in g.sample_ids)
    assert store.trainable_groups(RUN, "verifier") == [] and ready_groups(learner, flush=True) == []


def test_a_step_takes_every_group_the_next_step_would_find_stale_beyond_its_count(folder, tmp_path):
    from marsrl_core.learn.groups import ready_groups

    cfg = _cfg(tmp_path, max_trained_age=1, groups_per_step=1, downstream_groups_per_step=1)
    store = SegmentStore.from_config(cfg.store)
    learner, engine = _learner(cfg, store, folder, tmp_path)
    verifier = sample_groups(engine, store, RUN, "verifier", "V|1+2|", groups=3, size=2, reward_fn=digit_fraction)
    solver = sample_groups(engine, store, RUN, "solver", "S|1|", groups=2, size=2, reward_fn=digit_fraction)
    # Step 1 trains version-0 groups at age 0; step 2 would still find them fresh: one of each agent.
    first = ready_groups(learner)
    assert sorted(g.agent for g in first) == ["solver", "verifier"]
    learner.train_step(first)
    # Step 2 trains the rest at age 1 (= max_trained_age); step 3 would find them stale: all of them come.
    second = ready_groups(learner)
    assert sorted(g.group_id for g in second if g.agent == "verifier") == sorted(
        g.group_id for g in verifier if g.group_id not in {f.group_id for f in first}
    )
    assert [g.group_id for g in second if g.agent == "solver"] == [solver[1].group_id]
    assert not any(g.stale for g in second)
    learner.train_step(second)
    assert store.trainable_groups(RUN, "verifier") == []
    ages = store.query("SELECT max(staleness) AS age FROM staleness").column("age").to_pylist()
    assert ages == [1]


def test_downstream_agents_can_take_more_groups_per_step_than_the_solver(folder, tmp_path):
    from marsrl_core.learn.groups import ready_groups

    cfg = _cfg(tmp_path, groups_per_step=1, downstream_groups_per_step=3)
    store = SegmentStore.from_config(cfg.store)
    learner, engine = _learner(cfg, store, folder, tmp_path)
    verifier = sample_groups(engine, store, RUN, "verifier", "V|1+2|", groups=2, size=2, reward_fn=digit_fraction)
    assert ready_groups(learner) == []  # two verifier groups are fewer than the three a step takes
    solver = sample_groups(engine, store, RUN, "solver", "S|1|", groups=2, size=2, reward_fn=digit_fraction)
    verifier += sample_groups(
        engine, store, RUN, "verifier", "V|2+2|", groups=2, size=2, seed=1, reward_fn=digit_fraction
    )
    groups = ready_groups(learner)
    assert sorted(g.group_id for g in groups if g.agent == "solver") == [solver[0].group_id]
    assert sorted(g.group_id for g in groups if g.agent == "verifier") == sorted(g.group_id for g in verifier[:3])
    report = learner.train_step(groups)
    assert {agent: len(ids) for agent, ids in report.consumed.items()} == {"solver": 2, "verifier": 6}


def test_per_agent_policies_change_only_the_trained_agent(folder, tmp_path):
    cfg = _cfg(tmp_path, policies="per_agent", learning_rate=1e-3)
    store = SegmentStore.from_config(cfg.store)
    learner, engine = _learner(cfg, store, folder, tmp_path)
    before = {agent: _params(learner.models[agent]) for agent in ("solver", "verifier", "corrector")}
    groups = sample_groups(engine, store, RUN, "verifier", "V|1+2|1+2=3|", groups=2, size=4, reward_fn=digit_fraction)
    learner.train_step(groups)
    for agent in ("solver", "verifier", "corrector"):
        after = _params(learner.models[agent])
        same = all(torch.equal(before[agent][k], after[k]) for k in after)
        assert same == (agent != "verifier"), agent


def _copy_groups(store, groups, source, target):
    rows = store.load_samples(source, [s for g in groups for s in g.sample_ids])
    store.append(
        target,
        [SampleRow(r.sample_id, "p", r.agent, 0, r.group_id, 4, r.prompt_tokens) for r in rows.values()],
        [SegmentRow(r.sample_id, 0, r.token_ids, r.logprobs, 0, "stop") for r in rows.values()],
        [RewardRow(r.sample_id, r.reward) for r in rows.values()],
    )
    return groups


def _straight_and_interrupted(cfg, store, folder, tmp_path, first_steps):
    """Four steps' groups of run "a", copied as run "b"; a learner of "a" trained on all four and one of
    "b" on the first `first_steps`, from the same seed: (the "a" learner, the copies, the "b" learner)."""
    _, engine = _learner(cfg, store, folder, tmp_path, run="src")
    steps = [
        sample_groups(engine, store, "a", "solver", "S|4+4|", groups=2, size=4, seed=k, reward_fn=digit_fraction)
        for k in range(4)
    ]
    copies = [_copy_groups(store, groups, "a", "b") for groups in steps]  # the same samples under run "b"
    straight, _ = _learner(cfg, store, folder, tmp_path, run="a")
    torch.manual_seed(123)
    for groups in steps:
        straight.train_step(groups)
    first, _ = _learner(cfg, store, folder, tmp_path, run="b")
    torch.manual_seed(123)
    for groups in copies[:first_steps]:
        first.train_step(groups)
    return straight, copies, first


def test_kill_and_resume_equals_an_uninterrupted_run(folder, tmp_path):
    cfg = _cfg(tmp_path, learning_rate=1e-3, warmup_steps=3, save_every=1)
    store = SegmentStore.from_config(cfg.store)
    straight, copies, first = _straight_and_interrupted(cfg, store, folder, tmp_path, first_steps=2)
    first.wait_for_durable()  # v2's trainer state is on disk (`learner.async_save`)
    # The process dies while writing step 3: a temporary folder and an uncommitted v3 are left behind.
    (tmp_path / "ckpt-b" / "tmp-v3-dead").mkdir()
    (tmp_path / "ckpt-b" / "v3").mkdir()
    del first
    resumed, _ = _learner(cfg, store, folder, tmp_path, run="b")
    assert resumed.resume() == 2
    assert sorted(p.name for p in (tmp_path / "ckpt-b").iterdir()) == ["v1", "v2"]
    assert [g.group_id for g in store.trainable_groups("b", "solver")] != []  # steps 3-4 still trainable
    for groups in copies[2:]:
        resumed.train_step(groups)
    a, b = _params(straight.models["policy"]), _params(resumed.models["policy"])
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.optimizers["policy"].param_groups[0]["lr"] == straight.optimizers["policy"].param_groups[0]["lr"]


def test_a_resume_voids_the_steps_after_the_last_durable_version_and_trains_them_again(folder, tmp_path):
    """`save_every=2`: step 2 is durable, step 3 weights-only. Killed after step 3's commit, the learner
    resumes at 2: step 3's version, consumptions and metrics are voided in one transaction (a
    `rolled_back` event says so), its folder removed, its samples trainable again; trained again, the
    run ends where an uninterrupted one does, every sample consumed once."""

    cfg = _cfg(tmp_path, learning_rate=1e-3, warmup_steps=3, save_every=2, max_steps=4)
    store = SegmentStore.from_config(cfg.store)
    straight, copies, first = _straight_and_interrupted(cfg, store, folder, tmp_path, first_steps=3)
    root = tmp_path / "ckpt-b"
    assert [is_durable(root / f"v{v}") for v in (1, 2, 3)] == [False, True, False]
    del first
    resumed, _ = _learner(cfg, store, folder, tmp_path, run="b")
    assert resumed.resume() == 2
    assert store.latest_version("b")[0] == 2 and not (root / "v3").exists()
    assert store.events("b", "rolled_back") == {"rolled_back"}
    voided = {sid for g in copies[2] for sid in g.sample_ids}
    consumed = store.query("SELECT sample_id FROM consumptions WHERE run_id = 'b'").column(0).to_pylist()
    assert not voided & set(consumed)
    assert store.query("SELECT count(*) FROM train_steps WHERE run_id = 'b' AND step > 2").column(0)[0].as_py() == 0
    for groups in copies[2:]:
        resumed.train_step(groups)
    a, b = _params(straight.models["policy"]), _params(resumed.models["policy"])
    assert all(torch.equal(a[k], b[k]) for k in a)
    resumed.wait_for_durable()
    assert is_durable(root / "v4")  # the run's last step is durable
    assert_exactly_once(store, "b")


def test_a_durable_checkpoint_is_written_in_the_background_and_the_next_update_waits_for_it(
    folder, tmp_path, monkeypatch
):
    """`learner.async_save`: step 2's version commits with the weights alone while its trainer state is
    still being written (held here); step 3's update waits for that write, so the durable v2 holds step
    2's AdamW state and masters, byte for byte what the synchronous write stores."""
    import threading

    from safetensors.torch import load_file

    from marsrl_core.learn import versions

    cfg = {"learning_rate": 1e-3, "warmup_steps": 0, "save_every": 2}
    store = SegmentStore.from_config(_cfg(tmp_path).store)
    _, engine = _learner(_cfg(tmp_path), store, folder, tmp_path, run="src")
    steps = [
        sample_groups(engine, store, "sync", "solver", "S|4+4|", groups=2, size=4, seed=k, reward_fn=digit_fraction)
        for k in range(3)
    ]
    copies = [_copy_groups(store, groups, "sync", "async") for groups in steps]
    sync, _ = _learner(_cfg(tmp_path, async_save=False, **cfg), store, folder, tmp_path, run="sync")
    torch.manual_seed(123)
    for groups in steps[:2]:
        sync.train_step(groups)

    release, real_add = threading.Event(), versions.add_trainer_state
    monkeypatch.setattr(versions, "add_trainer_state", lambda *a: release.wait(60) and real_add(*a))
    learner, _ = _learner(_cfg(tmp_path, async_save=True, **cfg), store, folder, tmp_path, run="async")
    torch.manual_seed(123)
    for groups in copies[:2]:
        learner.train_step(groups)
    v2 = tmp_path / "ckpt-async" / "v2"
    assert store.latest_version("async")[0] == 2 and (v2 / "policy").is_dir() and not is_durable(v2)
    threading.Timer(1.0, release.set).start()  # step 3 begins while the write is held
    learner.train_step(copies[2])  # its update waited for v2's write
    assert is_durable(v2) and not is_durable(v2.parent / "v3")
    written = load_file(v2 / "trainer_state.safetensors")
    expected = load_file(tmp_path / "ckpt-sync" / "v2" / "trainer_state.safetensors")
    assert set(written) == set(expected) and len(written) > 1  # the RNG and AdamW's moments
    assert all(torch.equal(written[k], expected[k]) for k in expected if k != "rng.torch")
    assert_exactly_once(store, "async")


def client_versions(cfg) -> list:
    from mlflow import MlflowClient

    return MlflowClient().search_model_versions(f"name = '{cfg.tracking.registered_model_name}'")


def test_mlflow_holds_metrics_and_a_loadable_checkpoint(folder, tmp_path, monkeypatch):
    from mlflow import MlflowClient
    from transformers import AutoModelForCausalLM

    from marsrl_core.runtime.tracking import NEWEST_ALIAS, Tracker

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = _cfg(tmp_path)
    store = SegmentStore.from_config(cfg.store)
    tracker = Tracker(cfg.tracking, "test-run", cfg.model_dump(mode="json"))
    learner, engine = _learner(cfg, store, folder, tmp_path, tracker=tracker)
    for seed in range(2):
        groups = sample_groups(
            engine, store, RUN, "solver", "S|1|", groups=2, size=4, seed=seed, reward_fn=digit_fraction
        )
        learner.train_step(groups)
    assert client_versions(cfg) == []  # `log_checkpoint_steps` (50) logs no version of a 2-step run...
    learner.log_newest_checkpoint()  # ...nor a weights-only one (`save_every` 10)...
    assert client_versions(cfg) == []
    learner.make_durable()  # ...until the run ends (the learner flow's last calls)
    learner.log_newest_checkpoint()
    tracker.close()
    client = MlflowClient()
    history = client.get_metric_history(tracker.run_id, "solver/loss")
    assert [h.step for h in history] == [1, 2]
    assert client.get_run(tracker.run_id).data.params["learner.policies"] == "shared"
    version = client.get_model_version_by_alias(cfg.tracking.registered_model_name, NEWEST_ALIAS)
    assert version.source.endswith("checkpoints/v2")
    import mlflow

    local = mlflow.artifacts.download_artifacts(artifact_uri=version.source + "/policy", dst_path=str(tmp_path / "dl"))
    model = AutoModelForCausalLM.from_pretrained(local)
    trained = learner.models["policy"].state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in model.state_dict().items())
    assert store.latest_version(RUN)[0] == 2


def test_a_long_run_keeps_the_newest_checkpoints_and_logs_every_nth(folder, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from marsrl_core.learn.checkpoint import load_checkpoint
    from marsrl_core.runtime.tracking import NEWEST_ALIAS, Tracker

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = load_config(
        "tiny",
        None,
        [
            f"store.catalog_url=sqlite:{tmp_path}/lake.sqlite",
            f"store.data_path={tmp_path}/data",
            "learner.save_total_limit=2",
            "learner.save_every=2",
            "tracking.log_checkpoint_steps=2",
            f"tracking.mlflow_tracking_uri=sqlite:///{tmp_path}/tracking/mlflow.db",
        ],
    )
    (tmp_path / "tracking").mkdir()
    store = SegmentStore.from_config(cfg.store)
    tracker = Tracker(cfg.tracking, "retention", cfg.model_dump(mode="json"))
    learner, engine = _learner(cfg, store, folder, tmp_path, tracker=tracker)
    for seed in range(5):
        learner.train_step(
            sample_groups(engine, store, RUN, "solver", "S|1|", groups=1, size=4, seed=seed, reward_fn=digit_fraction)
        )
    root = tmp_path / f"ckpt-{RUN}"
    # the two newest durable versions (2, 4) and the weights-only one after them; no v1, v3, no tmp folder
    assert sorted(p.name for p in root.iterdir()) == ["v2", "v4", "v5"]
    assert [is_durable(root / v) for v in ("v2", "v4", "v5")] == [True, True, False]
    assert store.count("policy_versions", RUN) == 5  # every version is still recorded
    client = MlflowClient(tracking_uri=cfg.tracking.mlflow_tracking_uri)
    logged = lambda: sorted(a.path for a in client.list_artifacts(tracker.run_id, "checkpoints"))  # noqa: E731
    assert logged() == ["checkpoints/v2", "checkpoints/v4"]
    learner.log_newest_checkpoint()  # the newest durable version is logged already
    assert logged() == ["checkpoints/v2", "checkpoints/v4"]
    learner.make_durable()  # the end of the run: v5 becomes durable, and is logged
    learner.log_newest_checkpoint()
    assert logged() == ["checkpoints/v2", "checkpoints/v4", "checkpoints/v5"]
    model = learner.models["policy"]
    assert load_checkpoint(root / "v5", {"policy": model}, learner.optimizers, learner.schedulers) == 5
    newest = client.get_model_version_by_alias(cfg.tracking.registered_model_name, NEWEST_ALIAS)
    assert newest.source.endswith("checkpoints/v5")
    # the artifacts lie beside the tracking database, not in the working directory
    assert newest.source.startswith((tmp_path / "tracking" / "mlruns").as_uri())


def test_a_step_that_fails_to_publish_is_not_trained_twice(folder, tmp_path, monkeypatch):
    from marsrl_core.runtime import work
    from marsrl_core.runtime.context import runtime

    cfg = _process_cfg(tmp_path, folder, learning_rate=1e-3, warmup_steps=0)
    store = runtime().store(cfg)
    engine = HFEngine.from_pretrained(folder)
    sample_groups(engine, store, "pub", "solver", "S|2+2|", groups=4, size=4, reward_fn=digit_fraction)
    learner = runtime().learner(cfg, "pub")
    blocker = learner.checkpoint_root / "v1"
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("a file where the checkpoint folder must go: publishing fails")
    with pytest.raises(OSError):
        work.train_step(cfg, "pub")
    assert store.latest_version("pub") is None and store.count("consumptions", "pub") == 0
    blocker.unlink()
    result = work.train_step(cfg, "pub")  # the retry: rebuilt from the store, trains once
    assert result["step"] == 1 and store.latest_version("pub")[0] == 1
    assert runtime().learner(cfg, "pub").step == 1


def test_a_poll_then_a_step_reads_the_trainable_groups_once(folder, tmp_path, monkeypatch):
    from marsrl_core.runtime import work
    from marsrl_core.runtime.context import runtime

    cfg = _process_cfg(tmp_path, folder, groups_per_step=1, downstream_groups_per_step=1)
    store = runtime().store(cfg)
    engine = HFEngine.from_pretrained(folder)
    groups = sample_groups(engine, store, "poll", "solver", "S|3+4|", groups=2, size=4, reward_fn=digit_fraction)
    learner_store = runtime().learner(cfg, "poll").store  # the learner's own store lane
    reads = []
    original = learner_store.trainable_groups_by_agent
    monkeypatch.setattr(
        learner_store, "trainable_groups_by_agent", lambda *a, **k: reads.append(1) or original(*a, **k)
    )
    found = work.ready_groups(cfg, "poll")
    assert found and len(reads) == 1
    first = work.train_step(cfg, "poll", found)
    assert len(reads) == 1 and first["step"] == 1  # the step used what the poll found
    second = work.train_step(cfg, "poll")  # no poll before it: it queries for itself
    assert len(reads) == 2 and second["step"] == 2
    consumed = store.query(
        "SELECT DISTINCT learner_step, sample_id FROM consumptions WHERE run_id = 'poll'"
    ).to_pylist()
    assert sorted(r["sample_id"] for r in consumed) == sorted(s for g in groups for s in g.sample_ids)


@pytest.mark.parametrize("save_every, expected_calls", [(1, [0, 1, 1, 2]), (10, [0, 1, 0, 1, 2])])
def test_the_learner_flow_keeps_its_step_budget_when_a_step_fails_and_is_retried(
    folder, tmp_path, monkeypatch, save_every, expected_calls
):
    """A step that fails (here before its commit) is retried by the task with a learner rebuilt from the
    last durable version (step 1 with `save_every=1`; the start with 10, which voids step 1 and trains
    it again); the flow must count the rebuilt learner's steps, so the run stops at its budget and
    holds exactly that many versions."""
    from flows.learner import learner_flow
    from marsrl_core.runtime.context import runtime

    cfg = _process_cfg(
        tmp_path,
        folder,
        learning_rate=1e-3,
        warmup_steps=0,
        groups_per_step=1,
        downstream_groups_per_step=1,
        save_every=save_every,
    )
    store = runtime().store(cfg)
    engine = HFEngine.from_pretrained(folder)
    sample_groups(engine, store, "budget", "solver", "S|2+3|", groups=8, size=4, reward_fn=digit_fraction)
    calls = []
    original = Learner.train_step

    def fails_once(self, groups):
        calls.append(self.step)
        if len(calls) == 2:
            raise RuntimeError("injected: the step failed before its commit")
        return original(self, groups)

    monkeypatch.setattr(Learner, "train_step", fails_once)
    assert learner_flow(cfg, "budget", max_steps=3, poll_s=0.05, idle_timeout_s=5.0) == 3
    assert calls == expected_calls  # the failed step 2 was retried once, by the rebuilt learner
    assert store.count("policy_versions", "budget") == 3 and store.latest_version("budget")[0] == 3
    assert_exactly_once(store, "budget")


def test_a_non_finite_gradient_skips_the_update_and_publishes_the_weights_as_they_were(folder, tmp_path):
    cfg = _cfg(tmp_path, learning_rate=1e-2, warmup_steps=0)
    store = SegmentStore.from_config(cfg.store)
    learner, engine = _learner(cfg, store, folder, tmp_path)
    model = learner.model_for("solver")
    before = _params(model)
    hook = next(model.parameters()).register_hook(lambda grad: grad * float("inf"))
    groups = sample_groups(engine, store, RUN, "solver", "S|", groups=2, size=4, reward_fn=digit_fraction)
    report = learner.train_step(groups)
    hook.remove()
    assert report.metrics["solver"]["skipped_nonfinite"] == 1.0 and not np.isfinite(
        report.metrics["solver"]["grad_norm"]
    )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert store.latest_version(RUN)[0] == 1 and store.trainable_groups(RUN, "solver") == []  # consumed
    report = learner.train_step(
        sample_groups(engine, store, RUN, "solver", "S|", groups=2, size=4, seed=1, reward_fn=digit_fraction)
    )
    assert report.metrics["solver"]["skipped_nonfinite"] == 0.0
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_an_update_that_makes_a_parameter_non_finite_is_never_published(folder, tmp_path):
    """An optimizer step that overflows a parameter (torch refuses a learning rate past float32's range,
    so a post-step hook stands in for the overflow) fails the step before anything is written."""
    from marsrl_core.divergence import PolicyDiverged

    cfg = _cfg(tmp_path)
    store = SegmentStore.from_config(cfg.store)
    learner, engine = _learner(cfg, store, folder, tmp_path)
    param = next(learner.model_for("solver").parameters())
    learner.optimizers["policy"].register_step_post_hook(lambda *_: param.data.view(-1)[0].fill_(float("inf")))
    groups = sample_groups(engine, store, RUN, "solver", "S|", groups=2, size=4, reward_fn=digit_fraction)
    with pytest.raises(PolicyDiverged, match=r"learner step 1: the update made policy's parameter \S+ non-finite"):
        learner.train_step(groups)
    assert store.latest_version(RUN) is None and len(store.trainable_groups(RUN, "solver")) == 2
    assert not (tmp_path / f"ckpt-{RUN}").exists() or not any((tmp_path / f"ckpt-{RUN}").iterdir())


@pytest.mark.parametrize("bound", [1e4, "null"])
def test_an_update_that_blows_the_weights_up_stops_before_it_is_published(folder, tmp_path, bound):
    """A learning rate of 1e30 leaves the weights finite but ~1e30 after one AdamW step: past
    `learner.max_weight_abs` the step stops the run in one line naming the step, the parameter and the
    learning rate, and nothing is published; with no bound the same step is published."""
    from marsrl_core.divergence import PolicyDiverged

    cfg = _cfg(tmp_path, learning_rate=1e30, max_weight_abs=bound)
    store = SegmentStore.from_config(cfg.store)
    learner, engine = _learner(cfg, store, folder, tmp_path)
    groups = sample_groups(engine, store, RUN, "solver", "S|", groups=2, size=4, reward_fn=digit_fraction)
    if bound == "null":  # no bound: only non-finite weights stop a run
        learner.train_step(groups)
        assert store.latest_version(RUN)[0] == 1
        return
    message = (
        r"learner step 1: the update made policy's parameter \S+ \S+ in absolute value "
        r"\(past learner.max_weight_abs = 10000\); .* learner.learning_rate \(1e\+30\)$"
    )
    with pytest.raises(PolicyDiverged, match=message):
        learner.train_step(groups)
    assert store.latest_version(RUN) is None and len(store.trainable_groups(RUN, "solver")) == 2


def test_past_the_staleness_bound_correct_trains_stale_groups_with_decoupled_ppo(folder, tmp_path):
    from marsrl_core.learn.groups import ready_groups

    cfg = _cfg(tmp_path, max_trained_age=1, groups_per_step=2, downstream_groups_per_step=2, stale_groups="correct")
    store = SegmentStore.from_config(cfg.store)
    learner, engine = _learner(cfg, store, folder, tmp_path)
    old = sample_groups(engine, store, RUN, "verifier", "V|1+2|", groups=3, size=4, reward_fn=digit_fraction)
    for step in range(2):
        learner.train_step(
            sample_groups(engine, store, RUN, "solver", "S|1|", groups=2, size=4, seed=step, reward_fn=digit_fraction)
        )
    groups = ready_groups(learner)  # stale groups make a step ready: two of the three, the third waits
    assert len(groups) == 2 and all(g.stale and g.agent == "verifier" for g in groups)
    report = learner.train_step(groups)
    assert report.consumed == {"verifier": [s for g in groups for s in g.sample_ids]}
    m = report.metrics["verifier"]
    assert "dropped_stale_samples" not in m and m["decoupled_samples"] > 0 and np.isfinite(m["loss"])
    assert m["clip_fraction"] == 0.0  # against the proximal policy the ratio is 1: nothing is clipped
    steps = store.query("SELECT DISTINCT learner_step FROM consumptions WHERE agent = 'verifier'")
    assert steps.column("learner_step").to_pylist() == [3]
    assert [g.group_id for g in store.trainable_groups(RUN, "verifier")] != [] and len(old) == 3


def test_mask_truncated_completions_leaves_outputs_cut_off_by_their_budget_out_of_the_loss(folder, tmp_path):
    # 48-token budgets: some of the random tiny model's samples stop (EOS), the others run out of budget.
    metrics = {}
    for mask in (False, True):
        cfg = _cfg(tmp_path / str(mask), mask_truncated_completions=mask)
        store = SegmentStore.from_config(cfg.store)
        learner, engine = _learner(cfg, store, folder, tmp_path / str(mask))
        groups = sample_groups(
            engine, store, RUN, "solver", "S|", groups=2, size=8, seed=3, max_tokens=48, reward_fn=digit_fraction
        )
        samples = store.load_samples(RUN, [s for g in groups for s in g.sample_ids]).values()
        cut = [s for s in samples if s.finish_reason == "budget"]
        assert 0 < len(cut) < len(samples)
        metrics[mask] = learner.train_step(groups).metrics["solver"]
        kept = sum(len(s.token_ids) for s in samples if not (mask and s.finish_reason == "budget"))
        assert metrics[mask]["tokens"] == kept
    assert metrics[True]["masked_truncated_samples"] == len(cut) and metrics[False]["masked_truncated_samples"] == 0
    assert metrics[True]["reward_mean"] == metrics[False]["reward_mean"]  # still counted in the rewards
    assert metrics[True]["loss"] != pytest.approx(metrics[False]["loss"])


def test_agent_weighting_sets_how_agents_sharing_a_policy_are_normalised():
    from marsrl_core.learn.agent_loss import TrainItem, loss_normalizers
    from marsrl_core.store import StoredSample

    def item(tokens: int, masked: bool = False) -> TrainItem:
        empty = np.zeros(0)
        sample = StoredSample("s", "a", "g", empty, np.zeros(tokens, int), np.zeros(tokens), empty, "stop")
        return TrainItem(sample, 1.0, masked=masked)

    per_agent = {"solver": [item(10), item(30)], "verifier": [item(20), item(5, masked=True)]}
    shared = {agent: n["token_normalizer"] for agent, n in loss_normalizers(per_agent, lambda a: "p", "sum").items()}
    assert shared == {"solver": 40.0, "verifier": 20.0}  # each agent's own tokens: the step sums two means
    mean = loss_normalizers(per_agent, lambda a: "p", "mean")
    assert mean["solver"] == {"token_normalizer": 80.0, "sequence_normalizer": 4.0}
    token = loss_normalizers(per_agent, lambda a: "p", "token")
    assert token["solver"] == token["verifier"] == {"token_normalizer": 60.0, "sequence_normalizer": 3.0}
    own = loss_normalizers(per_agent, lambda a: a, "token")  # per-agent policies: each its own
    assert own["verifier"] == {"token_normalizer": 20.0, "sequence_normalizer": 1.0}
