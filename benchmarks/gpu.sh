#!/usr/bin/env bash
# The same benchmark on one CUDA GPU: vLLM (CUDA) + DeepSpeed (CUDA) in rlmm, the parts alone, TRL's
# GRPOTrainer, on a Qwen2 with Qwen2.5-0.5B's architecture (494M parameters, random init, built from a
# config: nothing is downloaded), 16 prompts x 8 samples x 256 new tokens; then `rlmm probe` on that
# model in each precision. Prints one set of tables; results under benchmarks/results/<date>_<time>/.
#   bash benchmarks/gpu.sh                 # on a CUDA machine (sets up .venv with CUDA vLLM if missing)
#   bash benchmarks/gpu.sh --dry-run       # here, on CPU: the same code path at a tiny size, 1+1 steps
#   bash benchmarks/gpu.sh --model-path /path/to/Qwen2.5-0.5B   # a real checkpoint instead (if present)
# Other arguments go to `python -m benchmarks.suite` (e.g. --steps 10, --precision bf16).
set -euo pipefail
cd "$(dirname "$0")/.."
dry_run=0
args=()
for arg in "$@"; do
  if [ "$arg" = "--dry-run" ]; then dry_run=1; else args+=("$arg"); fi
done
if [ "$dry_run" = 1 ]; then
  [ -x .venv/bin/python ] || make setup
  bash benchmarks/setup_trl.sh || echo "benchmarks/gpu.sh: TRL could not be installed; its rows will say skipped" >&2
  exec .venv/bin/python -m benchmarks.suite --size gpu-dry --device cpu --precision fp32 --probe --probe-prompts 4 \
    --timeout 1200 "${args[@]}"
fi
source scripts/require_cuda_venv.sh
require_cuda_venv benchmarks/gpu.sh
bash benchmarks/setup_trl.sh || echo "benchmarks/gpu.sh: TRL could not be installed; its rows will say skipped" >&2
exec .venv/bin/python -m benchmarks.suite --size gpu --device cuda --precision bf16,fp32 --probe --probe-prompts 64 \
  "${args[@]}"
