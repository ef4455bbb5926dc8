"""`marsrl train` killed with SIGKILL again and again, each time resumed with `--resume`.

A seeded schedule of 6 kills, one of each kind, lands across rollout, training and checkpoint writing: at crash points
(`marsrl_core.faults`: after a rollout stage decoded but before its store append, after an optimizer
update, half-way through a checkpoint, between a checkpoint's rename and its store commit, inside the
background write that makes a committed version durable, each at a random arrival) and at random
times. A durable checkpoint is written every third step (`save_every`),
so most kills land between two durable versions and the resume voids the steps after the last one.
Every kill must land (the process dies of SIGKILL). After every kill the store is read from this
process; at the end the run must hold every segment seen after any kill, no sample consumed by two
committed steps, loadable weights for every committed version, a loadable checkpoint for every
durable one, and exactly the step budget.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from marsrl_core.learn.checkpoint import load_checkpoint
from marsrl_core.learn.checkpoint_folders import is_durable
from marsrl_core.store import SegmentStore
from tests.configs import assert_exactly_once, process_config_file

MAX_STEPS = 12
SAVE_EVERY = 3  # durable versions 3, 6, 9, 12; a resume voids the weights-only ones after the last


def _config(tmp_path: Path) -> Path:
    # 16 batches held ~96 groups (2 Solver, up to 4 Verifier and 4 Corrector groups each) and a step takes
    # up to 4 per agent; 12 steps used ~90 of them. 24 leave a margin; the train flow submits no batch
    # once the learner has its steps, so the spare ones cost nothing. Every group is trained on
    # (`learner.max_trained_age: None`): a learner restarted a dozen times lags its rollouts, and groups
    # dropped as stale made runs end short of the budget (10 of 12 steps in one CI run, 9 in another),
    # which says nothing about crash safety. Dropping stale groups is tested in test_learner.
    return process_config_file(
        tmp_path,
        "crash",
        data={"num_batches": 24},
        learner={
            "groups_per_step": 4,
            "downstream_groups_per_step": 4,
            "max_steps": MAX_STEPS,
            "learning_rate": 1e-3,
            "warmup_steps": 0,
            "max_trained_age": None,
            "save_total_limit": None,  # every version stays on disk, so the test can load each one
            "save_every": SAVE_EVERY,
        },
        evaluation={"num_problems": 2, "k": 1, "max_rounds": 1},
        sft={"enabled": False},
    )


ROLLOUT_POINTS = ("rollout.append",)
LEARNER_POINTS = ("learner.update", "checkpoint.write", "checkpoint.commit", "checkpoint.durable")
KINDS = [*ROLLOUT_POINTS, *LEARNER_POINTS, "timer"]
KILLS = len(KINDS)  # one of each kind: every phase is hit (more kills draw kinds at random)


def _next_kill(rng: random.Random, landed: list[str], rollouts_finished: bool, steps_done: int) -> tuple[str, float]:
    """(crash point, n-th arrival) or ("timer", seconds): each kind in turn at first (so every phase is
    hit), then drawn at random. Only points a resumed run still reaches are drawn: the rollouts'
    while they have not finished and the learner has half its steps to go (the train flow stops
    admitting problems once the learner has its steps, so late in a run few appends are left), the
    learner's at an arrival within the steps it has left."""
    left = MAX_STEPS - steps_done
    kinds = [k for k in KINDS if k not in ROLLOUT_POINTS or (not rollouts_finished and left > MAX_STEPS // 2)]
    kinds = [k for k in kinds if k not in LEARNER_POINTS or left > 0]
    unhit = [k for k in kinds if k not in landed]
    kind = unhit[0] if unhit else rng.choice(kinds)
    if kind == "timer":
        return kind, rng.uniform(5.0, 12.0)  # an uninterrupted run takes ~45 s here, ~8 s of it start-up
    if kind == "checkpoint.durable":  # the next durable version (every third step, and the last) is reached
        return kind, 1
    return kind, rng.randint(1, 3) if kind in ROLLOUT_POINTS else rng.randint(1, min(2, left))


def _stored(store_paths: tuple[str, str]) -> tuple[bool, bool, int, set[tuple[str, int]]]:
    """(whether the run is recorded, whether its rollouts finished, its learner's committed steps, its
    segments), read from this process."""
    if not Path(store_paths[0].removeprefix("sqlite:")).exists():
        return False, False, 0, set()
    store = SegmentStore(*store_paths, create=False)
    try:
        rows = store.query("SELECT sample_id, segment_index FROM segments").to_pylist()
        latest = store.latest_version("crashy")
        return (
            store.run_config("crashy") is not None,
            store.has_event("crashy", "rollouts_finished"),
            latest[0] if latest else 0,
            {(r["sample_id"], r["segment_index"]) for r in rows},
        )
    finally:
        store.close()


@pytest.mark.slow
def test_train_survives_a_sigkill_in_every_phase_and_resumes_without_loss(tmp_path):
    path = _config(tmp_path)
    store_paths = (f"sqlite:{tmp_path}/lake.sqlite", f"{tmp_path}/data")
    env = {**os.environ, "PREFECT_LOGGING_LEVEL": "WARNING", "PREFECT_HOME": str(tmp_path / "prefect")}
    marsrl = [sys.executable, "-m", "flows.cli", "train", "--config", str(path)]
    seen: set[tuple[str, int]] = set()
    rng, landed = random.Random(7), []
    started = rollouts_finished = False
    steps_done = 0
    while len(landed) < KILLS:
        point, when = _next_kill(rng, landed, rollouts_finished, steps_done)
        command = [*marsrl, "--resume", "crashy"] if started else [*marsrl, "--run-id", "crashy"]
        run_env = env | ({} if point == "timer" else {"MARSRL_CRASH_AT": f"{point}:{int(when)}"})
        process = subprocess.Popen(
            command, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        if point == "timer":
            time.sleep(when)
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=600)
        try:  # what the killed process left behind (a child keeps its stdout open)
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = process.communicate(timeout=60)
        assert process.returncode == -signal.SIGKILL, (
            f"kill {len(landed)} at {point}:{when} did not land:\n{out[-3000:]}"
        )
        landed.append(point)
        # A kill before the run was recorded: start anew.
        started, rollouts_finished, steps_done, now = _stored(store_paths)
        assert seen <= now, f"segments lost after the kill at {point}"
        seen = now
    assert set(landed) == set(KINDS)

    final = subprocess.run([*marsrl, "--resume", "crashy"], env=env, capture_output=True, text=True, timeout=900)
    assert final.returncode == 0, final.stdout[-3000:] + final.stderr[-3000:]

    assert seen <= _stored(store_paths)[3]
    store = SegmentStore(*store_paths, create=False)
    assert_exactly_once(store, "crashy")
    versions = store.query(
        "SELECT version, checkpoint_uri FROM policy_versions WHERE run_id = 'crashy' ORDER BY version"
    ).to_pylist()
    assert [v["version"] for v in versions] == list(range(1, MAX_STEPS + 1))
    steps = store.query("SELECT count(DISTINCT step) AS n FROM train_steps WHERE run_id = 'crashy'")
    assert steps.column("n")[0].as_py() == MAX_STEPS
    import torch
    from transformers import AutoModelForCausalLM

    for row in versions:  # every version's weights load; the durable ones' trainer state too
        model = AutoModelForCausalLM.from_pretrained(Path(row["checkpoint_uri"]) / "policy")
        assert is_durable(Path(row["checkpoint_uri"])) == (row["version"] % SAVE_EVERY == 0)
        if row["version"] % SAVE_EVERY:
            continue
        optimizer = torch.optim.AdamW(model.parameters())
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        step = load_checkpoint(
            Path(row["checkpoint_uri"]), {"policy": model}, {"policy": optimizer}, {"policy": scheduler}
        )
        assert step == row["version"]
    rollbacks = store.query("SELECT detail FROM run_events WHERE run_id = 'crashy' AND event = 'rolled_back'")
    print(f"resumes that voided weights-only versions: {rollbacks.column(0).to_pylist()}")
    assert "resuming run crashy" in final.stdout


def _segments(store_paths: tuple[str, str], run_id: str) -> dict[tuple[str, int], str | None]:
    """(sample id, segment index) -> the segment's finish reason ("length": the sample went on decoding)."""
    store = SegmentStore(*store_paths, create=False)
    try:
        rows = store.query(
            "SELECT sample_id, segment_index, finish_reason FROM segments WHERE run_id = ?", [run_id]
        ).to_pylist()
        return {(r["sample_id"], r["segment_index"]): r["finish_reason"] for r in rows}
    finally:
        store.close()


@pytest.mark.slow
def test_sigterm_stops_train_at_the_next_stage_and_a_resume_continues_the_unfinished_samples(tmp_path):
    """SIGTERM (what a cluster scheduler sends before SIGKILL) stops `marsrl train` within a rollout
    stage: the batches being decoded stop unfinished (before, they decoded to their end, and the learner
    then waited out its hour-long idle timeout), and a resume continues their samples from their stored
    segments instead of decoding them again."""
    # Two batches, both decoding at once, of about 45 stages each (4-token segments).
    path = process_config_file(
        tmp_path,
        "stopped",
        data={"num_batches": 2},
        rollout={
            "problems_per_batch": 4,
            "segment_tokens": 4,
            "solver_max_tokens": 80,
            "verifier_max_tokens": 48,
            "corrector_max_tokens": 48,
            "max_turns": 3,
        },
        learner={"max_steps": 1000},
        evaluation={"num_problems": 2, "k": 1, "max_rounds": 1},
        sft={"enabled": False},
    )
    store_paths = (f"sqlite:{tmp_path}/lake.sqlite", f"{tmp_path}/data")
    store = SegmentStore(*store_paths)  # the catalog exists before the run opens it: no race over creating it
    env = {**os.environ, "PREFECT_LOGGING_LEVEL": "WARNING", "PREFECT_HOME": str(tmp_path / "prefect")}
    marsrl = [sys.executable, "-m", "flows.cli", "train", "--config", str(path), "--results", ""]
    log = tmp_path / "train.log"  # a file, not a pipe: the process's children keep a pipe open after it exits
    process = subprocess.Popen(
        [*marsrl, "--run-id", "stopped"],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while store.count("segments", "stopped") == 0:  # the first stage's segments are stored
            assert process.poll() is None and time.monotonic() < deadline, "no segments were stored"
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail("marsrl train was still running 120 s after SIGTERM")
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        store.close()
    assert process.returncode == -signal.SIGTERM, log.read_text()[-3000:]
    assert "RolloutInterrupted" in log.read_text(), "no rollout turn was stopped at a stage boundary"
    at_stop = _segments(store_paths, "stopped")
    store = SegmentStore(*store_paths, create=False)
    try:
        assert not any(store.has_event("stopped", f"batch_done:{b}") for b in range(2)), (
            "a batch decoded to its end after SIGTERM"
        )
    finally:
        store.close()
    finished = {sample for (sample, _), reason in at_stop.items() if reason != "length"}
    unfinished = {sample for sample, _ in at_stop} - finished
    assert unfinished, "every stored sample had finished: the stop came after the decoding it should cut short"

    resumed = subprocess.run([*marsrl, "--resume", "stopped"], env=env, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    after = _segments(store_paths, "stopped")
    assert at_stop.keys() <= after.keys(), "segments stored before the stop were lost"
    for sample in unfinished:  # continued where it stopped: later segments, the last one finished
        indices = sorted(i for s, i in after if s == sample)
        assert indices == list(range(len(indices))) and len(indices) > max(i for s, i in at_stop if s == sample)
        assert after[(sample, indices[-1])] in ("stop", "budget")
    store = SegmentStore(*store_paths, create=False)
    try:
        assert all(store.has_event("stopped", f"batch_done:{b}") for b in range(2))
        assert_exactly_once(store, "stopped")
    finally:
        store.close()


@pytest.mark.slow
def test_train_goes_on_when_its_store_process_dies_again_and_again(tmp_path):
    """Every store child `marsrl train` starts is SIGKILLed at its 15th call (the `store.call` crash
    point): each call is sent again to a new child, the writes through `replay`, so none is written
    twice. The run reaches its budget, each sample trained at most once."""
    steps = 6
    path = process_config_file(
        tmp_path,
        "flaky",
        data={"num_batches": 12},
        learner={"groups_per_step": 2, "downstream_groups_per_step": 2, "max_steps": steps, "max_trained_age": None},
        evaluation={"num_problems": 2, "k": 1, "max_rounds": 1},
        sft={"enabled": False},
    )
    env = {
        **os.environ,
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "MARSRL_CRASH_AT": "store.call:15",
    }
    marsrl = [sys.executable, "-m", "flows.cli", "train", "--config", str(path), "--run-id", "flaky", "--results", ""]
    run = subprocess.run(marsrl, env=env, capture_output=True, text=True, timeout=600)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert output.count("again to a new one") >= 3, output[-4000:]  # replayed calls
    store = SegmentStore(f"sqlite:{tmp_path}/lake.sqlite", f"{tmp_path}/data", create=False)
    try:
        versions = store.query("SELECT version FROM policy_versions WHERE run_id = 'flaky' ORDER BY 1")
        assert versions.column("version").to_pylist() == list(range(1, steps + 1))
        assert_exactly_once(store, "flaky")
        assert store.evaluation("flaky", "before") is not None and store.evaluation("flaky", "after") is not None
    finally:
        store.close()


def test_no_child_of_train_outlives_it_when_only_it_is_killed(tmp_path):
    """SIGKILL of `marsrl train`'s own process alone (as the OOM killer does): its local Prefect server
    and its store process end too (nothing is left behind to hold ports, files or memory)."""
    import psutil

    path = process_config_file(
        tmp_path, "orphans", learner={"max_steps": 1000}, evaluation={"num_problems": 2, "k": 1}, sft={"enabled": False}
    )
    env = {**os.environ, "PREFECT_LOGGING_LEVEL": "WARNING", "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    marsrl = [sys.executable, "-m", "flows.cli", "train", "--config", str(path), "--run-id", "orphans", "--results", ""]
    log = tmp_path / "train.log"
    process = subprocess.Popen(marsrl, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    main = psutil.Process(process.pid)

    def prefect_server() -> bool:
        return any(re.search(r"prefect[ .]server", " ".join(c.cmdline())) for c in main.children(recursive=True))

    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "data").exists() or not prefect_server():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        time.sleep(2.0)  # into the run: the store process serves, the before evaluation decodes
        children = main.children(recursive=True)
        commands = [" ".join(c.cmdline()) for c in children]
        assert any("marsrl_core.store.process" in c for c in commands), commands
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
        gone, alive = psutil.wait_procs(children, timeout=60)
        assert not alive, [" ".join(p.cmdline()) for p in alive]
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
