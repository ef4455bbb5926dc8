"""One learner rank for tests/test_distributed.py, started by `torch.distributed.run`:

    python -m torch.distributed.run --nproc-per-node 2 tests/distributed_steps.py SPEC.json

SPEC holds the config overrides, the model folder, the run, the checkpoint root, the steps' groups,
`resume` and `limit` (the step to stop after). Rank 0 opens the store and runs the steps (after a
resume, those past the committed version); the other ranks follow it. With `record` (a folder), each
rank writes there how many micro-batches of its own samples each agent's share made
(`agent_loss.pack`), how many forwards its policy ran in all, and the tokens of each micro-batch
beside those its decoder ran.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

from marsrl_core.config import load_config
from marsrl_core.learn import agent_loss
from marsrl_core.learn.distributed import init_ranks, shutdown
from marsrl_core.learn.learner import Learner
from marsrl_core.store import SegmentStore, TrainableGroup


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    cfg = load_config("tiny", None, spec["overrides"])
    ranks = init_ranks(cfg.learner.collective_timeout_s)
    store = SegmentStore.from_config(cfg.store) if ranks.main else None
    tokenizer = AutoTokenizer.from_pretrained(spec["folder"])
    learner = Learner(cfg, store, spec["run"], Path(spec["folder"]), Path(spec["checkpoints"]), tokenizer, ranks=ranks)
    if spec.get("record"):
        _record(learner, Path(spec["record"]) / f"rank{ranks.rank}.json")
    start = learner.resume() if spec.get("resume") else 0
    if not ranks.main:
        learner.follow()
        shutdown()
        return
    for step_groups in spec["steps"][start : spec.get("limit")]:
        learner.train_step([TrainableGroup(g["group_id"], g["agent"], g["sample_ids"]) for g in step_groups])
    learner.make_durable()  # as a run's end does: the last version holds the trainer state
    learner.stop_followers()
    shutdown()
    store.close()


def _record(learner: Learner, path: Path) -> None:
    """Count, on this rank, the micro-batches `agent_loss.pack` makes of its own samples and the policy's
    forwards (its own micro-batches and the fillers that even them out), written after each forward."""
    counts = {"own": [], "forwards": 0, "rows": []}  # rows: [a micro-batch's tokens, those this rank ran]
    real_pack = agent_loss.pack

    def pack(items, budget):
        batches = real_pack(items, budget)
        counts["own"].append(len(batches))
        return batches

    def decoder_input(module, args, kwargs):
        counts["rows"][-1].append(kwargs["input_ids"].numel())

    def forward_start(module, args):
        counts["rows"].append([args[0].input_ids.numel()])

    def forward_done(module, args, output):
        counts["forwards"] += 1
        path.write_text(json.dumps(counts))

    agent_loss.pack = pack
    scorer = learner.scorers["policy"]
    scorer.register_forward_pre_hook(forward_start)
    scorer.model.get_decoder().register_forward_pre_hook(decoder_input, with_kwargs=True)
    scorer.register_forward_hook(forward_done)


if __name__ == "__main__":
    main(sys.argv[1])
