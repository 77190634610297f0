#!/usr/bin/env bash
# A GPU check that needs neither vLLM nor DeepSpeed (for a CUDA machine whose Python has torch and
# transformers but no package index): rlmm probe with the transformers sampler against trainer=fsdp and
# trainer=torch on a Qwen2.5-0.5B-architecture model (random init, 151,936-token vocabulary) in bf16,
# fp16, fp32 and bf16 + fp32 head, each trainer against itself at micro-batch sizes 1 and 32; then 3
# steps of rlmm train with trainer=fsdp and algo=ppo (its critic too), the FSDP weight sync's peak memory
# (benchmarks/weight_sync_memory.py, one rank), and the micro-batch layouts' train phase (benchmarks/layouts.py).
# Writes gpu_fsdp_check.json and layouts.json (the figures) and the runs' logs into $OUT (or ./gpu_fsdp_check).
#   Prepared here:   PY_SITE=.gpu_site (hydra, omegaconf, antlr4, submitit copied from .venv: pure Python),
#                    MODEL_FILES=.gpu_model (the fullvocab model's config and tokenizer files)
#   On the GPU:      bash scripts/gpu_fsdp_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_fsdp_check}
mkdir -p "$out" /tmp/site /tmp/runs
cp -r "${PY_SITE:-.gpu_site}"/. /tmp/site/
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
nvidia-smi -L 2>/dev/null || echo "no NVIDIA GPU here: the runs use the CPU"
$python - "${MODEL_FILES:-.gpu_model}" <<'EOF'
import shutil, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
torch.manual_seed(0)
config = AutoConfig.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
model.save_pretrained("/tmp/qwen")
for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    shutil.copy(f"{sys.argv[1]}/{name}", f"/tmp/qwen/{name}")
print("model", sum(p.numel() for p in model.parameters()), "parameters, vocabulary", config.vocab_size, "torch",
      torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
EOF
common=(model=hf model.path=/tmp/qwen sampler=hf logger=none sampling.max_new_tokens=64)
probe=(probe.num_prompts=32 "probe.trainer_micro_batch_sizes=[1,32]" probe.batch_invariance.num_prompts=4
       probe.batch_invariance.num_completions=4 probe.batch_invariance.max_batch_size=16)
run() {  # name, then the command's arguments
  local name=$1; shift
  local started=$SECONDS
  if $python -m rlmm.cli "$@" hydra.run.dir=/tmp/runs/$name > /tmp/runs/$name.log 2>&1; then
    echo "$name ok in $((SECONDS - started)) s"
  else
    echo "$name FAILED in $((SECONDS - started)) s"; tail -5 /tmp/runs/$name.log
  fi
}
if [ "${ONLY:-all}" = all ]; then  # ONLY=train: the training run alone; ONLY=layouts: benchmarks/layouts.py alone
  for trainer in fsdp torch; do
    for precision in bf16 fp16 fp32 bf16_fp32head; do
      run probe-$trainer-$precision probe "${common[@]}" "${probe[@]}" trainer=$trainer precision=$precision
    done
  done
fi
# The weight sync's extra peak GPU memory: full state dict vs one tensor at a time (benchmarks/README.md).
if [ "${ONLY:-all}" != layouts ]; then
  started=$SECONDS
  if $python -m torch.distributed.run --standalone --nproc_per_node 1 benchmarks/weight_sync_memory.py /tmp/qwen \
      "$out/weight_sync_memory_gpu.json" > /tmp/runs/weight_sync_memory.log 2>&1; then
    echo "weight_sync_memory ok in $((SECONDS - started)) s"
  else
    echo "weight_sync_memory FAILED"; tail -5 /tmp/runs/weight_sync_memory.log
  fi
fi
# The micro-batch layouts' train phase (issue 16): padded vs token budgets vs padding-free (flash-attention 2's
# varlen kernel when flash_attn is installed, else sdpa's block-diagonal mask), FSDP bf16, Qwen2.5-0.5B's
# architecture on GSM8K-shaped lengths (benchmarks/layouts.py; on a machine without CUDA its tiny dry size).
if [ "${ONLY:-all}" = all ] || [ "${ONLY:-all}" = layouts ]; then
  if $python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    layouts=(--workload varlen-gpu --device cuda --precision bf16 --budget 4096,8192,16384 --repeats 3)
  else
    layouts=(--workload varlen-dry --device cpu --precision fp32 --budget 64,128 --repeats 1)
  fi
  started=$SECONDS
  if $python -m benchmarks.layouts --trainer fsdp "${layouts[@]}" --out "$out/layouts.json" \
      > /tmp/runs/layouts.log 2>&1; then
    echo "layouts ok in $((SECONDS - started)) s"
  else
    echo "layouts FAILED in $((SECONDS - started)) s"; tail -5 /tmp/runs/layouts.log
  fi
fi
[ "${ONLY:-all}" = layouts ] && exit 0
run train-fsdp-ppo train "${common[@]}" trainer=fsdp algo=ppo precision=bf16 debug=train train.steps=3 \
    sampling.max_new_tokens=64 algo.group_size=4 train.prompts_per_step=8
$python - "$out" <<'EOF'
import glob, json, os, shutil, sys
out = sys.argv[1]
figures = {}
for path in sorted(glob.glob("/tmp/runs/*/probe.json")):
    record = json.load(open(path))
    figures[path.split("/")[-2]] = {
        "precision": record["precision"]["actual"], "seconds": record["seconds"],
        "sampler_vs_trainer": {k: record["sampler_vs_trainer"][k] for k in
                               ("logprob_abs_diff_mean", "logprob_abs_diff_max", "kl_k3", "prob_pearson")},
        "trainer_vs_itself": {k: record["trainer_vs_itself"][k] for k in
                              ("micro_batch_sizes", "logprob_abs_diff_mean", "logprob_abs_diff_max")},
        "mean_response_length": record["rollouts"]["mean_response_length"]}
for path in sorted(glob.glob("/tmp/runs/*/summary.json")):
    figures[path.split("/")[-2]] = json.load(open(path))
json.dump(figures, open(f"{out}/gpu_fsdp_check.json", "w"), indent=2, default=str)
shutil.make_archive(f"{out}/logs", "gztar", "/tmp/runs")
print(json.dumps({k: v.get("sampler_vs_trainer", v.get("eval_accuracy_end")) for k, v in figures.items()}, indent=1))
EOF
