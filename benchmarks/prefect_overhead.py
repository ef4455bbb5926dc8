"""What Prefect costs per rollout batch: the same batches through the run's decode loop directly
(`marsrl_core.runtime.work`: a batch joins the loop, each turn is waited on, the batch ends) and through
the Prefect `rollouts` flow (what `marsrl rollout` runs: one rollout subflow per batch, a task per
agent turn spanning that turn), side by side, `rollout.batches_in_flight` batches at a time (2).

The decoding is the same in both paths (one decode loop per run and process); Prefect adds the
subflow runs, their task runs and their state changes, and its API server's CPU beside the decoding.
The figure is the paired difference of the two paths' wall-clocks (medians of three alternated runs):
`overhead_per_batch_s` and `overhead_fraction` (over the direct path's wall-clock). On this shared
2-core machine identical runs differ by about 5%, which bounds what the difference can resolve. The
parent flow's own start and end are measured as the `rollouts` flow over no batch
(`overhead_per_run_s`). Requests the server answered 503 (on SQLite, a write that conflicted with
another; the client retries after 2 s, then 4 s) are counted per run; pointing the temporary server at
Postgres (PREFECT_API_DATABASE_CONNECTION_URL=postgresql+asyncpg://...) removes them, and the results
file then ends in `_postgresql`.

The first flow in a process starts Prefect's temporary server (~15-20 s here); a warm-up flow runs
first so that start-up is not counted.
Run: `python benchmarks/prefect_overhead.py`. Writes benchmarks/results/prefect_overhead.json with
overhead_per_batch_s, overhead_fraction, overhead_per_run_s, batch_s (the direct path's seconds per
batch) and the runs.
"""

from __future__ import annotations

import logging
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

from benchmarks.common import print_rows, write_results  # noqa: E402
from marsrl_core.config import load_config  # noqa: E402
from marsrl_core.runtime import work as workers  # noqa: E402

BATCHES = 6
REPEATS = 3


def config(root: Path, tag: str, problems_per_batch: int, batches_in_flight: int):
    return load_config(
        "tiny",
        None,
        [
            f"store.catalog_url=sqlite:{root}/{tag}.sqlite",
            f"store.data_path={root}/{tag}-data",
            f"output_dir={root}/out",
            "rollout.segment_tokens=32",
            f"rollout.problems_per_batch={problems_per_batch}",
            f"rollout.batches_in_flight={batches_in_flight}",
            "learner.max_trained_age=null",  # rollouts alone: no learner paces them
        ],
    )


class RetryCounter(logging.Handler):
    """Counts the Prefect client's retries of requests the server answered with a retryable status (503:
    on SQLite, a write that conflicted with another; the client waits 2 s, then 4 s, ... and retries).
    The client logs each at DEBUG on `prefect.client`; during the block that logger passes only those
    records and what it passed before."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.retries = 0
        self.logger = logging.getLogger("prefect.client")

    def emit(self, record: logging.LogRecord) -> None:
        if "retryable status code" in record.getMessage():
            self.retries += 1

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level_before or "retryable status code" in record.getMessage()

    def __enter__(self) -> RetryCounter:
        self.level_before = self.logger.getEffectiveLevel()
        self.logger.addHandler(self)
        self.logger.addFilter(self.filter)
        self.logger.setLevel(logging.DEBUG)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.setLevel(self.level_before)
        self.logger.removeFilter(self.filter)
        self.logger.removeHandler(self)


def database_kind() -> str:
    """The backend of Prefect's temporary server: "sqlite" unless PREFECT_API_DATABASE_CONNECTION_URL says."""
    from prefect.settings import get_current_settings

    url = get_current_settings().server.database.connection_url
    return "postgresql" if url and url.get_secret_value().startswith("postgresql") else "sqlite"


def children_cpu_s() -> float:
    """CPU seconds used so far by this process's children (Prefect's temporary API server)."""
    import psutil

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def pin_server_apart() -> None:
    """Prefect's temporary API server (this process's child) and a local Postgres behind it, if any, on
    core 1; this process (each of its threads: the affinity call applies per thread) on core 0;
    threads started later inherit it."""
    import os

    import psutil

    children = psutil.Process().children(recursive=True)
    if not children or len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("--pin-server needs Prefect's temporary server (no PREFECT_API_URL) and two cores")
    for child in children:
        child.cpu_affinity([1])
    for process in psutil.process_iter(["name"]):
        if process.info["name"] in ("postgres", "postmaster"):
            try:
                process.cpu_affinity([1])
            except psutil.Error:  # another user's Postgres, or one that just exited: leave it
                pass
    for thread_id in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(thread_id), {0})


def direct(cfg, run_id: str, batches: int = BATCHES) -> dict:
    """The same batches without Prefect: threads instead of subflows, scheduled as the flows schedule
    theirs (`keep_in_flight`), each batch joining the run's decode loop and its turns waited on."""
    from flows.rollout import PREPARED_AHEAD
    from flows.subflows import keep_in_flight

    def batch(index: int) -> int:
        workers.record_batch(cfg, run_id, index)
        workers.start_batch(cfg, run_id, index)
        turns = [t for t in range(cfg.rollout.max_turns) if workers.turn_starts(cfg, run_id, index, t)]
        samples = sum(workers.rollout_turn(cfg, run_id, index, t)["samples"] for t in turns)
        workers.end_batch(cfg, run_id, index)
        return samples

    server_cpu = children_cpu_s()
    limit = cfg.rollout.batches_in_flight + PREPARED_AHEAD
    with ThreadPoolExecutor(max_workers=limit) as pool:
        start = time.perf_counter()
        workers.start_run(cfg, run_id)  # as the flow does
        samples = sum(keep_in_flight(range(batches), limit, lambda b: pool.submit(batch, b)))
        wall = time.perf_counter() - start
    return {"wall_s": wall, "samples": samples, "server_cpu_s": children_cpu_s() - server_cpu}


def with_prefect(cfg, run_id: str, batches: int = BATCHES) -> dict:
    """The `rollouts` flow (what `marsrl rollout` runs): one rollout subflow per batch, one task per turn."""
    from flows.rollout import rollouts_flow

    server_cpu = children_cpu_s()
    with RetryCounter() as retries:
        start = time.perf_counter()
        done = rollouts_flow(cfg, run_id, list(range(batches)))
        wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        "samples": done["samples"],
        "server_cpu_s": children_cpu_s() - server_cpu,
        "retried_requests": retries.retries,
    }


def main() -> None:
    import argparse

    from flows.rollout import rollouts_flow

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--problems-per-batch",
        type=int,
        default=32,
        help="Problems per rollout batch (32; `make train` uses 8). Other sizes write prefect_overhead_<n>.json.",
    )
    parser.add_argument(
        "--batches-in-flight",
        type=int,
        default=2,
        help="Batches decoding at once in both paths (2, the default of `rollout.batches_in_flight`; "
        "1 runs them one after another and writes prefect_overhead[_<n>]_sequential.json).",
    )
    parser.add_argument(
        "--pin-server",
        action="store_true",
        help="After start-up, pin Prefect's API server (and a local Postgres behind it) to core 1 "
        "and this process (both paths' decoding) to core 0: the server then competes with no "
        "decoding, as on a cluster where it has a machine of its own. Writes "
        "prefect_overhead[_<n>]_pinned.json.",
    )
    args = parser.parse_args()
    problems, in_flight = args.problems_per_batch, args.batches_in_flight

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        # starts Prefect's temporary server, builds the model
        rollouts_flow(config(root, "warm", problems, in_flight), "warm", [0])
        if args.pin_server:
            pin_server_apart()
        runs: dict[str, list[dict]] = {"direct": [], "prefect": [], "empty": []}
        for i in range(REPEATS):
            runs["direct"].append(direct(config(root, f"direct{i}", problems, in_flight), f"direct{i}"))
            runs["prefect"].append(with_prefect(config(root, f"prefect{i}", problems, in_flight), f"prefect{i}"))
            runs["empty"].append(with_prefect(config(root, f"empty{i}", problems, in_flight), f"empty{i}", batches=0))

    def median(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[kind])

    database = database_kind()
    direct_s, prefect_s = median("direct", "wall_s"), median("prefect", "wall_s")
    per_run = median("empty", "wall_s")
    figures = {
        "overhead_per_batch_s": (prefect_s - direct_s) / BATCHES,
        "overhead_fraction": (prefect_s - direct_s) / direct_s,
        "overhead_per_run_s": per_run,
        "batch_s": direct_s / BATCHES,
        "batches": BATCHES,
        "problems_per_batch": problems,
        "batches_in_flight": in_flight,
        "server_pinned_apart": args.pin_server,
        "prefect_database": database,
        "retried_requests_per_run": [r["retried_requests"] for r in runs["prefect"]],
        "server_cpu_s": {"direct": median("direct", "server_cpu_s"), "prefect": median("prefect", "server_cpu_s")},
        "all_runs": runs,
    }
    print_rows(
        f"rollout of {BATCHES} batches x {problems} problems, {in_flight} in flight, tiny model, "
        f"32-token segments, Prefect server on {database} (median of {REPEATS})",
        ["path", "wall s", "samples", "API server CPU s"],
        [
            [
                "direct (the decode loop, marsrl_core.runtime.work)",
                direct_s,
                runs["direct"][0]["samples"],
                median("direct", "server_cpu_s"),
            ],
            [
                "Prefect: rollouts flow > rollout subflows > turn tasks",
                prefect_s,
                runs["prefect"][0]["samples"],
                median("prefect", "server_cpu_s"),
            ],
            ["Prefect: rollouts flow over no batch", per_run, 0, median("empty", "server_cpu_s")],
        ],
    )
    print(
        f"Prefect overhead: {figures['overhead_per_batch_s'] * 1000:.0f} ms per batch of "
        f"{figures['batch_s']:.2f} s ({figures['overhead_fraction']:+.1%}, noise about 5%); the parent flow's "
        f"start and end {per_run:.2f} s once per run. Requests the server answered 503 (retried after 2 s, "
        f"4 s, ...), per run: {figures['retried_requests_per_run']}."
    )
    name = (
        "prefect_overhead"
        + ("" if problems == 32 else f"_{problems}")
        + ("" if in_flight > 1 else "_sequential")
        + ("_pinned" if args.pin_server else "")
        + ("" if database == "sqlite" else f"_{database}")
    )
    print(f"wrote {write_results(name, figures)}")


if __name__ == "__main__":
    main()
