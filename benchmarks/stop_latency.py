"""How long `marsrl rollout` and `marsrl train` take to exit after SIGTERM (not in CI).

Each command is started on the tiny model with a fresh store (8 problems a batch, 8-token segments,
4 batches) and sent SIGTERM once its first 20 segments are stored, i.e. while its first batches are
decoding. Reported per command: seconds from the signal to the process's exit (or "did not exit"
after `--timeout` seconds, when it is killed), its exit status, the segments stored at the signal
and at the exit, and how many batches were finished after the signal (a prompt stop finishes none).
Writes benchmarks/results/stop_latency.json with, per command, exit_s, returncode,
segments_at_signal, segments_at_exit and batches_done.

Run: `python benchmarks/stop_latency.py` (from a checkout: the `marsrl` code of the current folder runs).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parents[1]))

from benchmarks.common import print_rows, write_results  # noqa: E402
from marsrl_core.store import SegmentStore  # noqa: E402

RUN = "stop"
BATCHES = 4


def measure(command: str, timeout_s: float) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"marsrl-stop-{command}-"))
    config = {
        "store": {"catalog_url": f"sqlite:{work}/lake.sqlite", "data_path": f"{work}/data"},
        "output_dir": f"{work}/out",
        "rollout": {"problems_per_batch": 8, "segment_tokens": 8},
        "data": {"num_batches": BATCHES},
        "tracking": {"mlflow_tracking_uri": f"sqlite:///{work}/mlflow.db"},
    }
    (work / "config.yaml").write_text(yaml.safe_dump(config))
    store = SegmentStore(config["store"]["catalog_url"], config["store"]["data_path"])  # created before the run
    args = [sys.executable, "-m", "flows.cli", command, "--config", str(work / "config.yaml"), "--run-id", RUN]
    if command == "train":
        args += ["--results", ""]
    env = {**os.environ, "PREFECT_HOME": str(work / "prefect"), "PREFECT_LOGGING_LEVEL": "WARNING"}
    with open(work / "log", "w") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        while store.count("segments", RUN) < 20:
            if process.poll() is not None:
                raise RuntimeError(f"{command} exited before its first segments; see {work / 'log'}")
            time.sleep(0.1)
        at_signal = store.count("segments", RUN)
        start = time.monotonic()
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
            exit_s: float | None = time.monotonic() - start
        except subprocess.TimeoutExpired:
            exit_s = None
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    figures = {
        "exit_s": exit_s,
        "returncode": process.returncode if exit_s is not None else None,
        "segments_at_signal": at_signal,
        "segments_at_exit": store.count("segments", RUN),
        "batches_done": sum(store.has_event(RUN, f"batch_done:{b}") for b in range(BATCHES)),
    }
    store.close()
    shutil.rmtree(work)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for an exit")
    args = parser.parse_args()
    figures = {command: measure(command, args.timeout) for command in ("rollout", "train")}
    print_rows(
        "exit after SIGTERM (tiny model, 4 batches of 8 problems)",
        ["command", "exit s", "status", "segments at signal", "at exit", "batches finished"],
        [
            [
                command,
                f"{f['exit_s']:.1f}" if f["exit_s"] is not None else f"did not exit in {args.timeout:.0f} s",
                f["returncode"],
                f["segments_at_signal"],
                f["segments_at_exit"],
                f["batches_done"],
            ]
            for command, f in figures.items()
        ],
    )
    print(f"written to {write_results('stop_latency', figures)}")


if __name__ == "__main__":
    main()
