# Sourced by the GPU scripts (benchmarks/gpu.sh, scripts/gpu_check.sh), from the repository root:
# `require_cuda_venv NAME` stops (exit 2, one line naming NAME) on a machine without a working NVIDIA GPU,
# sets up .venv if missing (scripts/setup.sh installs the CUDA vllm when nvidia-smi works) and stops if
# .venv's torch has no CUDA.
require_cuda_venv() {
  local name=$1
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "$name: no NVIDIA GPU here (nvidia-smi -L fails); on CPU use --dry-run" >&2
    exit 2
  fi
  nvidia-smi -L
  [ -x .venv/bin/python ] || make setup
  if ! .venv/bin/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "$name: .venv's torch has no CUDA (made on a CPU machine?): remove .venv and rerun" >&2
    exit 2
  fi
}
