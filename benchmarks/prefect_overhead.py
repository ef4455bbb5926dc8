"""Prefect overhead per rollout stage: the same rollout batches decoded turn by turn directly through
`marsrl_core.workers` and through the Prefect `rollouts` flow (what `marsrl rollout` runs: one rollout
subflow per batch, a DAG of agent-turn tasks), side by side.

The first flow in a process starts Prefect's temporary server (~15-20 s here); a warm-up flow runs
first so that start-up is not counted. The parent flow's own start and end (~1 s: its heartbeat
thread is joined) are counted, spread over the six batches. The two paths alternate, three times
each, and the medians are compared (this machine is shared and noisy).
Run: `python benchmarks/prefect_overhead.py`. Writes benchmarks/results/prefect_overhead.json with
overhead_per_stage_s, stage_s and overhead_fraction.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

from benchmarks.common import print_rows, write_results  # noqa: E402
from marsrl_core import workers  # noqa: E402
from marsrl_core.config import load_config  # noqa: E402

BATCHES = 6


def config(root: Path, tag: str):
    return load_config("tiny", None, [
        f"store.catalog_url=sqlite:{root}/{tag}.sqlite", f"store.data_path={root}/{tag}-data",
        f"output_dir={root}/out", "rollout.segment_tokens=32", "rollout.problems_per_batch=32"])


def direct(cfg, run_id: str) -> tuple[float, int]:
    stages, start = 0, time.perf_counter()
    for batch in range(BATCHES):
        workers.record_batch(cfg, run_id, batch)
        for turn in range(cfg.rollout.max_turns):
            stages += workers.rollout_turn(cfg, run_id, batch, turn)["stages"]
    return time.perf_counter() - start, stages


def with_prefect(cfg, run_id: str) -> tuple[float, int]:
    """The `rollouts` flow (what `marsrl rollout` runs): one rollout subflow per batch, one task per turn."""
    from flows.rollout import rollouts_flow

    start = time.perf_counter()
    done = rollouts_flow(cfg, run_id, list(range(BATCHES)))
    return time.perf_counter() - start, done["stages"]


def main() -> None:
    from flows.rollout import rollouts_flow

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        warm = config(root, "warm")
        rollouts_flow(warm, "warm", [0])  # starts the temporary Prefect server and builds the tiny model
        runs = {"direct": [], "prefect": []}
        for i in range(3):
            runs["direct"].append(direct(config(root, f"direct{i}"), f"direct{i}"))
            runs["prefect"].append(with_prefect(config(root, f"prefect{i}"), f"prefect{i}"))
        direct_s, direct_stages = sorted(runs["direct"])[1]
        prefect_s, prefect_stages = sorted(runs["prefect"])[1]
    stage_s = direct_s / direct_stages
    overhead = (prefect_s - direct_s) / prefect_stages
    print_rows(f"rollout of {BATCHES} batches x 32 problems, tiny model, 32-token segments (median of 3)",
               ["path", "wall s", "stages", "s per stage"],
               [["direct (marsrl_core.workers)", direct_s, direct_stages, stage_s],
                ["Prefect: rollouts flow > rollout subflows > tasks", prefect_s, prefect_stages, prefect_s / prefect_stages]])
    print(f"Prefect overhead per stage: {overhead * 1000:.1f} ms = {overhead / stage_s:.1%} of a stage (goal < 5%)")
    print(f"wrote {write_results('prefect_overhead', {'overhead_per_stage_s': overhead, 'stage_s': stage_s, 'overhead_fraction': overhead / stage_s, 'direct_s': direct_s, 'prefect_s': prefect_s, 'stages': prefect_stages, 'all_runs_s': {k: [w for w, _ in v] for k, v in runs.items()}})}")


if __name__ == "__main__":
    main()
