"""Soak run (not in CI): rollout and learner as two `marsrl` processes on the tiny model for a while.

The rollout process (`marsrl rollout`) decodes problem batches and the learner process (`marsrl learn`)
trains on them; they meet only through the DuckLake store, as in a split deployment. Every 15 s the
script samples the resident memory (RSS) of both, with and without their children (each runs
Prefect's ephemeral API server as a child process, and its store in another, which is replaced
whenever it has grown `store.recycle_after_mb`), and of each store process alone. At the deadline it
writes a `stop_requested` run event: the rollout stops before its next batch and marks the rollouts
finished, the learner trains on what is left and stops; both record their store lock retries.

Reports: store rows per table (and how many consumptions were samples dropped as too stale), policy
versions, lock retries per process, RSS at the start (after the first learner step) and at the end
with the growth in between, and its slope over the second half (goal: flat), the run's disk use (it
keeps the 3 newest checkpoints and logs every 100th to MLflow), the DuckLake commits (snapshot ids in
the catalog), and any error. Writes benchmarks/results/soak.json with duration_s, rows, versions,
ducklake_commits, lock_retries, rss_mb, rss_by_kind_mb (resident memory by mapping kind at the first
learner step and at the end), disk_mb, data_files, poll_ms (a learner poll on the final store),
store_processes_seen (store process ids seen per parent: 1 + its replacements seen),
rss_mean_by_quarter_mb (mean RSS in each quarter of the run, per process and store process), errors.
The learner compacts the store every `store.compact_every_steps` versions (100 by default).

Run: `python benchmarks/soak.py --minutes 10`; `--set KEY=VALUE` (repeatable) overrides a config field in
both processes, e.g. to compare a store setting. The run's folder (store, checkpoints, MLflow: about
1 GB after 20 minutes) is deleted at the end unless `--keep` is given or an error was found; then the
logs and the store stay there for a look.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

sys.path.insert(0, str(Path(__file__).parents[1]))

from benchmarks.common import print_rows, write_results  # noqa: E402
from marsrl_core.runtime.events import STOP_REQUESTED, STORE_LOCK_RETRIES  # noqa: E402
from marsrl_core.store import CATALOG, SegmentStore  # noqa: E402

RUN = "soak"


def rss_mb(pid: int, children: bool = True) -> float:
    """Resident memory of a process, with its children (Prefect's ephemeral API server, the store's
    process) or without."""
    try:
        process = psutil.Process(pid)
        family = [process, *process.children(recursive=True)] if children else [process]
        return sum(p.memory_info().rss for p in family) / 2**20
    except psutil.NoSuchProcess:
        return float("nan")


def store_child_rss_mb(pid: int) -> tuple[float, int | None]:
    """Resident memory of a process's store child (`marsrl_core.store.process`; 0 when the store is
    in-process), and its pid, so the report can count replacements."""
    try:
        for child in psutil.Process(pid).children():
            if "marsrl_core.store.process" in child.cmdline():
                return child.memory_info().rss / 2**20, child.pid
    except psutil.NoSuchProcess:
        pass
    return 0.0, None


def rss_by_kind(pid: int) -> dict[str, float]:
    """Resident MB of a process by mapping (Linux /proc/PID/smaps): the brk heap (glibc's main arena),
    glibc's thread arenas (anonymous 64 MiB-aligned heaps), other anonymous memory (large malloc
    chunks, DuckDB's allocator, torch) and file-backed pages (libraries). Where growth lives."""
    kinds = {"heap": 0, "thread arenas": 0, "other anonymous": 0, "files": 0}
    try:
        with open(f"/proc/{pid}/smaps") as smaps:
            kind = None
            for line in smaps:
                fields = line.split()
                if "-" in fields[0] and len(fields) >= 5:  # a mapping's header: range perms offset dev inode [name]
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    name = fields[5] if len(fields) > 5 else ""
                    if name == "[heap]":
                        kind = "heap"
                    elif name.startswith("/"):
                        kind = "files"
                    elif name and name.startswith("["):
                        kind = None  # stack, vdso, ...
                    else:
                        aligned = start % (64 << 20) == 0 and end - start <= 64 << 20
                        kind = "thread arenas" if aligned else "other anonymous"
                elif fields[0] == "Rss:" and kind:
                    kinds[kind] += int(fields[1]) / 1024
    except OSError:
        return {}
    return kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for both processes, as `marsrl --set` takes it",
    )
    parser.add_argument("--keep", action="store_true", help="keep the run's folder (deleted by default without errors)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="marsrl-soak-"))
    config = {
        "store": {"catalog_url": f"sqlite:{work}/lake.sqlite", "data_path": f"{work}/data"},
        "output_dir": f"{work}/out",
        "rollout": {"problems_per_batch": 8, "segment_tokens": 32},
        "data": {"num_batches": 100_000},
        "learner": {"groups_per_step": 4, "max_steps": 1_000_000, "save_total_limit": 3},
        "tracking": {"mlflow_tracking_uri": f"sqlite:///{work}/mlflow.db", "log_checkpoint_steps": 100},
    }
    (work / "soak.yaml").write_text(yaml.safe_dump(config))
    base = [sys.executable, "-m", "flows.cli"]
    common = ["--config", str(work / "soak.yaml"), "--run-id", RUN, *(f"--set={kv}" for kv in args.set)]

    def env(name: str) -> dict:
        return {**os.environ, "PREFECT_LOGGING_LEVEL": "WARNING", "PREFECT_HOME": str(work / f"prefect-{name}")}

    logs = {name: open(work / f"{name}.log", "w") for name in ("rollout", "learner")}
    rollout = subprocess.Popen(
        [*base, "rollout", *common, "--finish"], stdout=logs["rollout"], stderr=subprocess.STDOUT, env=env("rollout")
    )
    learner = subprocess.Popen(
        [*base, "learn", *common, "--idle-timeout", "600"],
        stdout=logs["learner"],
        stderr=subprocess.STDOUT,
        env=env("learner"),
    )
    processes = {"rollout": rollout, "learner": learner}
    store = None
    start, deadline = time.monotonic(), time.monotonic() + args.minutes * 60
    samples: list[tuple[float, float, float]] = []
    first_step_at, by_kind_start = None, {}
    store_pids: dict[str, set] = {"rollout": set(), "learner": set()}
    while time.monotonic() < deadline and all(p.poll() is None for p in processes.values()):
        time.sleep(15)
        if store is None and (work / "lake.sqlite").exists():
            store = SegmentStore(config["store"]["catalog_url"], config["store"]["data_path"], create=False)
        if first_step_at is None and store is not None and store.latest_version(RUN) is not None:
            first_step_at = len(samples)
            by_kind_start = {name: rss_by_kind(p.pid) for name, p in processes.items()}
        (rollout_store, rollout_store_pid), (learner_store, learner_store_pid) = (
            store_child_rss_mb(rollout.pid),
            store_child_rss_mb(learner.pid),
        )
        store_pids["rollout"].add(rollout_store_pid)
        store_pids["learner"].add(learner_store_pid)
        samples.append(
            (
                time.monotonic() - start,
                rss_mb(rollout.pid),
                rss_mb(learner.pid),
                rss_mb(rollout.pid, children=False),
                rss_mb(learner.pid, children=False),
                rollout_store,
                learner_store,
            )
        )
        print(
            f"{samples[-1][0]:6.0f}s  rss rollout {samples[-1][1]:7.1f} MB ({samples[-1][3]:7.1f} without children,"
            f" store {rollout_store:5.1f})  learner {samples[-1][2]:7.1f} MB ({samples[-1][4]:7.1f},"
            f" store {learner_store:5.1f})",
            flush=True,
        )
    by_kind_end = {name: rss_by_kind(p.pid) for name, p in processes.items()}
    errors = [
        f"{name} exited early with status {p.returncode}" for name, p in processes.items() if p.poll() is not None
    ]
    store = store or SegmentStore(config["store"]["catalog_url"], config["store"]["data_path"], create=False)
    store.mark(RUN, STOP_REQUESTED)
    for name, process in processes.items():
        try:
            process.wait(timeout=900)
        except subprocess.TimeoutExpired:
            process.kill()
            errors.append(f"{name} did not stop within 900 s of the stop request")
        if process.returncode:
            errors.append(f"{name} exited with status {process.returncode}")
    for name in processes:
        logs[name].close()
        text = (work / f"{name}.log").read_text(errors="replace")
        if "Traceback" in text:
            errors.append(f"{name}: traceback in {work / f'{name}.log'}")
    duration = time.monotonic() - start
    tables = ("problems", "samples", "segments", "rewards", "consumptions", "policy_versions", "train_steps")
    rows = {t: store.count(t, RUN) for t in tables}
    rows["consumptions dropped as stale"] = (
        store.query("SELECT count(*) AS n FROM consumptions WHERE run_id = ? AND learner_step < 0", [RUN])
        .column("n")[0]
        .as_py()
    )
    retries = {}
    for row in store.query(
        "SELECT detail FROM run_events WHERE run_id = ? AND event = ?", [RUN, STORE_LOCK_RETRIES]
    ).to_pylist():
        name, _, n = row["detail"].partition(":")
        retries[name] = int(n)
    steady = samples[first_step_at or 0 :] or samples
    half = steady[len(steady) // 2 :]  # the second half: past start-up and warm-up

    def per_minute(series: list, i: int) -> float:
        """Least-squares slope of RSS over time, MB per minute."""
        t = [row[0] for row in series]
        y = [row[i] for row in series]
        mt, my = sum(t) / len(t), sum(y) / len(y)
        var = sum((a - mt) ** 2 for a in t)
        return 60 * sum((a - mt) * (b - my) for a, b in zip(t, y)) / var if var else 0.0

    rss = {
        name: {
            "start": steady[0][i],
            "end": steady[-1][i],
            "growth": steady[-1][i] - steady[0][i],
            "mb_per_min_second_half": per_minute(half, i),
        }
        for i, name in (
            (1, "rollout"),
            (2, "learner"),
            (3, "rollout (no children)"),
            (4, "learner (no children)"),
            (5, "rollout's store process"),
            (6, "learner's store process"),
        )
    }
    store_processes = {name: len(pids - {None}) for name, pids in store_pids.items()}
    quarters = [samples[k * len(samples) // 4 : (k + 1) * len(samples) // 4] for k in range(4)]
    quarter_means = {
        name: [sum(row[i] for row in q) / len(q) if q else float("nan") for q in quarters]
        for i, name in (
            (3, "rollout (no children)"),
            (4, "learner (no children)"),
            (5, "rollout's store process"),
            (6, "learner's store process"),
        )
    }
    poll_s = []
    for _ in range(5):  # what the learner's poll costs on the run's final store
        t0 = time.perf_counter()
        store.trainable_groups_by_agent(RUN, ["solver", "verifier", "corrector"], 4)
        poll_s.append(time.perf_counter() - t0)
    poll_ms, data_files = 1000 * sorted(poll_s)[2], store.data_file_count()
    disk_mb = sum(f.stat().st_size for f in work.rglob("*") if f.is_file()) / 2**20
    versions = store.latest_version(RUN)
    # one snapshot per commit; snapshot ids count up by one per commit and compaction expires old
    # snapshots, so count the ids
    snapshots = store.query(f"SELECT max(snapshot_id) + 1 AS n FROM ducklake_snapshots('{CATALOG}')")
    commits = snapshots.column("n")[0].as_py()
    figures = {
        "duration_s": duration,
        "rows": rows,
        "versions": versions[0] if versions else 0,
        "ducklake_commits": commits,
        "lock_retries": retries,
        "rss_mb": rss,
        "disk_mb": disk_mb,
        "rss_by_kind_mb": {"start": by_kind_start, "end": by_kind_end},
        "data_files": data_files,
        "poll_ms": poll_ms,
        "store_processes_seen": store_processes,
        "rss_mean_by_quarter_mb": quarter_means,
        "errors": errors,
        "samples": samples,
    }
    print_rows("soak: store rows", ["table", "rows"], [[t, n] for t, n in rows.items()])
    print_rows(
        "soak: processes",
        ["process", "RSS start MB", "RSS end MB", "growth MB", "MB/min, 2nd half", "lock retries"],
        [
            [name, r["start"], r["end"], r["growth"], r["mb_per_min_second_half"], retries.get(name, "")]
            for name, r in rss.items()
        ],
    )
    print_rows(
        "soak: resident memory by mapping, first learner step -> end (MB, without children)",
        ["process", *next(iter(by_kind_end.values()), {})],
        [
            [name, *(f"{by_kind_start.get(name, {}).get(k, float('nan')):.0f} -> {v:.0f}" for k, v in kinds.items())]
            for name, kinds in by_kind_end.items()
        ],
    )
    print(
        f"DuckLake commits (snapshot ids in the catalog, both processes): {commits}, "
        f"{commits / duration:.1f} a second; "
        f"the learner commits once per policy version, the rollout most of the rest"
    )
    print_rows(
        "soak: mean resident memory in each quarter of the run (MB; a slope over 15 s samples is "
        "rough when decoding swings the rollout's by ±50 MB)",
        ["process", "1st", "2nd", "3rd", "4th"],
        [[name, *means] for name, means in quarter_means.items()],
    )
    print(f"store processes seen (a new pid is a replacement), by parent: {store_processes}")
    print(
        f"at the end: {data_files} Parquet data files, a learner poll (trainable groups of all agents) "
        f"{poll_ms:.0f} ms (median of 5)"
    )
    print(
        f"duration {duration:.0f} s, policy versions {figures['versions']}, disk {disk_mb:.0f} MB "
        f"(store, checkpoints kept: 3, MLflow), errors: {errors or 'none'}"
    )
    store.close()
    if errors or args.keep:
        print(f"written to {write_results('soak', figures)}; logs and store kept in {work}")
    else:
        shutil.rmtree(work)
        print(f"written to {write_results('soak', figures)}; {work} deleted (--keep keeps it)")


if __name__ == "__main__":
    main()
