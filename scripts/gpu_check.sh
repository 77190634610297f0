#!/usr/bin/env bash
# The prepared GPU check (issue 12): rlmm on a Qwen2.5-0.5B-architecture model on one CUDA GPU (vLLM CUDA
# sampler, DeepSpeed CUDA trainer), for a user's GPU node with a package index. Parts, each under 8 minutes on
# an H200 (estimates: not yet run on a GPU), so each fits a machine lent for 8 minutes at a time:
#   setup  make setup (.venv with CUDA vLLM, ~3 GB of wheels: minutes, depending on the network); nothing else
#   probe  rlmm probe in bf16, fp16, fp32 and bf16_fp32head (~5 min: 4 vLLM starts, eager, ~70 s each)
#   train  3 steps of rlmm train (bf16), then standalone vLLM on the same prompts (~3 min)
#   sweep  a 2-job sweep through hydra/launcher=process (bf16, fp32) (~2.5 min)
#   routing  the shipped MoE model (model=tiny_moe): vLLM's routed-experts capture on CUDA and the trainer's
#          replay (routing=r3): a probe and 2 train steps (~3 min; docs/routing.md)
#   staleness  benchmarks/staleness.py: the step at staleness 0, 1, and 1 overlapped (the sampler on a GPU of its
#          own: needs 2 GPUs, else that row is skipped) (~4 min; issue 26)
#   truncation  rlmm probe with top-p 0.9 / top-k 50 under support=sampler|trainer|full: vLLM's own sampling mask
#          (return_sampling_mask, Model Runner V2) as the kept sets, their cost a token at 151,936 tokens (~4 min; issue 48)
#   bitwise  2 train steps in bf16 of vLLM, of vLLM's batch-invariant kernels and of sampler=bitwise: each step's
#          agreement/frac_tokens_identical (expected 1.0 for sampler=bitwise only; ~3 min; issue 52)
# Without --part all of them run in turn (10-12 minutes after setup). Writes scale_check.json (scale_check_<part>.json
# for one part: mismatch per precision, step time by stage, peak GPU memory, tokens/s against standalone vLLM)
# into $OUT/scale_check when OUT is set, else benchmarks/results/scale_gpu_<date>/ (pass --out DIR to put the
# parts side by side).
#   bash scripts/gpu_check.sh                      # on a CUDA machine, everything
#   bash scripts/gpu_check.sh --part setup         # then --part probe, --part train, --part sweep
#   bash scripts/gpu_check.sh --dry-run [--part P] # here, on CPU: the same code path with a tiny model (minutes)
# Other arguments go to scripts/scale_check.py (e.g. --precisions bf16 fp32, or overrides such as
# trainer.zero_stage=2). The check for the machine this project can be lent (no vLLM, no package index) is
# scripts/gpu_lent_check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
args=()
dry_run=0
part=all
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --part) part=${2:?--part needs one of setup, probe, train, sweep, routing, staleness, quantized, truncation, bitwise}; shift ;;
    --part=*) part=${1#--part=} ;;
    *) args+=("$1") ;;
  esac
  shift
done
case "$part" in
  all|setup|probe|train|sweep|routing|staleness|quantized|truncation|bitwise) ;;
  *) echo "gpu_check.sh: --part $part (allowed: setup, probe, train, sweep, routing, staleness, quantized, truncation, bitwise)" >&2; exit 2 ;;
esac
out=()
[ -n "${OUT:-}" ] && out=(--out "$OUT/scale_check")
[ "$part" = setup ] || [ "$part" = all ] || args=(--part "$part" "${args[@]}")
if [ "$dry_run" = 1 ]; then
  [ -x .venv/bin/python ] || make setup
  [ "$part" = setup ] && exit 0
  exec .venv/bin/python scripts/scale_check.py gpu --dry-run --timeout 900 "${out[@]}" "${args[@]}"
fi
source scripts/require_cuda_venv.sh
require_cuda_venv scripts/gpu_check.sh
[ "$part" = setup ] && exit 0
exec .venv/bin/python scripts/scale_check.py gpu --timeout 420 "${out[@]}" "${args[@]}"
