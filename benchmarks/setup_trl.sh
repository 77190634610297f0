#!/usr/bin/env bash
# Create benchmarks/.venv-trl: TRL (and what it needs that rlmm's venv lacks) for the peer benchmark,
# without touching the project's .venv. The new venv sees .venv's packages (torch, vLLM, transformers,
# DeepSpeed, rlmm) through a .pth hook, and every package .venv already has is pinned to .venv's version,
# so TRL runs on exactly the same torch/transformers/vLLM as rlmm.
#   bash benchmarks/setup_trl.sh          (idempotent; TRL_VERSION=... to pick another TRL)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
TRL_VENV=benchmarks/.venv-trl
TRL_VERSION=${TRL_VERSION:-1.16.0}   # 1.16.0: transformers>=4.56.2 (accepts .venv's 5.19); see README
if [ -x "$TRL_VENV/bin/python" ] && "$TRL_VENV/bin/python" -c "import trl, sys; sys.exit(trl.__version__ != '$TRL_VERSION')" 2>/dev/null; then
  echo "benchmarks/.venv-trl: trl $TRL_VERSION already installed"; exit 0
fi
base=$(sed -n 's/^home = //p' "$VENV/pyvenv.cfg")/python3
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
"$base" -m venv "$TRL_VENV"
trl_site=$("$TRL_VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# addsitedir (not a bare path) so .venv's own .pth files (rlmm's editable install) are processed too.
echo "import site; site.addsitedir('$(realpath "$site")')" > "$trl_site/_rlmm_venv.pth"
"$VENV/bin/python" -m pip freeze --exclude-editable | grep -v '^-e ' | grep -v ' @ ' > "$TRL_VENV/constraints.txt"
"$TRL_VENV/bin/python" -m pip install -q --upgrade pip
"$TRL_VENV/bin/python" -m pip install -q -c "$TRL_VENV/constraints.txt" "trl==$TRL_VERSION"
"$TRL_VENV/bin/python" -c "import trl, transformers, torch; print('trl', trl.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
