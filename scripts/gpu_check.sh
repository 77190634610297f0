#!/usr/bin/env bash
# The prepared GPU check (issue 12): rlmm on a Qwen2.5-0.5B-architecture model on one CUDA GPU, in about
# 8 minutes on an H200. rlmm probe in bf16, fp16, fp32 and bf16_fp32head (vLLM CUDA sampler, DeepSpeed
# CUDA trainer); 3 steps of rlmm train (bf16); a 2-job sweep through hydra/launcher=process; standalone
# vLLM on the same prompts. Writes scale_check.json (mismatch per precision, step time by stage, peak GPU
# memory, tokens/s against standalone vLLM) into $OUT when set, else benchmarks/results/scale_gpu_<date>/.
#   bash scripts/gpu_check.sh              # on a CUDA machine (sets up .venv with CUDA vLLM if missing)
#   bash scripts/gpu_check.sh --dry-run    # here, on CPU: the same code path with a tiny model (minutes)
# Other arguments go to scripts/scale_check.py (e.g. --precisions bf16 fp32, or overrides such as
# trainer.zero_stage=2).
set -euo pipefail
cd "$(dirname "$0")/.."
args=()
dry_run=0
for arg in "$@"; do
  if [ "$arg" = "--dry-run" ]; then dry_run=1; else args+=("$arg"); fi
done
out=()
[ -n "${OUT:-}" ] && out=(--out "$OUT/scale_check")
if [ "$dry_run" = 1 ]; then
  [ -x .venv/bin/python ] || make setup
  exec .venv/bin/python scripts/scale_check.py gpu --dry-run --timeout 900 "${out[@]}" "${args[@]}"
fi
source scripts/require_cuda_venv.sh
require_cuda_venv scripts/gpu_check.sh
exec .venv/bin/python scripts/scale_check.py gpu --timeout 420 "${out[@]}" "${args[@]}"
