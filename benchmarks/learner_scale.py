"""Learner scaling on the CPU: the same learner steps in one process and on two FSDP2 ranks (gloo),
for a ~110M-parameter Llama-shaped model built from a config, whose parameters, gradients and AdamW
state (about 1.8 GB in fp32) dominate its memory. Three precision set-ups, each for both learners:
- `bf16`: as the paper preset trains: fp32 master weights and AdamW state, bf16 compute (autocast in
  one process, FSDP2's `MixedPrecisionPolicy` on the ranks), gradient checkpointing;
- `fp32`: fp32 throughout with gradient checkpointing; here the two learners must reach the same
  parameters (`max_param_diff`), as tests/test_distributed.py checks on a tiny model;
- `fp32_no_checkpointing`: fp32, activations kept.

Each learner runs in its own processes (`--worker`; the two ranks under torch.distributed.run, one
thread each, so both set-ups use this machine's two cores). Memory is the anonymous resident set
(tensors, not library code), sampled every 5 ms by a thread, minus its size before the learner was
built: `peak_load_mb` while it loads and shards the model, `peak_train_mb` during its steps' forward,
backward and AdamW update, `peak_checkpoint_mb` while it writes the checkpoint (rank 0 gathers the
weights whole in the model's dtype, every rank writes its own shards). Both learners train on the same
stored groups, so their checkpoints must hold the same parameters (`max_param_diff`).

Run: `python benchmarks/learner_scale.py` (about 10 minutes). Writes benchmarks/results/learner_scale.json
with fsdp2_peak_ratio (the larger rank's peak during the steps / the one process's, `bf16`),
max_param_diff (`fp32`), and per set-up (`setups`): its peak ratios during the steps and at the
checkpoint, its parameter difference, step times and the peaks per rank. The loading peaks are not
compared: one process's weights stay memory-mapped file pages (not anonymous memory) until its first
update writes them, while the ranks' shards are copies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

STEPS = 2
GROUPS, GROUP_SIZE = 4, 4  # per step
PROMPT_TOKENS, RESPONSE_TOKENS = 64, 192
VOCAB = 16000
SETUPS = {
    "bf16": ["model.dtype=bfloat16", "learner.gradient_checkpointing=true"],
    "fp32": ["learner.gradient_checkpointing=true"],
    "fp32_no_checkpointing": ["learner.gradient_checkpointing=false"],
}
RUNS = [f"{learner}-{setup}" for setup in SETUPS for learner in ("one", "fsdp2")]  # each commits its own versions
MODEL = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 2048}


class ResidentPeak:
    """The peak anonymous resident memory of this process (`RssAnon`: heap and anonymous mappings, where
    tensors live; not the shared libraries' code, which grows as new kernels run), sampled by a thread."""

    def __init__(self):
        self.peak, self.running = self.now(), True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def now(self) -> int:
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith("RssAnon:"))
        return int(line.split()[1]) * 1024

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, self.now())
            time.sleep(0.005)

    def take(self) -> int:
        """The peak since the last take (or the start), and start anew."""
        peak, self.peak = max(self.peak, self.now()), self.now()
        return peak


def worker(spec_path: str) -> None:
    from marsrl_core.config import load_config
    from marsrl_core.learn.distributed import init_ranks, shutdown
    from marsrl_core.learn.learner import Learner
    from marsrl_core.store import SegmentStore, TrainableGroup

    spec = json.loads(Path(spec_path).read_text())
    cfg = load_config("tiny", None, spec["overrides"])
    ranks = init_ranks(cfg.learner.collective_timeout_s)
    main = ranks is None or ranks.main
    store = SegmentStore.from_config(cfg.store) if main else None
    memory = ResidentPeak()
    before = memory.now()
    learner = Learner(cfg, store, spec["run"], Path(spec["folder"]), Path(spec["checkpoints"]), ranks=ranks)
    load_peak = memory.take()
    step_peaks, checkpoint_peaks = [], []
    publish = learner.publish

    def measured_publish(*args, **kwargs):  # the step's peak (forward, backward, AdamW), then the checkpoint's
        step_peaks.append(memory.take())
        folder = publish(*args, **kwargs)
        checkpoint_peaks.append(memory.take())
        return folder

    learner.publish = measured_publish
    step_s, tokens_per_s = [], []
    if main:
        for step_groups in spec["steps"]:
            start = time.perf_counter()
            report = learner.train_step([TrainableGroup(g["group_id"], "solver", g["sample_ids"]) for g in step_groups])
            step_s.append(time.perf_counter() - start)
            tokens_per_s.append(report.metrics["solver"]["tokens_per_s"])
        learner.stop_followers()
    else:
        learner.follow()
    rank = 0 if ranks is None else ranks.rank
    shutdown()
    out = {
        "peak_load_mb": (load_peak - before) / 2**20,
        "peak_train_mb": (max(step_peaks) - before) / 2**20,
        "peak_checkpoint_mb": (max(checkpoint_peaks) - before) / 2**20,
        "step_s": step_s,
        "train_tokens_per_s": tokens_per_s,
        "checkpoint": str(learner.checkpoint_root / f"v{learner.step}"),
    }
    Path(spec["result"].format(rank=rank)).write_text(json.dumps(out))


def build_inputs(tmp: Path) -> tuple[Path, dict[str, list]]:
    """The model folder, and the same random groups stored under each of `RUNS`."""
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from marsrl_core.store import RewardRow, SampleRow, SegmentRow, SegmentStore

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, num_key_value_heads=MODEL["num_attention_heads"], **MODEL)
    config.max_position_embeddings = 1024
    model = LlamaForCausalLM(config)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")
    folder = tmp / "model"
    model.save_pretrained(folder)
    store = SegmentStore(f"sqlite:{tmp}/lake.sqlite", f"{tmp}/data")
    rng = np.random.default_rng(0)
    steps: dict[str, list] = {run: [] for run in RUNS}
    for step in range(STEPS):
        groups = []
        for g in range(GROUPS):
            prompt = rng.integers(0, VOCAB, PROMPT_TOKENS).tolist()
            members = [
                (rng.integers(0, VOCAB, RESPONSE_TOKENS - 16 * m).tolist(), float(rng.random()))
                for m in range(GROUP_SIZE)
            ]
            groups.append((f"g{step}-{g}", prompt, members))
        for run in steps:
            rows, segments, rewards, stored = [], [], [], []
            for group_id, prompt, members in groups:
                ids = [f"{run}-{group_id}-{m}" for m in range(GROUP_SIZE)]
                for sid, (tokens, reward) in zip(ids, members):
                    rows.append(SampleRow(sid, "p", "solver", 0, f"{run}-{group_id}", GROUP_SIZE, prompt))
                    segments.append(SegmentRow(sid, 0, tokens, [float(-np.log(VOCAB))] * len(tokens), 0, "stop"))
                    rewards.append(RewardRow(sid, reward))
                stored.append({"group_id": f"{run}-{group_id}", "sample_ids": ids})
            store.append(run, rows, segments, rewards)
            steps[run].append(stored)
    store.close()
    return folder, steps


def run_learner(tmp: Path, folder: Path, run: str, steps: list, ranks: int, setup: list[str]) -> dict:
    spec = {
        "overrides": [
            f"store.catalog_url=sqlite:{tmp}/lake.sqlite",
            f"store.data_path={tmp}/data",
            "rollout.temperature=1.0",
            "learner.learning_rate=1e-4",
            "learner.warmup_steps=0",
            "learner.micro_batch_tokens=256",  # one sample per micro-batch: the model and AdamW state dominate
            "learner.save_total_limit=1",
            f"learner.fsdp={ranks > 1}",
            *setup,
        ],
        "folder": str(folder),
        "run": run,
        "checkpoints": str(tmp / f"ckpt-{run}"),
        "steps": steps,
        "result": str(tmp / f"result-{run}-{{rank}}.json"),
    }
    path = tmp / f"spec-{run}.json"
    path.write_text(json.dumps(spec))
    env = os.environ | {"OMP_NUM_THREADS": str(2 // ranks), "PYTHONPATH": str(Path(__file__).parents[1])}
    # glibc returns freed blocks of 64 KiB and more to the system at once, so the resident set follows the
    # live tensors (by default its threshold grows past the size of the tensors freed, and it keeps them;
    # one layer's activation of this model, 256 x 768 floats, is 0.75 MiB).
    env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 16)
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    subprocess.run([*launcher, __file__, "--worker", str(path)], env=env, check=True)
    return {r: json.loads((tmp / f"result-{run}-{r}.json").read_text()) for r in range(ranks)}


def compare(tmp: Path, folder: Path, steps: dict[str, list], setup: str) -> tuple[dict, list]:
    """One process against two FSDP2 ranks on the same groups: their peaks, step times and parameters."""
    from marsrl_core.engines.hf import load_safetensors_state

    one = run_learner(tmp, folder, f"one-{setup}", steps[f"one-{setup}"], 1, SETUPS[setup])
    fsdp = run_learner(tmp, folder, f"fsdp2-{setup}", steps[f"fsdp2-{setup}"], 2, SETUPS[setup])
    a = load_safetensors_state(Path(one[0]["checkpoint"]) / "policy")  # in model.dtype
    b = load_safetensors_state(Path(fsdp[0]["checkpoint"]) / "policy")
    start = {k: v.to(a[k].dtype).float() for k, v in load_safetensors_state(folder).items()}
    a, b = {k: v.float() for k, v in a.items()}, {k: v.float() for k, v in b.items()}
    peak = lambda key: max(r[key] for r in fsdp.values()) / one[0][key]  # noqa: E731
    figures = {
        "fsdp2_peak_ratio": peak("peak_train_mb"),
        "fsdp2_checkpoint_peak_ratio": peak("peak_checkpoint_mb"),
        "max_param_diff": max(float((a[k] - b[k]).abs().max()) for k in a),
        "max_param_change": max(float((a[k] - start[k]).abs().max()) for k in a),
        "step_s": {"one_process": one[0]["step_s"], "fsdp2_2_ranks": fsdp[0]["step_s"]},
        "train_tokens_per_s": {
            "one_process": one[0]["train_tokens_per_s"],
            "fsdp2_2_ranks": fsdp[0]["train_tokens_per_s"],
        },
    }
    for key in ("peak_load_mb", "peak_train_mb", "peak_checkpoint_mb"):
        figures[key] = {"one_process": one[0][key], "fsdp2_2_ranks": [v[key] for v in fsdp.values()]}
    rows = []
    for label, runs in (("one process", one), ("FSDP2, 2 ranks", fsdp)):
        for r, v in runs.items():
            step = sum(v["step_s"]) / STEPS if v["step_s"] else "-"
            rows.append([label, r, v["peak_load_mb"], v["peak_train_mb"], v["peak_checkpoint_mb"], step])
    return figures, rows


def main() -> None:
    from benchmarks.common import print_rows, write_results
    from marsrl_core.engines.hf import load_safetensors_state

    tmp = Path(tempfile.mkdtemp(prefix="learner-scale-"))
    folder, steps = build_inputs(tmp)
    figures: dict = {"steps": STEPS}
    figures["tokens_per_step"] = GROUPS * sum(PROMPT_TOKENS + RESPONSE_TOKENS - 16 * m for m in range(GROUP_SIZE))
    header = ["set-up", "rank", "peak load MB", "peak step MB", "peak checkpoint MB", "step s (with checkpoint)"]
    figures["setups"] = {}
    for setup in SETUPS:
        measured, rows = compare(tmp, folder, steps, setup)
        print_rows(f"learner scale (CPU), {setup}: {' '.join(SETUPS[setup])}", header, rows)
        print(
            f"{setup}: fsdp2_peak_ratio {measured['fsdp2_peak_ratio']:.3f} (goal <= 0.6), at the checkpoint "
            f"{measured['fsdp2_checkpoint_peak_ratio']:.3f}; "
            f"max_param_diff {measured['max_param_diff']:.2e} (weights moved by {measured['max_param_change']:.2e})"
        )
        figures["setups"][setup] = measured
    figures["fsdp2_peak_ratio"] = figures["setups"]["bf16"]["fsdp2_peak_ratio"]
    figures["max_param_diff"] = figures["setups"]["fp32"]["max_param_diff"]
    print(
        f"fsdp2_peak_ratio {figures['fsdp2_peak_ratio']:.3f} (bf16), "
        f"max_param_diff {figures['max_param_diff']:.2e} (fp32)"
    )
    figures["parameters_m"] = sum(v.numel() for v in load_safetensors_state(folder).values()) / 1e6
    print(f"wrote {write_results('learner_scale', figures)}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        main()
