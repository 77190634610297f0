#!/usr/bin/env bash
# The GPU check for the machine this project can be lent (one H200, Python 3.12, torch + transformers, no vLLM,
# no DeepSpeed, no package index): DeepSpeed training on CUDA (rlmm train, sampler=hf) in bf16, fp16 and
# bf16_fp32head at ZeRO-0 and bf16 at ZeRO-2; rlmm probe sampler=hf with trainer=fsdp and trainer=torch in four
# precisions; benchmarks/layouts.py on the GPU. Under 8 minutes, each part under its own time limit
# (scripts/gpu_lent_check.py's header gives the parts, their limits and the time estimates).
#   bash scripts/gpu_wheels.sh                  # first, here: the wheels that machine lacks -> .gpu_wheels/
#   bash scripts/gpu_lent_check.sh              # there, with .gpu_wheels carried; its python3 (PYTHON= another)
#   bash scripts/gpu_lent_check.sh --dry-run    # here, on CPU with .venv: the same parts, a tiny model (~4 min)
# Writes gpu_lent_check.json (the figures), layouts.json and gpu_lent_runs.tar.gz (logs and run records) into
# $OUT (or --out DIR, else benchmarks/results/gpu_lent_<date>/). Other arguments go to scripts/gpu_lent_check.py
# (e.g. --parts train,probe).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
for arg in "$@"; do
  if [ "$arg" = --dry-run ]; then
    [ -x .venv/bin/python ] || make setup
    python=${PYTHON:-.venv/bin/python}
  fi
done
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L || true
PYTHONUNBUFFERED=1 exec "$python" scripts/gpu_lent_check.py "$@"
