#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py) on a lent, bare, offline GPU machine: Python 3.12 with torch,
# transformers, accelerate, safetensors, numpy; nothing of the project is installed, it runs from
# the source tree. Under 8 minutes on one H100/H200-class GPU. Writes $OUT/gpu.json (or
# benchmarks/results/gpu.json).
#   bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
PYTHONPATH="$PWD" timeout 480 python3 benchmarks/gpu_check.py
