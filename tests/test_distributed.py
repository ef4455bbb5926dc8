"""A learner on two ranks (torch.distributed, gloo, started by `torch.distributed.run`) computes the
update of one process on the same groups: data parallel and FSDP2, fp32, within 1e-5; the sharded
learner's consolidated checkpoint loads with `from_pretrained` and into the `hf` engine and scores
tokens as the one-process learner's model does; it resumes with the same number of ranks and says
what happens with another.

Two models: the tiny model (untied embeddings: FSDP2 gives the input and output matrices units of
their own), and for the resume a tied one whose MLP width (255) does not split evenly over two ranks,
trained with gradient checkpointing and a KL term against a frozen reference model."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from marsrl_core.config import load_config
from marsrl_core.demo.tiny import build_tiny_model
from marsrl_core.engines.hf import HFEngine, load_safetensors_state
from marsrl_core.learn.checkpoint import CheckpointError, load_checkpoint
from marsrl_core.learn.learner import Learner
from marsrl_core.learn.scoring import PackedBatch, TokenScorer
from marsrl_core.store import SegmentStore
from tests.configs import assert_exactly_once, process_config_file
from tests.rollout_helpers import digit_fraction, sample_groups

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
STEPS = 2
REFERENCE = "learner.beta=0.05"  # the resume's runs: a KL term against a frozen reference model (sharded too)


def _overrides(tmp_path, *extra):
    return [
        f"store.catalog_url=sqlite:{tmp_path}/lake.sqlite",
        f"store.data_path={tmp_path}/data",
        "rollout.temperature=1.0",
        "learner.learning_rate=1e-3",
        "learner.warmup_steps=0",
        "learner.max_grad_norm=0.5",  # clipping is on: the norm must be the global one
        # Adam moves a weight by about the learning rate whatever its gradient's size, so a near-zero
        # gradient, summed in another order by two ranks, would move by a different part of it: a
        # larger epsilon keeps such updates proportional to the gradient.
        "learner.adam_epsilon=1e-6",
        "learner.micro_batch_tokens=40",  # several micro-batches per rank, not as many on each
        "learner.collective_timeout_s=120",
        *extra,
    ]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny model, and the same seeded groups of two agents under one run per learner."""
    tmp = tmp_path_factory.mktemp("dist")
    folder = build_tiny_model(tmp / "tiny", max_position_embeddings=128, seed=0)
    odd = build_tiny_model(
        tmp / "odd", max_position_embeddings=128, seed=0, tie_word_embeddings=True, intermediate_size=255
    )
    cfg = load_config("tiny", None, _overrides(tmp))
    store = SegmentStore.from_config(cfg.store)
    engine = HFEngine.from_pretrained(folder)
    steps: dict[str, list] = {}
    for run in ("one", "dp", "fsdp", "one-odd", "fsdp-resume", "sp", "dp-sp"):
        steps[run] = []
        for step in range(STEPS):
            groups = []
            for agent, prompt, tokens in (("solver", "S|", 12), ("verifier", "V|1+2|", 6)):
                groups += sample_groups(
                    engine, store, run, agent, prompt, groups=2, size=3, seed=step, reward_fn=digit_fraction,
                    max_tokens=tokens,
                )  # fmt: skip
            steps[run].append([{"group_id": g.group_id, "agent": g.agent, "sample_ids": g.sample_ids} for g in groups])
    from marsrl_core.store import TrainableGroup

    one = {}
    with_reference = load_config("tiny", None, _overrides(tmp, REFERENCE))
    for run, model, run_cfg in (("one", folder, cfg), ("one-odd", odd, with_reference)):
        one[run] = Learner(run_cfg, store, run, model, tmp / f"ckpt-{run}", engine.tokenizer)
        for step_groups in steps[run]:
            one[run].train_step([TrainableGroup(g["group_id"], g["agent"], g["sample_ids"]) for g in step_groups])
    store.close()
    return {"tmp": tmp, "folder": folder, "odd": odd, "steps": steps, "one": one["one"], "one-odd": one["one-odd"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(setup, run, *extra, resume=False, limit=None, launcher="torchrun", folder="folder", nproc=2):
    """`nproc` ranks of tests/distributed_steps.py on `setup[folder]`, started by torchrun or by
    `accelerate launch` with the eight-GPU config of deployments/accelerate (two processes here); each
    rank records its micro-batches in tmp/record-RUN."""
    tmp = setup["tmp"]
    spec = {
        "overrides": _overrides(tmp, *extra),
        "folder": str(setup[folder]),
        "run": run,
        "checkpoints": str(tmp / f"ckpt-{run}"),
        "steps": setup["steps"][run],
        "resume": resume,
        "limit": limit,
        "record": str(tmp / f"record-{run}"),
    }
    (tmp / f"record-{run}").mkdir(exist_ok=True)
    path = tmp / f"spec-{run}.json"
    path.write_text(json.dumps(spec))
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    if launcher == "accelerate":
        config = ROOT / "deployments" / "accelerate" / "eight-gpus.yaml"
        cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(config)]
        cmd += ["--num_processes", str(nproc), "--main_process_port", str(_free_port())]
    proc = subprocess.run(
        [*cmd, str(ROOT / "tests" / "distributed_steps.py"), str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp / f"ckpt-{run}" / f"v{limit or STEPS}"


def _trained(setup, mode):
    """The final checkpoint of `mode`'s two-rank run (launched once per module)."""
    if mode not in setup:
        setup[mode] = _launch(setup, mode, f"learner.fsdp={mode == 'fsdp'}")
    return setup[mode]


def _max_diff(checkpoint: Path, model) -> float:
    saved = load_safetensors_state(checkpoint / "policy")
    return max(float((saved[k] - v.detach()).abs().max()) for k, v in model.state_dict().items() if k in saved)


@pytest.mark.parametrize("mode", ["dp", "fsdp"])
def test_two_ranks_compute_the_one_process_update(setup, mode):
    checkpoint = _trained(setup, mode)
    one = setup["one"].models["policy"]
    start = load_safetensors_state(setup["folder"])
    moved = max(float((start[k] - v.detach()).abs().max()) for k, v in one.state_dict().items() if k in start)
    diff = _max_diff(checkpoint, one)
    print(f"{mode}: max |2 ranks - 1 process| = {diff:.2e} (the steps moved weights by up to {moved:.2e})")
    assert moved > 1e-3 and diff <= 1e-5


def test_ranks_with_unequal_shares_run_as_many_micro_batches(setup):
    """The sharded run's ranks got different numbers of samples and lengths (several micro-batches of 40
    tokens each): their own micro-batches differ in number, yet every rank ran as many forwards (each
    one is a collective), and the run ended within its timeout instead of hanging."""
    record = _trained(setup, "fsdp").parents[1] / "record-fsdp"
    ranks = [json.loads((record / f"rank{r}.json").read_text()) for r in range(2)]
    print(ranks)
    assert ranks[0]["own"] != ranks[1]["own"]
    assert ranks[0]["forwards"] == ranks[1]["forwards"] >= max(sum(r["own"]) for r in ranks)


@pytest.mark.parametrize(
    "nproc, layout",
    [
        (2, ("learner.fsdp=true", "learner.gradient_checkpointing=true")),  # 1 data x 2 sequence, sharded
        (4, ("learner.fsdp=false",)),  # 2 data x 2 sequence, replicated
    ],
    ids=["1x2-fsdp", "2x2"],
)
def test_sequence_parallel_ranks_compute_the_one_process_update(setup, nproc, layout):
    """Ulysses sequence parallelism (`learner.sequence_parallel=2`): each rank's decoder runs half of
    every padding-free row, attention heads exchanged by all-to-all; after two steps the parameters are
    those of one process (padded rows) within 1e-5."""
    run = "sp" if nproc == 2 else "dp-sp"
    free = ("learner.padding_free=true", "learner.sequence_parallel=2")
    checkpoint = _launch(setup, run, *free, *layout, nproc=nproc)
    for rank in range(nproc):  # every rank ran half of each row (and a row of odd length one padding token)
        rows = json.loads((setup["tmp"] / f"record-{run}" / f"rank{rank}.json").read_text())["rows"]
        assert rows and all(ran == -(-tokens // 2) for tokens, ran in rows), rows
    diff = _max_diff(checkpoint, setup["one"].models["policy"])
    print(f"{nproc} ranks, sequence_parallel=2: max |ranks - 1 process| = {diff:.2e}")
    assert diff <= 1e-5


def test_the_sequence_parallel_scorer_gives_one_process_log_probs_and_gradients(setup):
    """`learner.sequence_parallel=2` on two ranks (tests/sequence_parallel_ranks.py): rows whose tokens
    split unevenly, one whose first half holds no response token, for the tiny model and for one with a
    single key/value head (repeated for the exchange); log-probs and summed gradients within 1e-5."""
    kv1 = build_tiny_model(setup["tmp"] / "kv1", hidden_size=64, num_heads=2, num_key_value_heads=1, seed=0)
    out = setup["tmp"] / "sp-scorer.json"
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(ROOT / "tests" / "sequence_parallel_ranks.py"), str(out), str(setup["folder"]), str(kv1)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    print(json.dumps(results, indent=1))
    assert len(results) == 4
    for case, r in results.items():
        assert r["gradient_scale"] > 1e-3 and r["logprobs"] <= 1e-5 and r["gradients"] <= 1e-5, case


def test_a_sharded_checkpoint_is_a_whole_hugging_face_model(setup):
    checkpoint = _trained(setup, "fsdp")
    loaded = AutoModelForCausalLM.from_pretrained(checkpoint / "policy", use_safetensors=True)
    engine = HFEngine.from_pretrained(checkpoint / "policy")
    ids = engine.tokenizer("S|1+2|", add_special_tokens=False)["input_ids"]
    batch = PackedBatch.build([ids[:3]], [ids[3:]], torch.device("cpu"))
    with torch.no_grad():
        reference = TokenScorer(setup["one"].models["policy"], 1024, 1.0)(batch)[0]
        assert torch.allclose(TokenScorer(loaded, 1024, 1.0)(batch)[0], reference, atol=1e-5)
        assert torch.allclose(TokenScorer(engine.model, 1024, 1.0)(batch)[0], reference, atol=1e-5)


def test_a_sharded_learner_resumes_with_its_ranks_and_refuses_another_count(setup):
    tmp = setup["tmp"]
    sharded = ("learner.fsdp=true", "learner.gradient_checkpointing=true", REFERENCE)
    _launch(setup, "fsdp-resume", *sharded, limit=1, folder="odd")
    first = _launch(setup, "fsdp-resume", *sharded, resume=True, launcher="accelerate", folder="odd")
    # The resumed run trained only step 2, from the committed step 1 (its AdamW state in uneven shards),
    # recomputing activations in backward: it ends where the uninterrupted one-process run does.
    assert _max_diff(first, setup["one-odd"].models["policy"]) <= 1e-5
    cfg = load_config("tiny", None, _overrides(tmp))
    one = Learner(cfg, None, "x", setup["odd"], tmp / "unused")
    with pytest.raises(CheckpointError, match="sharded over 2 ranks, resumed by an unsharded one"):
        load_checkpoint(first, one.models, one.optimizers, one.schedulers)
    older = tmp / "older-layout"  # a sharded checkpoint whose rank files held only AdamW state
    shutil.copytree(first, older)
    meta = json.loads((older / "trainer_state.json").read_text())
    meta["optimizer_shards"] = meta.pop("rank_shards")
    (older / "trainer_state.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="older layout"):
        load_checkpoint(older, one.models, one.optimizers, one.schedulers, rank=0, world_size=2)


def test_marsrl_train_with_a_two_rank_learner(tmp_path):
    """`marsrl train` with `learner.nproc=2` (FSDP2): its learner runs as `marsrl learn` on two ranks
    beside the rollouts; the versions reach the step budget, both evaluations are recorded, the last
    checkpoint loads, and no sample is consumed twice."""
    learner = {"groups_per_step": 2, "downstream_groups_per_step": 2, "max_steps": 3, "learning_rate": 1e-3}
    learner |= {"warmup_steps": 0, "nproc": 2, "fsdp": True, "collective_timeout_s": 120}
    path = process_config_file(
        tmp_path,
        "ranks",
        data={"num_batches": 12},
        learner=learner,
        evaluation={"num_problems": 2, "k": 1, "max_rounds": 1},
        sft={"enabled": False},
    )
    env = os.environ | {"PREFECT_LOGGING_LEVEL": "WARNING", "PREFECT_HOME": str(tmp_path / "prefect")}
    marsrl = [sys.executable, "-m", "flows.cli", "train", "--config", str(path), "--run-id", "ranks", "--results", ""]
    run = subprocess.run(marsrl, capture_output=True, text=True, timeout=900, env=env | {"OMP_NUM_THREADS": "1"})
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert "learner stopped after step 3" in output and "run ranks: 3 learner steps" in output, output[-3000:]
    store = SegmentStore(f"sqlite:{tmp_path}/lake.sqlite", f"{tmp_path}/data", create=False)
    try:
        version, uri = store.latest_version("ranks")
        assert version == 3
        assert store.evaluation("ranks", "before") is not None and store.evaluation("ranks", "after") is not None
        assert_exactly_once(store, "ranks")
    finally:
        store.close()
    HFEngine.from_pretrained(Path(uri) / "policy")  # the consolidated checkpoint of the sharded learner


def test_a_rank_killed_mid_step_takes_the_learner_down_and_the_run_resumes(tmp_path):
    """Rank 1 is SIGKILLed after its update of step 2: the launcher stops rank 0 too, nothing of step 2
    is committed; a new `marsrl learn --nproc 2` resumes from version 1 and reaches the budget, and no
    sample is consumed twice."""
    learner = {"groups_per_step": 2, "downstream_groups_per_step": 2, "max_steps": 3, "learning_rate": 1e-3}
    learner |= {"warmup_steps": 0, "collective_timeout_s": 120}
    path = process_config_file(tmp_path, "kill", data={"num_batches": 12}, learner=learner)
    env = os.environ | {"PREFECT_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}
    marsrl = [sys.executable, "-m", "flows.cli"]
    learn = [*marsrl, "learn", "--config", str(path), "--run-id", "kill", "--idle-timeout", "240", "--nproc", "2"]
    rollout = subprocess.Popen(
        [*marsrl, "rollout", "--config", str(path), "--run-id", "kill", "--finish"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env | {"PREFECT_HOME": str(tmp_path / "prefect-rollout")},
    )
    learner_env = env | {"PREFECT_HOME": str(tmp_path / "prefect-learner")}
    killed = subprocess.run(
        learn, capture_output=True, text=True, timeout=600, env=learner_env | {"MARSRL_CRASH_AT": "learner.update:2@1"}
    )
    assert killed.returncode != 0
    # Step 2 died before its checkpoint: only version 1 exists (the store is read once every process is
    # done; opening its SQLite catalog from this process beside the writers is not what a user does).
    checkpoints = tmp_path / "out" / "checkpoints" / "kill"
    assert (checkpoints / "v1").is_dir() and not (checkpoints / "v2").exists()
    resumed = subprocess.run(learn, capture_output=True, text=True, timeout=600, env=learner_env)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    out, _ = rollout.communicate(timeout=600)
    assert rollout.returncode == 0, out[-3000:]
    store = SegmentStore(f"sqlite:{tmp_path}/lake.sqlite", f"{tmp_path}/data", create=False)
    try:
        assert store.latest_version("kill")[0] == 3
        versions = store.query("SELECT version FROM policy_versions WHERE run_id = 'kill' ORDER BY 1")
        assert versions.column("version").to_pylist() == [1, 2, 3]  # step 2 committed once, by the resumed run
        assert_exactly_once(store, "kill")
    finally:
        store.close()


HUNG_RANK = """
import sys, time
sys.path.insert(0, {root!r})
from marsrl_core.learn import distributed
ranks = distributed.init_ranks(timeout_s=5)
if ranks.rank == 1:
    time.sleep(120)  # hung: it never joins the collective
start = time.monotonic()
try:
    distributed.max_over_ranks(1)
except Exception as err:
    print(f"rank 0 failed after {{time.monotonic() - start:.0f}} s: {{type(err).__name__}}", flush=True)
    sys.exit(3)
"""


def test_a_hung_rank_fails_the_collective_at_its_timeout(tmp_path):
    script = tmp_path / "hung.py"
    script.write_text(HUNG_RANK.format(root=str(ROOT)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    start = time.monotonic()
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=os.environ | {"OMP_NUM_THREADS": "1"})
    output = run.stdout + run.stderr
    assert run.returncode != 0 and "rank 0 failed after" in output, output[-3000:]
    assert time.monotonic() - start < 100  # not the hung rank's 120 s: the launcher stopped it
