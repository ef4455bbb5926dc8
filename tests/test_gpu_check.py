"""The prepared GPU check (`benchmarks/gpu_check.py`) runs its own code on the CPU (`--smoke`) on a
machine like the lent GPU machine: without pydantic, Prefect, DuckDB, MLflow or vLLM, which cannot
travel there. They are made unimportable (a path finder that does not find them), so a project module
the check imports that needs one of them fails this test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ABSENT = ("pydantic", "prefect", "duckdb", "mlflow", "vllm")

BARE = """
import importlib.machinery, runpy, sys
ABSENT = {absent!r}

class Bare(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.split(".")[0] in ABSENT else super().find_spec(name, path, target)

sys.meta_path = [Bare if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
sys.argv = [{script!r}, "--smoke"]
runpy.run_path({script!r}, run_name="__main__")
print("imported:", sorted({{m.split(".")[0] for m in sys.modules}} & ABSENT))
"""


def test_the_gpu_check_runs_without_the_packages_the_gpu_machine_lacks(tmp_path):
    script = tmp_path / "bare.py"
    script.write_text(BARE.format(absent=set(ABSENT), script=str(ROOT / "benchmarks" / "gpu_check.py")))
    env = os.environ | {"OMP_NUM_THREADS": "1", "MASTER_PORT": "29517"}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    for length in (1024, 2048):
        assert f"learner   {length} tokens:" in output, output[-3000:]
    assert "learner packed 2048 tokens in 8 sequences (sequence_parallel=1, marsrl_varlen_sdpa)" in output
    assert "weight copy learner -> engine:" in output and "decode:" in output
    assert "imported: []" in output  # none of them was reached, not even by a library probing for it


def test_the_gpu_checks_packed_step_runs_sequence_parallel_over_its_ranks(tmp_path):
    """`torchrun --nproc-per-node 2 benchmarks/gpu_check.py --packed`: the padding-free row cut over two
    ranks (the smoke model has one key/value head: repeated for the exchange), FSDP2 over both."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(ROOT / "benchmarks" / "gpu_check.py"), "--packed", "--smoke"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    assert "learner packed 2048 tokens in 8 sequences (sequence_parallel=2, marsrl_ulysses_marsrl_varlen_sdpa)" in (
        output
    )
