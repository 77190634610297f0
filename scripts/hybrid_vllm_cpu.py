"""What vLLM on this machine runs of hybrid models, tried on tiny random checkpoints (hidden 256, the built-in character
tokenizer), each in a process of its own (a refused engine is not reusable):

    python scripts/hybrid_vllm_cpu.py head-dims [DIM ...]         Gated DeltaNet head dims (default: 16 32 64 128 256)
    python scripts/hybrid_vllm_cpu.py architectures [ARCH ...]    hybrid families, bf16 and fp32 (default: all below)

`head-dims` builds a Qwen3-Next (three Gated DeltaNet layers, one attention layer) per head dim and asks vLLM for 4
tokens in bf16: "accepted" or the kernel's refusal (rlmm/models/hybrid.py's CPU_LINEAR_HEAD_DIMS is what it printed).
`architectures` samples 12 tokens with vLLM in each dtype and rescores them with transformers in the same dtype:
the mean and max |Δ log p| between the two engines, or the engine's error. docs/hybrid.md gives what it printed.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

BUILD = r'''
import sys, torch, transformers as T
from rlmm.models.tiny import build_char_tokenizer
arch, dim, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
tok = build_char_tokenizer()
common = dict(vocab_size=len(tok), hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
mamba = dict(mamba_n_heads=8, mamba_d_head=64, mamba_d_state=64, mamba_n_groups=1, mamba_chunk_size=64)
if arch == "qwen3_next":
    heads = max(1, 256 // dim)
    config = T.Qwen3NextConfig(**common, num_hidden_layers=4, head_dim=64, linear_key_head_dim=dim,
        linear_value_head_dim=dim, linear_num_key_heads=heads, linear_num_value_heads=heads, num_experts=1,
        num_experts_per_tok=1, moe_intermediate_size=352, shared_expert_intermediate_size=352, mlp_only_layers=[],
        layer_types=["linear_attention"] * 3 + ["full_attention"])
elif arch == "falcon_h1":
    config = T.FalconH1Config(**common, num_hidden_layers=2, intermediate_size=512, head_dim=64, mamba_d_ssm=512,
                              **{k: v for k, v in mamba.items()})
elif arch == "nemotron_h":
    config = T.NemotronHConfig(**common, num_hidden_layers=4, hybrid_override_pattern="M-M*", intermediate_size=512,
                               mamba_num_heads=8, mamba_head_dim=64, ssm_state_size=64, n_groups=1, chunk_size=64,
                               head_dim=64)
elif arch == "granitemoehybrid":
    config = T.GraniteMoeHybridConfig(**common, num_hidden_layers=4, intermediate_size=512, num_local_experts=0,
                                      shared_intermediate_size=512, layer_types=["mamba", "mamba", "attention", "mamba"],
                                      **mamba)
elif arch == "lfm2":
    config = T.Lfm2Config(**common, num_hidden_layers=4, intermediate_size=512,
                          layer_types=["conv", "conv", "full_attention", "conv"])
torch.manual_seed(0)
model = T.AutoModelForCausalLM.from_config(config)
model.save_pretrained(out)
tok.save_pretrained(out)
'''

SAMPLE = r'''
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm import LLM, SamplingParams
out, dtype, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
llm = LLM(model=out, dtype=dtype, enforce_eager=True, seed=0, max_model_len=256, logprobs_mode="raw_logprobs",
          kv_cache_memory_bytes=64 << 20)
sample = llm.generate(["12+34="], SamplingParams(max_tokens=tokens, temperature=1.0, logprobs=0, seed=1))[0].outputs[0]
model = AutoModelForCausalLM.from_pretrained(out, dtype=getattr(torch, dtype)).eval()
prompt = AutoTokenizer.from_pretrained(out)("12+34=")["input_ids"]
ids = torch.tensor([prompt + list(sample.token_ids)])
with torch.no_grad():
    scored = torch.log_softmax(model(ids).logits.float(), -1)[0, len(prompt) - 1:-1]
trainer = scored.gather(-1, torch.tensor(sample.token_ids)[:, None])[:, 0]
sampler = torch.tensor([step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)])
gap = (trainer - sampler).abs()
print(f"RESULT mean |d log p| {gap.mean().item():.2e}, max {gap.max().item():.2e} over {len(gap)} tokens")
'''

ARCHITECTURES = ("qwen3_next", "falcon_h1", "nemotron_h", "granitemoehybrid", "lfm2")


def run(arch: str, dim: int, dtype: str, tokens: int) -> str:
    """What vLLM said of `arch` in `dtype`: its RESULT line, or its last error line."""
    root = str(Path(__file__).resolve().parent.parent)  # rlmm's tokenizer, wherever this is run from
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory() as out:
        built = subprocess.run([sys.executable, "-c", BUILD, arch, str(dim), out], capture_output=True, text=True, env=env)
        if built.returncode:
            return f"not built: {last_error(built.stderr)}"
        ran = subprocess.run([sys.executable, "-c", SAMPLE, out, dtype, str(tokens)], capture_output=True, text=True,
                             env=env)
    results = [line for line in ran.stdout.splitlines() if line.startswith("RESULT")]
    return results[-1].removeprefix("RESULT ") if results else f"refused: {last_error(ran.stdout + ran.stderr)}"


def last_error(text: str) -> str:
    errors = [line.strip().removeprefix("[rank0]: ") for line in text.splitlines() if "Error" in line]
    return errors[-1][:240] if errors else "no error line"


def main(argv: list[str]) -> None:
    what, values = (argv[0] if argv else "architectures"), argv[1:]
    if what == "head-dims":
        for dim in [int(v) for v in values] or [16, 32, 64, 128, 256]:
            said = run("qwen3_next", dim, "bfloat16", 4)
            print(f"head dim {dim}: {'accepted' if said.startswith('mean') else said}", flush=True)
    elif what == "architectures":
        for arch in values or ARCHITECTURES:
            for dtype in ("bfloat16", "float32"):
                print(f"{arch} {dtype}: {run(arch, 64, dtype, 12)}", flush=True)
    else:
        sys.exit(f"scripts/hybrid_vllm_cpu.py: unknown command {what!r} (allowed: head-dims, architectures)")


if __name__ == "__main__":
    main(sys.argv[1:])
