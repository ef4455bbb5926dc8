"""Prefect overhead per rollout stage: the same rollout batches decoded turn by turn directly through
`marsrl_core.runtime.work` and through the Prefect `rollouts` flow (what `marsrl rollout` runs: one rollout
subflow per batch, a DAG of agent-turn tasks), side by side. Both paths run `rollout.batches_in_flight`
batches at a time (the default, 2), as the `train` and `rollouts` flows do; `--batches-in-flight 1`
runs them one after another.

The overhead is accounted inside each run: its wall-clock minus the time during which some `work`
call (the work both paths do: opening the store, recording the run and a batch, decoding a turn,
marking a batch done) was running, the union of those calls' intervals. With batches in flight, one
batch's Prefect bookkeeping can overlap another batch's decoding and then costs nothing on the
critical path; what is left is the time no decoding happened. (On this 2-core machine the decoding
itself also runs slower beside Prefect's threads and API server, by about 11% in a 16-problem run,
which only the paired difference shows.) Subtracting two runs' totals instead (the paired difference,
also printed) cannot resolve a 5% goal here: decoding times of identical runs differ by ±5% on this
shared machine. The overhead has two parts, both reported:
- per flow run, once: the parent flow's start and end (~0.75 s: Prefect joins its heartbeat thread,
  which sleeps in one-second steps), measured as the `rollouts` flow over no batch;
- per batch: the rollout subflow and its turn tasks (API calls, state changes, parameter checks),
  mostly hidden now that the next batch's subflow is set up while others decode; what remains is
  chiefly requests the server answered 503 (on SQLite, a write that conflicted with another; the
  client retries after 2 s, then 4 s), counted per run. Pointing the temporary server at Postgres
  (PREFECT_API_DATABASE_CONNECTION_URL=postgresql+asyncpg://...) removes them; the results file then
  ends in `_postgresql`.
`overhead_fraction` is everything over the work (the union above), for this run of `BATCHES` batches;
`overhead_fraction_per_batch` leaves out the once-per-run part, which a longer run spreads thinner.
Prefect's temporary API server is a child process: the CPU seconds it uses during each run are
reported too (`server_cpu_s`); on two cores they compete with decoding, which the paired difference
includes and the in-run accounting does not.

The first flow in a process starts Prefect's temporary server (~15-20 s here); a warm-up flow runs
first so that start-up is not counted. The two paths alternate, three times each; medians are used.
Run: `python benchmarks/prefect_overhead.py`. Writes benchmarks/results/prefect_overhead.json with
overhead_per_stage_s, stage_s and overhead_fraction (and the parts above).
"""

from __future__ import annotations

import logging
import statistics
import sys
import tempfile
import threading
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
        ],
    )


def union_s(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one of the (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class WorkTimer:
    """Wraps the `work` functions the rollout tasks call and records when each call ran."""

    # The store's opening (a new catalog for each run here) and the run's row are work both paths do;
    # the `rollouts` flow does them in its body, before its first batch.
    NAMES = ("store_for", "start_run", "record_batch", "rollout_turn", "mark_batch_done")

    def __init__(self) -> None:
        self.intervals: list[tuple[float, float]] = []
        self.lock = threading.Lock()
        self.originals = {name: getattr(workers, name) for name in self.NAMES}

    @property
    def seconds(self) -> float:
        return union_s(self.intervals)

    def __enter__(self) -> WorkTimer:
        for name, original in self.originals.items():
            setattr(workers, name, self._timed(original))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self.originals.items():
            setattr(workers, name, original)

    def _timed(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with self.lock:
                    self.intervals.append((start, time.perf_counter()))

        return timed


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


def direct(cfg, run_id: str) -> dict:
    """The same batches without Prefect: threads instead of subflows, scheduled as the flows schedule
    theirs (`flows.rollout.keep_in_flight`), each batch's turns in order."""
    from flows.rollout import keep_in_flight

    def batch(index: int) -> int:
        workers.record_batch(cfg, run_id, index)
        stages = sum(workers.rollout_turn(cfg, run_id, index, turn)["stages"] for turn in range(cfg.rollout.max_turns))
        workers.mark_batch_done(cfg, run_id, index)
        return stages

    server_cpu = children_cpu_s()
    with WorkTimer() as work, ThreadPoolExecutor(max_workers=8) as pool:
        start = time.perf_counter()
        workers.start_run(cfg, run_id)  # as the flow does
        stages = sum(keep_in_flight(range(BATCHES), cfg.rollout.batches_in_flight, lambda b: pool.submit(batch, b)))
        wall = time.perf_counter() - start
    return {"wall_s": wall, "work_s": work.seconds, "stages": stages, "server_cpu_s": children_cpu_s() - server_cpu}


def with_prefect(cfg, run_id: str, batches: int = BATCHES) -> dict:
    """The `rollouts` flow (what `marsrl rollout` runs): one rollout subflow per batch, one task per turn."""
    from flows.rollout import rollouts_flow

    server_cpu = children_cpu_s()
    with WorkTimer() as work, RetryCounter() as retries:
        start = time.perf_counter()
        done = rollouts_flow(cfg, run_id, list(range(batches)))
        wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        "work_s": work.seconds,
        "stages": done["stages"],
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
    stages = runs["prefect"][0]["stages"]
    overhead = statistics.median(r["wall_s"] - r["work_s"] for r in runs["prefect"])
    per_run = statistics.median(r["wall_s"] - r["work_s"] for r in runs["empty"])
    work = median("prefect", "work_s")
    stage_s = work / stages
    paired = (median("prefect", "wall_s") - median("direct", "wall_s")) / median("direct", "wall_s")
    figures = {
        "overhead_per_stage_s": overhead / stages,
        "stage_s": stage_s,
        "overhead_fraction": overhead / work,
        "overhead_per_run_s": per_run,
        "overhead_per_batch_s": (overhead - per_run) / BATCHES,
        "overhead_fraction_per_batch": (overhead - per_run) / work,
        "paired_difference_fraction": paired,
        "batches": BATCHES,
        "problems_per_batch": problems,
        "batches_in_flight": in_flight,
        "stages": stages,
        "server_pinned_apart": args.pin_server,
        "prefect_database": database,
        "retried_requests_per_run": [r["retried_requests"] for r in runs["prefect"]],
        "direct_uncovered_s": median("direct", "wall_s") - median("direct", "work_s"),
        "server_cpu_s": {"direct": median("direct", "server_cpu_s"), "prefect": median("prefect", "server_cpu_s")},
        "all_runs": runs,
    }
    print_rows(
        f"rollout of {BATCHES} batches x {problems} problems, {in_flight} in flight, tiny model, "
        f"32-token segments, Prefect server on {database} (median of {REPEATS})",
        ["path", "wall s", "in work s (union)", "stages", "API server CPU s"],
        [
            [
                "direct (marsrl_core.runtime.work)",
                median("direct", "wall_s"),
                median("direct", "work_s"),
                runs["direct"][0]["stages"],
                median("direct", "server_cpu_s"),
            ],
            [
                "Prefect: rollouts flow > rollout subflows > tasks",
                median("prefect", "wall_s"),
                work,
                stages,
                median("prefect", "server_cpu_s"),
            ],
            [
                "Prefect: rollouts flow over no batch",
                median("empty", "wall_s"),
                median("empty", "work_s"),
                0,
                median("empty", "server_cpu_s"),
            ],
        ],
    )
    print(
        f"Prefect overhead: {overhead:.2f} s in the run = {overhead / stages * 1000:.1f} ms per stage = "
        f"{overhead / work:.1%} of a stage (goal < 5%); of it {per_run:.2f} s once per flow run, "
        f"{figures['overhead_per_batch_s'] * 1000:.0f} ms per batch ({figures['overhead_fraction_per_batch']:.1%}). "
        f"Paired difference of medians: {paired:+.1%} (noise ±5%). Requests the server answered 503 "
        f"(retried after 2 s, 4 s, ...), per run: {figures['retried_requests_per_run']}."
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
