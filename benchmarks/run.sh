#!/usr/bin/env bash
# The benchmark suite in one command (see benchmarks/README.md). Never part of the tests.
#   bash benchmarks/run.sh --quiet-machine   # default + large, fp32 + bf16: rlmm, parts, TRL (vLLM, transformers)
#   bash benchmarks/run.sh --size smoke      # a minute or two: checks that every piece runs
# Any argument goes to `python -m benchmarks.suite` (--help lists them). Results and logs:
# benchmarks/results/<date>_<time>/. Sets up .venv (make setup) and benchmarks/.venv-trl on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || make setup
bash benchmarks/setup_trl.sh || echo "benchmarks/run.sh: TRL could not be installed; its rows will say skipped" >&2
exec .venv/bin/python -m benchmarks.suite "$@"
