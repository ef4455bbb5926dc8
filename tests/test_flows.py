"""Prefect flows under a real temporary Prefect server (prefect_test_harness), on the tiny model."""

from __future__ import annotations

import math
import re
import threading
import time
from pathlib import Path

import pytest
from prefect.testing.utilities import prefect_test_harness

from marsrl_core import timings
from marsrl_core.runtime.context import runtime
from tests.configs import small_config


@pytest.fixture(scope="session", autouse=True)
def prefect_server():
    with prefect_test_harness(server_startup_timeout=120):
        yield


def _length_script(long_word: str = "long"):
    """A Solver writes 9 characters for a problem whose prompt lacks `long_word` (one 16-token segment)
    and 82 for one that has it (six); a Verifier flags every solution; a Corrector fixes it."""

    def script(prompt: str) -> str:
        role, problem = prompt.split("|")[:2]
        if role == "S":
            return ("thinking " * 8 + "Answer: 2") if long_word in problem else "Answer: 2"
        return "Correctness: Wrong" if role == "V" else "Answer: 2"

    return script


def _scripted_run(tmp_path, rows: list[str], before_decode=None, **extra):
    """A config whose training problems are `rows` (their questions) and a scripted engine for it whose
    segment batches take 0.2 s each (longer than a batch's Prefect set-up), after `before_decode()`."""
    import json

    from marsrl_core.runtime.context import runtime
    from tests.scripted import ScriptedEngine

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"query": q, "ans_box": "2"}) + "\n" for q in rows))
    settings = {
        "data.train_dataset": str(data),
        "rollout.segment_tokens": 16,
        "rollout.solver_max_tokens": 96,
        "rollout.verifier_max_tokens": 48,
        "rollout.corrector_max_tokens": 48,
        "rollout.select_inputs": 1,
        **extra,
    }
    cfg = small_config(tmp_path, **settings)
    runtime().use_engine(cfg, ScriptedEngine(_length_script(), delay_s=0.2, before_decode=before_decode))
    return cfg


def _task_runs(flow_run_id) -> dict:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {r.name.rsplit("-", 1)[0]: r for r in runs}


def test_a_batchs_turn_tasks_span_their_groups_and_overlap_where_the_agents_do(tmp_path):
    """Problem "1+1 short" finishes its Solvers in one stage, "1+1 long" needs six: its Verifiers
    start meanwhile, so the Verifier task starts before the Solver task ends. Each task ends after its
    turn's last segment was stored, and returns the turn's samples as the store holds them."""
    from flows.rollout import rollout_flow
    from marsrl_core.store import SegmentStore

    cfg = _scripted_run(tmp_path, ["1+1 short", "1+1 long"])
    before = timings.TIMINGS.snapshot()
    state = rollout_flow(cfg, "r1", 0, return_state=True)
    results = state.result()
    # The batch's problems were all recorded by this flow: nothing of it could be stored to resume.
    assert timings.since(before).get("store.samples_of_problems", (0.0, 0))[1] == 0
    tasks = _task_runs(state.state_details.flow_run_id)
    assert set(tasks) == {"solver-turn0", "verifier-turn1", "corrector-turn2"}
    solver, verifier = tasks["solver-turn0"], tasks["verifier-turn1"]
    assert verifier.start_time < solver.end_time  # the agents overlapped, and so did their tasks
    store = SegmentStore.from_config(cfg.store)
    per_turn = store.query(
        """SELECT s.turn, count(DISTINCT s.sample_id) AS samples, max(g.created_at) AS last_segment
           FROM samples s JOIN segments g USING (run_id, sample_id) WHERE run_id = 'r1' GROUP BY 1 ORDER BY 1"""
    ).to_pylist()
    assert [r["samples"] for r in results] == [r["samples"] for r in per_turn] == [8, 4, 4]
    for row, name in zip(per_turn, ("solver-turn0", "verifier-turn1", "corrector-turn2")):
        assert tasks[name].end_time >= row["last_segment"], name
    assert store.has_event("r1", "batch_done:0")


def test_subflows_inside_parent_heartbeat_only_send_no_heartbeat_and_reuse_one_settings_object():
    from prefect import flow
    from prefect.settings import PREFECT_LOGGING_LEVEL, get_current_settings, temporary_settings

    from flows.subflows import parent_heartbeat_only

    @flow
    def heartbeat_setting() -> tuple[int | None, str]:
        settings = get_current_settings()
        return settings.flows.heartbeat_frequency, settings.logging.level

    @flow
    def parent() -> list[tuple[int | None, str]]:
        seen = [heartbeat_setting()]
        with parent_heartbeat_only():
            seen.append(heartbeat_setting())
            first = get_current_settings()
        with parent_heartbeat_only():
            assert get_current_settings() is first  # built once, not re-validated per subflow
        with temporary_settings({PREFECT_LOGGING_LEVEL: "ERROR"}), parent_heartbeat_only():
            seen.append(heartbeat_setting())  # a different base: its other settings are kept
        seen.append(heartbeat_setting())
        return seen

    default = get_current_settings().flows.heartbeat_frequency
    assert default is not None
    assert parent() == [
        (default, get_current_settings().logging.level),
        (None, get_current_settings().logging.level),
        (None, "ERROR"),
        (default, get_current_settings().logging.level),
    ]


def test_rollouts_flow_stops_before_the_next_batch_when_asked(tmp_path):
    from flows.rollout import rollouts_flow
    from marsrl_core.runtime import events
    from marsrl_core.runtime.context import runtime
    from marsrl_core.runtime.events import ROLLOUTS_FINISHED

    cfg = small_config(tmp_path)
    assert rollouts_flow(cfg, "s1", [0], finish=False)["batches"] == 1
    store = runtime().store(cfg)
    decoded = store.count("segments", "s1")
    assert decoded > 0 and not store.has_event("s1", ROLLOUTS_FINISHED)
    store.mark("s1", events.STOP_REQUESTED)
    assert rollouts_flow(cfg, "s1", [1, 2], finish=True) == {"batches": 0, "samples": 0}
    assert store.count("segments", "s1") == decoded and store.has_event("s1", ROLLOUTS_FINISHED)
    # A learner that found the policy diverged stops the rollouts too: Failed with its line, not finished.
    from prefect.exceptions import FailedRun

    store.mark("s2", events.DIVERGED, "learner step 3: the update made policy's parameter w non-finite")
    with pytest.raises(FailedRun, match="^learner step 3: the update made policy's parameter w non-finite$"):
        rollouts_flow(cfg, "s2", [0, 1], finish=True)
    assert store.count("segments", "s2") == 0 and not store.has_event("s2", ROLLOUTS_FINISHED)


def test_run_batches_leaves_nothing_per_batch_in_the_calling_flow(tmp_path):
    """Prefect registers the value a subflow returns in the calling flow's context (`run_results`, for
    dependency tracking); a days-long rollouts flow must not keep an entry for every batch it ran."""
    from prefect import flow
    from prefect.context import FlowRunContext

    from flows.rollout import run_batches

    cfg = small_config(tmp_path, **{"learner.max_trained_age": "null"})  # no learner here: no pacing

    @flow
    def calling_flow() -> tuple[dict, int]:
        done = run_batches(cfg, "kept", [0, 1, 2])
        return done, len(FlowRunContext.get().run_results)

    done, entries = calling_flow()
    assert done["batches"] == 3 and done["samples"] >= 3 * cfg.rollout.problems_per_batch * 4
    assert entries == 0


@pytest.mark.parametrize("in_flight", [1, 2])
def test_the_next_batch_streams_in_as_an_earlier_problem_ends(tmp_path, in_flight):
    """Each batch has a short problem and a long one. The decode loop holds `batches_in_flight` x 2
    problems: batch 1's problems start while batch 0's long problem still decodes (the batch prepared
    ahead waits in the loop, not behind a barrier), never more problems at once than that, and every
    batch ends marked done with nothing stored twice.

    Decoding waits (up to 30 s, once) for batch 1 to join the loop: on a loaded machine its Prefect
    set-up can take longer than batch 0's whole decode, and the test is about what the loop does with
    a batch that has joined."""
    from flows.rollout import rollouts_flow
    from marsrl_core.config import absolute_paths
    from marsrl_core.runtime import events, work
    from marsrl_core.runtime.context import runtime
    from tests.configs import assert_exactly_once

    batch_1_joined = threading.Event()

    def until_batch_1_joined() -> None:
        deadline = time.monotonic() + 30
        while not batch_1_joined.is_set() and time.monotonic() < deadline:
            if work.rollout_loop(absolute_paths(cfg), "stream").joined(1):
                batch_1_joined.set()
            time.sleep(0.01)
        batch_1_joined.set()

    cfg = _scripted_run(
        tmp_path,
        ["1+1 short", "1+1 long"],
        before_decode=until_batch_1_joined,
        **{"rollout.batches_in_flight": in_flight, "rollout.max_turns": 1, "learner.max_trained_age": "null"},
    )
    assert rollouts_flow(cfg, "stream", [0, 1, 2], finish=True)["batches"] == 3
    store = runtime().store(cfg)
    stages = store.query(
        """SELECT g.created_at, list(DISTINCT s.problem_id) AS problems
           FROM segments g JOIN samples s USING (run_id, sample_id) WHERE run_id = 'stream' GROUP BY 1 ORDER BY 1"""
    ).to_pylist()
    assert max(len(s["problems"]) for s in stages) <= 2 * in_flight
    batch_of = lambda problem: problem.split("-")[0]  # noqa: E731
    assert any({"b0", "b1"} <= {batch_of(p) for p in s["problems"]} for s in stages)
    assert all(store.has_event("stream", events.batch_done(b)) for b in range(3))
    assert_exactly_once(store, "stream")


def test_a_stop_drops_the_problems_not_admitted_and_leaves_their_batch_unmarked(tmp_path, monkeypatch):
    """The stop request arrives once batch 0's Solver turn has ended: no later problem is admitted, the
    batches in flight end with what they have, and only a batch whose every problem was decoded is
    marked done (a resumed run decodes the rest)."""
    from flows.rollout import rollouts_flow
    from marsrl_core.runtime import events, work
    from marsrl_core.runtime.context import runtime

    cfg = _scripted_run(
        tmp_path,
        ["1+1 long", "1+1 long"],
        **{"rollout.batches_in_flight": 1, "rollout.max_turns": 1, "rollout.problems_per_batch": 1}
        | {"learner.max_trained_age": "null"},
    )
    store = runtime().store(cfg)
    turn = work.rollout_turn

    def stop_after_batch_0(c, run_id, batch, t):
        result = turn(c, run_id, batch, t)
        if batch == 0:
            store.mark(run_id, events.STOP_REQUESTED)
        return result

    monkeypatch.setattr(work, "rollout_turn", stop_after_batch_0)
    done = rollouts_flow(cfg, "halt", [0, 1, 2, 3])
    assert store.has_event("halt", events.batch_done(0))
    decoded = {r["problem_id"].split("-")[0] for r in store.query("SELECT problem_id FROM samples").to_pylist()}
    assert "b3" not in decoded and done["batches"] <= 3  # stopped before starting every batch
    for b in range(1, 4):  # a batch marked done decoded all its problems
        if store.has_event("halt", events.batch_done(b)):
            assert f"b{b}" in decoded


def test_train_flow_runs_rollouts_and_learner_and_evaluates(tmp_path):
    import mlflow
    from prefect.artifacts import Artifact
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterName,
        FlowRunFilterParentTaskRunId,
        LogFilter,
        LogFilterFlowRunId,
    )
    from prefect.logging.handlers import APILogHandler

    from flows.train import train_flow
    from marsrl_core.runtime import events
    from marsrl_core.runtime.context import runtime
    from marsrl_core.store import SegmentStore

    cfg = small_config(tmp_path)
    result = train_flow(cfg, "t1")
    assert result["learner_steps"] == 2 and "solver_acc" in result["after"] and "vc_acc" in result["before"]
    store = SegmentStore.from_config(cfg.store)
    assert store.latest_version("t1")[0] == 2
    # The learner took every sample it trained from what this process's rollouts stored (in memory).
    trained = store.query("SELECT count(*) AS n FROM consumptions WHERE learner_step > 0").column("n")[0].as_py()
    recent = runtime().recent_samples(cfg)
    assert trained > 0 and (recent.served, recent.fetched) == (trained, 0)
    # Batch 0 always starts; batch 1 only if the learner had not had its two steps yet. Once it has,
    # problems not admitted are dropped and held trajectories end: a batch is marked done only if every
    # one of its problems was decoded, and whatever was started was decoded to its end.
    problems = store.count("problems", "t1")
    assert problems in (2, 4)
    for b in range(problems // 2):
        if store.has_event("t1", events.batch_done(b)):
            decoded = store.query(
                "SELECT count(DISTINCT problem_id) AS n FROM samples WHERE problem_id LIKE ?", [f"b{b}-%"]
            )
            assert decoded.column("n")[0].as_py() == 2
    assert store.count("rewards", "t1") == store.count("samples", "t1")
    labels = store.query("SELECT label FROM evaluations WHERE run_id = 't1'").column("label").to_pylist()
    assert sorted(labels) == ["after", "before"]
    client = mlflow.MlflowClient(tracking_uri=cfg.tracking.mlflow_tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("marsrl").experiment_id])
    (run,) = [r for r in runs if r.info.run_name == "t1"]
    assert "solver/reward_mean" in run.data.metrics and run.info.status == "FINISHED"
    assert {"eval_before/solver_acc", "eval_after/solver_acc"} <= set(run.data.metrics)  # before vs after
    artifact = Artifact.get("marsrl-t1")  # the results on the run's page in the Prefect UI
    assert "| Solver accuracy |" in artifact.data and "reward_curves.png" in artifact.data
    for label in ("before", "after"):  # each evaluation's own table, on its own run's page
        assert "| Solver accuracy |" in Artifact.get(f"marsrl-t1-{label}").data
    APILogHandler().flush()  # the log lines still queued for the server
    with get_client(sync_client=True) as client:  # runs named for what they are, a log line per step
        flows = {
            r.name
            for r in client.read_flow_runs(
                flow_run_filter=FlowRunFilter(parent_task_run_id=FlowRunFilterParentTaskRunId(is_null_=False))
            )
        }
        tasks = {r.name for r in client.read_task_runs()}
        (learner,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["learner-t1"])))
        logs = [log.message for log in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[learner.id])))]
        every = [log.message for log in client.read_logs()]
    assert {"rollout-batch-0", "evaluate-t1-before", "evaluate-t1-after"} <= flows
    assert {"train-step-1", "train-step-2"} <= tasks
    steps = [m for m in logs if m.startswith("learner step ")]
    agent_part = r"\w+ (reward \d\.\d{3} loss [+-]\d\.\d{4} tokens \d+ staleness \d+\.\d|reward \d\.\d{3}, no gradient)"
    assert len(steps) == 2 and all(re.match(rf"learner step [12]: {agent_part}", m) for m in steps), steps
    # Evaluation progress by phase in the run's logs (the UI): the Solver's phase and a V-C round.
    assert any(m.startswith("evaluation solver: ") and "outputs to decode" in m for m in every)
    assert any(m.startswith("evaluation V-C round 1 verifier: done, ") for m in every)


def test_train_flow_on_aime_with_a_random_qwen3_and_its_real_tokenizer(tmp_path):
    """The real-model path through the train flow (hf engine): chat-templated prompts of the default
    templates over Qwen3's real vocabulary, two learner steps, and a checkpoint that loads as a model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flows.train import train_flow
    from marsrl_core.store import SegmentStore
    from tests.qwen3 import build_qwen3
    from tests.test_problems import _aime

    model = build_qwen3(tmp_path / "qwen3")
    aime = str(_aime())
    cfg = small_config(
        tmp_path,
        **{"model.path": model, "roles.templates": "default", "data.train_dataset": aime, "evaluation.dataset": aime},
    )
    result = train_flow(cfg, "q3")
    assert result["learner_steps"] == 2 and result["before"]["truncated_solver"] == 2  # random weights: cut off
    store = SegmentStore.from_config(cfg.store)
    [first] = store.query(
        "SELECT prompt_tokens FROM samples WHERE run_id = 'q3' AND agent = 'solver' LIMIT 1"
    ).to_pylist()
    assert first["prompt_tokens"][0] == 151644  # <|im_start|>: the chat template, as one special token
    top = store.query("SELECT max(list_max(token_ids)) AS m FROM segments WHERE run_id = 'q3'").column("m")[0].as_py()
    assert top > 100_000  # sampled over the real vocabulary, not the tiny one
    (folder,) = (tmp_path / "out").rglob("v2/policy")
    assert AutoModelForCausalLM.from_pretrained(folder).config.model_type == "qwen3"
    assert AutoTokenizer.from_pretrained(folder).chat_template  # the checkpoint is a whole model folder


def test_a_resumed_run_continues_its_mlflow_run_which_ends_failed_then_finished(tmp_path, monkeypatch):
    import mlflow

    from flows.train import train_flow
    from marsrl_core.learn.learner import Learner
    from marsrl_core.runtime.work import StepFailedAgain

    cfg = small_config(tmp_path, **{"learner.max_steps": 2, "data.num_batches": 6})
    real_step = Learner.train_step

    def fail_at_step_2(self, groups):
        if self.step == 1:
            raise RuntimeError("the learner broke")
        return real_step(self, groups)

    monkeypatch.setattr(Learner, "train_step", fail_at_step_2)
    # Step 1 held its weights alone (`learner.save_every`), so the task's retry rolls back to the start,
    # trains step 1 again and fails at step 2 again: the run stops there instead of looping.
    with pytest.raises(StepFailedAgain, match="step 2 .* failed again .*the learner broke"):
        train_flow(cfg, "again", evaluate_after=False)
    client = mlflow.MlflowClient(tracking_uri=cfg.tracking.mlflow_tracking_uri)
    experiment = client.get_experiment_by_name("marsrl").experiment_id
    (failed,) = client.search_runs([experiment])
    assert failed.info.status == "FAILED" and "eval_before/solver_acc" in failed.data.metrics
    monkeypatch.setattr(Learner, "train_step", real_step)
    runtime().drop_learner("again")  # as a new process would: rebuilt from the last committed version
    assert train_flow(cfg, "again")["learner_steps"] == 2
    (run,) = client.search_runs([experiment])  # the same MLflow run, continued
    assert run.info.run_id == failed.info.run_id and run.info.status == "FINISHED"
    assert run.data.tags["marsrl.resumes"] == "1" and run.data.metrics["resumed"] == 1.0
    rates = [key for key in run.data.metrics if key.endswith("/learning_rate")]  # every step logs them
    assert sorted({m.step for key in rates for m in client.get_metric_history(run.info.run_id, key)}) == [1, 2]


def test_a_failed_learner_leaves_the_rollouts_unfinished_for_a_resume(tmp_path, monkeypatch):
    """A learner that fails stops the train flow's batches early; the run must not be marked as having
    finished its rollouts, or a resumed run's learner would stop before the rest were decoded."""
    from flows.train import train_flow
    from marsrl_core.learn.learner import Learner
    from marsrl_core.runtime.events import ROLLOUTS_FINISHED
    from marsrl_core.store import SegmentStore

    def broken(self, groups):
        raise RuntimeError("the learner broke")

    monkeypatch.setattr(Learner, "train_step", broken)
    # Far more batches than decode before the learner's first step fails (a few seconds): with 6 a busy
    # machine's learner sometimes failed only after the last batch, when the rollouts had finished.
    cfg = small_config(tmp_path, **{"data.num_batches": 40})
    with pytest.raises(RuntimeError, match="the learner broke"):
        train_flow(cfg, "broken", evaluate_before=False, evaluate_after=False)
    store = SegmentStore.from_config(cfg.store)
    assert store.count("samples", "broken") > 0  # the learner had groups to fail on
    assert not store.has_event("broken", ROLLOUTS_FINISHED)
    assert store.count("problems", "broken") < 40 * cfg.rollout.problems_per_batch  # the batches stopped early


def test_synchronous_train_flow_decodes_no_batch_after_the_learner_has_its_steps(tmp_path):
    from flows.train import train_flow
    from marsrl_core.store import SegmentStore

    # The first batch (2 problems) gives the one step; three more batches are available.
    cfg = small_config(tmp_path, **{"rollout.synchronous": True, "data.num_batches": 4, "learner.max_steps": 1})
    result = train_flow(cfg, "sync", evaluate_before=False, evaluate_after=False)
    assert result["learner_steps"] == 1
    store = SegmentStore.from_config(cfg.store)
    assert store.count("problems", "sync") == 2
    samples = result["samples"]  # what became of the finished samples
    assert samples["trained"] == store.count("consumptions", "sync") > 0 and samples["dropped_stale"] == 0
    assert samples["finished"] == samples["trained"] + samples["pending"] and samples["stale_drop_fraction"] == 0.0


@pytest.mark.parametrize(
    "weight_sync, source", [("memory", "memory"), ("checkpoint", "checkpoint"), ("auto", "checkpoint")]
)
def test_runs_one_after_another_in_one_process_each_decode_with_their_own_weights(tmp_path, weight_sync, source):
    """Two runs from the same starting model in one process share its engine (`marsrl ablate`, the
    learning spread): each must decode with its own versions, loaded from the learner's memory or from
    the committed folder as `engine.weight_sync` says (`auto`: the folder on the CPU). Synchronous, one
    problem a batch, and more downstream groups a step than a batch makes: the Solver's group makes each
    step ready, so batch 1 is decoded after step 1, by version 1, on any machine."""
    from flows.train import train_flow
    from marsrl_core.store import SegmentStore

    cfg = small_config(
        tmp_path,
        **{
            "rollout.synchronous": True,
            "rollout.problems_per_batch": 1,
            "learner.downstream_groups_per_step": 16,
            "engine.weight_sync": weight_sync,
        },
    )
    store = SegmentStore.from_config(cfg.store)
    engine = runtime().engine(cfg)
    before = dict(engine.weight_updates)
    for run in ("first", "second"):
        assert train_flow(cfg, run, evaluate_before=False, evaluate_after=False)["learner_steps"] == 2
        versions = store.query(
            "SELECT p.problem_id, min(g.policy_version) AS lo, max(g.policy_version) AS hi FROM segments g "
            "JOIN samples p USING (run_id, sample_id) WHERE g.run_id = ? GROUP BY 1 ORDER BY lo",
            [run],
        ).to_pylist()
        # Batch 0 by the starting weights (the second run's too: not the first run's last version), batch 1
        # by version 1.
        assert [(v["lo"], v["hi"]) for v in versions] == [(0, 0), (1, 1)], versions
    loaded = {k: engine.weight_updates[k] - before.get(k, 0) for k in ("memory", "checkpoint")}
    other = "checkpoint" if source == "memory" else "memory"
    assert loaded[source] == 2 and loaded[other] == 0, loaded  # version 1 of each run, from where it says


def test_learner_flow_compacts_the_store_every_n_versions(tmp_path):
    from flows.train import train_flow
    from marsrl_core.store import SegmentStore

    cfg = small_config(
        tmp_path,
        **{"rollout.synchronous": True, "data.num_batches": 1, "learner.max_steps": 1, "store.compact_every_steps": 1},
    )
    store = SegmentStore.from_config(cfg.store)
    assert train_flow(cfg, "compacted", evaluate_before=False, evaluate_after=False)["learner_steps"] == 1
    snapshots = store.query("SELECT map_keys(changes) AS kinds FROM ducklake_snapshots('lake')")
    kinds = [r["kinds"] for r in snapshots.to_pylist()]
    # Every commit writes Parquet (nothing is inlined in the catalog): the one compaction of the one
    # version merged those small files, and flushed nothing.
    assert sum("merge_adjacent" in k for k in kinds) == 1 and not any("flushed_inlined" in k for k in kinds)
    assert store.latest_version("compacted")[0] == 1
    ids = store.query("SELECT sample_id FROM samples WHERE run_id = 'compacted'").column("sample_id").to_pylist()
    assert len(store.load_samples("compacted", ids)) == len(ids) > 0  # every sample still reads


@pytest.fixture
def terminal():
    """What Prefect's console handler writes (its rich console's file), for the test's duration."""
    import io
    import logging

    from prefect.logging.handlers import PrefectConsoleHandler

    [handler] = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    buffer, kept = io.StringIO(), handler.console.file
    handler.console.file = buffer
    yield buffer
    handler.console.file = kept


def test_marsrl_train_command_prints_the_before_after_table_and_is_quiet_without_v(tmp_path, capsys, terminal):
    import json

    from flows.cli import main
    from marsrl_core.config import config_to_yaml

    cfg = small_config(tmp_path, **{"rollout.max_turns": 2, "data.num_batches": 1, "learner.max_steps": 1})
    path = tmp_path / "small.yaml"
    path.write_text(config_to_yaml(cfg))
    results = tmp_path / "train.json"
    assert main(["train", "--config", str(path), "--run-id", "cli-run", "--results", str(results)]) == 0
    out, err = capsys.readouterr().out, terminal.getvalue()
    assert "cli-run" in out and "Solver accuracy" in out and "before" in out and "after" in out
    # Quiet by default: the learner's own step line shows, Prefect's per-run state lines do not.
    assert "learner step 1:" in err and "Finished in state" not in err and "Created task run" not in err
    figures = json.loads(results.read_text())
    assert figures["learner_steps"] == 1 and 0.0 <= figures["solver_acc_after"] <= 1.0
    # Resumed once finished, the run decodes and trains nothing more, and says so.
    from marsrl_core.store import SegmentStore

    store = SegmentStore.from_config(cfg.store)
    counts = lambda: (store.count("segments", "cli-run"), store.count("policy_versions", "cli-run"))  # noqa: E731
    before = counts()
    again = tmp_path / "again.json"
    assert main(["train", "-v", "--config", str(path), "--resume", "cli-run", "--results", str(again)]) == 0
    out, err = capsys.readouterr().out, terminal.getvalue()
    assert "had finished" in out and "Solver accuracy" in out
    assert "Finished in state" in err  # -v: Prefect's own lines too
    assert counts() == before
    # Its figures are written as the report printed them: the stored evaluations, no wall clock measured.
    refigured = json.loads(again.read_text())
    assert refigured["solver_acc_after"] == figures["solver_acc_after"] and refigured["learner_steps"] == 1
    assert math.isnan(refigured["wall_clock_s"])


def test_a_fresh_marsrl_process_is_quiet_without_v_and_loses_no_log_line_at_exit(tmp_path):
    """`marsrl sft` (the committed warm start: no training) in its own process, with its own temporary
    Prefect server: its line shows, Prefect's state lines do not (with -v they do: the train command's
    test), and no log line is left unsent when the server stops."""
    import os
    import subprocess
    import sys

    root = Path(__file__).parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("PREFECT_API_URL", None)
    run = subprocess.run(
        [sys.executable, "-m", "flows.cli", "sft"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    shown = run.stdout + run.stderr
    assert run.returncode == 0 and "warm start: " in shown, shown
    assert "Finished in state" not in shown and "Error logging to API" not in shown, shown


def test_marsrl_core_never_imports_prefect():
    from pathlib import Path

    core = Path(__file__).parents[1] / "marsrl_core"
    offenders = [
        p.name
        for p in core.rglob("*.py")
        if any(
            line.strip().startswith(
                ("import prefect", "from prefect", "from flows", "import flows", "from tasks", "import tasks")
            )
            for line in p.read_text().splitlines()
        )
    ]
    assert offenders == []


def test_sft_flow_warm_starts_and_reuses_the_cache(tmp_path):
    from pathlib import Path

    from flows.sft import sft_flow

    cfg = small_config(tmp_path, **{"sft.max_steps": 5, "sft.per_device_train_batch_size": 4, "sft.num_problems": 10})
    folder = Path(sft_flow(cfg))
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    assert Path(sft_flow(cfg)) == folder


def test_training_dataset_batches_skip_and_record_bad_rows(tmp_path):
    from marsrl_core.runtime import work
    from marsrl_core.store import SegmentStore

    data = tmp_path / "train.jsonl"
    data.write_text('{"query": "1+2", "ans_box": "3"}\n{"query": "2+2"}\n{"query": "3+3", "ans_box": "6"}\n')
    cfg = small_config(tmp_path, **{"data.train_dataset": str(data)})
    assert work.record_batch(cfg, "ds", 0) == 2 and work.record_batch(cfg, "ds", 1) == 2
    from marsrl_core.runtime.batches import batch_problems

    prompts = [p.prompt for p in batch_problems(cfg, 1)]
    assert prompts == ["1+2", "3+3"]  # batches cycle through the good rows only
    store = SegmentStore.from_config(cfg.store)
    rows = store.query("SELECT location, reason FROM rejected_inputs WHERE run_id = 'ds'").to_pylist()
    assert rows == [{"location": "line 2", "reason": "missing field(s) 'ans_box'"}]


def test_marsrl_ablate_runs_each_variant_and_writes_train_json_keys(tmp_path, capsys):
    import json

    from flows.cli import main
    from marsrl_core.config import config_to_yaml
    from marsrl_core.store import SegmentStore

    cfg = small_config(tmp_path, **{"rollout.max_turns": 2, "data.num_batches": 2, "learner.max_steps": 2})
    path = tmp_path / "small.yaml"
    path.write_text(config_to_yaml(cfg))
    results = tmp_path / "ablations.json"
    earlier = {"seeds": 3, "mean": {}, "sd": {}, "runs": []}
    results.write_text(json.dumps({"random_selection": earlier, "marsrl": {"seeds": 9}}))
    args = ["ablate", "marsrl", "synchronous", "--seeds", "2", "--config", str(path), "--results", str(results)]
    assert main(args) == 0
    variants = json.loads(results.read_text())
    assert variants.pop("random_selection") == earlier  # a variant not run again keeps its entry
    assert set(variants) == {"marsrl", "synchronous"}
    assert all(
        v["seeds"] == 2 and [r["seed"] for r in v["runs"]] == [cfg.seed, cfg.seed + 1] for v in variants.values()
    )
    for v in variants.values():  # the mean and sd of each figure over the two seeds
        solver = [r["solver_acc_after"] for r in v["runs"]]
        assert v["mean"]["solver_acc_after"] == pytest.approx(sum(solver) / 2)
        assert v["sd"]["solver_acc_after"] == pytest.approx(abs(solver[0] - solver[1]) / 2**0.5)
    figures = {f"{name}-{r['seed']}": r for name, v in variants.items() for r in v["runs"]}
    keys = {
        "solver_acc_before",
        "solver_acc_after",
        "verifier_bal_acc_before",
        "verifier_bal_acc_after",
        "verifier_wrong_caught_after",
        "corrector_fix_before",
        "corrector_fix_after",
        "corrector_break_after",
        "vc_acc_before",
        "vc_acc_after",
        "stale_drop_fraction",
        "wall_clock_s",
        "learner_steps",
        "seed",
    }
    assert all(set(f) == keys and f["learner_steps"] == 2 for f in figures.values())
    assert all(0.0 <= f["stale_drop_fraction"] <= 1.0 for f in figures.values())
    out = capsys.readouterr().out
    assert "synchronous" in out and "Solver accuracy" in out and "mean ± sd over 2 seed(s)" in out
    # The synchronous baseline trains only once a whole batch has been decoded.
    store = SegmentStore.from_config(cfg.store)
    runs = store.query("SELECT run_id, max(version) AS v FROM policy_versions GROUP BY 1").to_pylist()
    assert sorted(r["v"] for r in runs) == [2, 2, 2, 2]
    sync = next(r["run_id"] for r in runs if "synchronous" in r["run_id"])
    first_step = store.query("SELECT min(created_at) AS t FROM policy_versions WHERE run_id = ?", [sync]).column("t")[0]
    batch_done = store.query(
        "SELECT min(created_at) AS t FROM run_events WHERE run_id = ? AND event = 'batch_done:0'", [sync]
    ).column("t")[0]
    assert batch_done.as_py() <= first_step.as_py()


def test_a_run_resumed_from_another_folder_continues_in_the_store_it_was_pointed_at(tmp_path, monkeypatch, capsys):
    """The run starts in folder `a` with relative paths (its rollout side only: one batch decoded, no
    learner step yet); `marsrl train --resume` from folder `b`, pointed at `a`'s store, must continue
    that run there: no new store or outputs in `b`, the decoded batch not decoded again, the
    checkpoints under `a`'s output folder."""
    import yaml

    from flows.cli import main
    from marsrl_core.store import SegmentStore

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cfg = small_config(tmp_path, **{"rollout.max_turns": 2, "data.num_batches": 2, "learner.max_steps": 1})
    relative = cfg.model_dump(mode="json")
    relative["store"] |= {"catalog_url": "sqlite:marsrl/lake.sqlite", "data_path": "marsrl/lake_data"}
    relative |= {"output_dir": "marsrl"}
    relative["tracking"]["mlflow_tracking_uri"] = "sqlite:///mlflow.db"
    path = tmp_path / "relative.yaml"
    path.write_text(yaml.safe_dump(relative))
    monkeypatch.chdir(tmp_path / "a")
    assert main(["rollout", "--config", str(path), "--run-id", "moved", "--batches", "0"]) == 0
    store = SegmentStore(f"sqlite:{tmp_path}/a/marsrl/lake.sqlite", f"{tmp_path}/a/marsrl/lake_data", create=False)
    decoded = store.count("segments", "moved")
    assert decoded > 0 and store.latest_version("moved") is None

    monkeypatch.chdir(tmp_path / "b")
    where = [
        "--set",
        f"store.catalog_url=sqlite:{tmp_path}/a/marsrl/lake.sqlite",
        "--set",
        f"store.data_path={tmp_path}/a/marsrl/lake_data",
    ]
    assert main(["train", *where, "--resume", "moved", "--results", ""]) == 0
    assert "resuming run moved" in capsys.readouterr().out
    assert list((tmp_path / "b").iterdir()) == []  # nothing created where the resume ran
    assert store.latest_version("moved")[0] == 1
    assert store.latest_version("moved")[1].startswith(str(tmp_path / "a" / "marsrl" / "checkpoints"))
    batch_0 = store.query("SELECT count(*) AS n FROM samples WHERE run_id = 'moved' AND problem_id LIKE 'b0-%'")
    first = (
        store.query(
            "SELECT count(*) AS n FROM samples s JOIN segments g USING (run_id, sample_id) "
            "WHERE s.run_id = 'moved' AND s.problem_id LIKE 'b0-%'"
        )
        .column("n")[0]
        .as_py()
    )
    assert batch_0.column("n")[0].as_py() > 0 and first == decoded  # batch 0 was not decoded again


def test_a_learner_process_gets_the_prefect_api_only_where_one_is_configured():
    """`train_flow` called from Python runs on Prefect's temporary server, which has no URL to pass on:
    the learner process (`learner.nproc > 1`) must then start its own, not be told the API is at
    "None"."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.train import learner_prefect_env

    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:4200/api"}):
        assert learner_prefect_env() == {"PREFECT_API_URL": "http://127.0.0.1:4200/api"}
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        assert learner_prefect_env() == {}


def test_non_finite_rollout_log_probs_stop_the_run_in_one_line(tmp_path, monkeypatch, capsys, terminal):
    """An engine whose log-probs come back non-finite (as fp16 logits that overflow would give; here a
    NaN put into the third stage's first segment) stops the run: `marsrl train` exits 1 with one line
    naming the agent, the policy version and the settings, and no traceback; nothing of that stage is
    stored, what was stored before it is whole, and the run records why."""
    import dataclasses

    from flows.cli import main
    from marsrl_core.config import config_to_yaml
    from marsrl_core.rollout import scheduler
    from marsrl_core.runtime.events import DIVERGED
    from marsrl_core.store import SegmentStore
    from tests.configs import assert_exactly_once

    real, calls = scheduler.decode_segment, []

    def overflowing(*args, **kwargs):
        segments = real(*args, **kwargs)
        calls.append(len(segments))
        if len(calls) == 3:
            segments[0] = dataclasses.replace(segments[0], logprobs=[math.nan] * len(segments[0].logprobs))
        return segments

    monkeypatch.setattr(scheduler, "decode_segment", overflowing)
    cfg = small_config(tmp_path, **{"data.num_batches": 2, "learner.max_steps": 2})
    path = tmp_path / "nan.yaml"
    path.write_text(config_to_yaml(cfg))
    assert main(["train", "--config", str(path), "--run-id", "nan", "--results", ""]) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and re.match(
        r"error: rollout: a (solver|verifier|corrector) output decoded under policy version 0 has non-finite "
        r"log-probs, .* "
        r"look at learner.learning_rate and learner.max_weight_abs$",
        errors[0],
    ), err
    assert "Traceback" not in err + terminal.getvalue()
    store = SegmentStore.from_config(cfg.store)
    assert store.event_details("nan", DIVERGED) == [errors[0].removeprefix("error: ")]
    # Two stages stored; of the third nothing, and no stage after it.
    assert len(calls) == 3 and store.count("segments", "nan") == sum(calls[:2])
    assert_exactly_once(store, "nan")
