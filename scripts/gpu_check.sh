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
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "scripts/gpu_check.sh: no NVIDIA GPU here (nvidia-smi -L fails); on CPU use --dry-run" >&2
  exit 2
fi
nvidia-smi -L
[ -x .venv/bin/python ] || make setup   # scripts/setup.sh installs the CUDA vllm when nvidia-smi works
if ! .venv/bin/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "scripts/gpu_check.sh: .venv's torch has no CUDA (made on a CPU machine?): remove .venv and rerun" >&2
  exit 2
fi
exec .venv/bin/python scripts/scale_check.py gpu --timeout 420 "${out[@]}" "${args[@]}"
