"""What rounding RoPE's inverse frequencies to bf16 does to a bf16 model's log-probs, by position.

    .venv/bin/python scripts/rope_precision.py MODEL_DIR [--prompts 6] [--tokens 300]

Samples `--tokens`-token continuations of GSM8K sample questions (tests/data/gsm8k_sample.jsonl) from the
fp32 model, then scores them with the model in bf16 two ways: transformers' `from_pretrained(dtype=
bfloat16)` (frequencies fp32, as rlmm loads since 1fbb431) and the fp32 model cast whole with
`.to(bfloat16)` (frequencies rounded: what rlmm's `sampler=hf` and `trainer=torch` did before). Prints mean
|log p_bf16 - log p_fp32| over all positions and over the first and last 50.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent


def response_logprobs(model, sequence: torch.Tensor, prompt_length: int) -> torch.Tensor:
    with torch.no_grad():
        logits = model(sequence[None]).logits[0, prompt_length - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, sequence[prompt_length:, None])[:, 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=300)
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows = [json.loads(line) for line in open(ROOT / "tests" / "data" / "gsm8k_sample.jsonl")][:args.prompts]
    fp32 = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    sequences = []
    with torch.no_grad():
        for row in rows:
            prompt = tokenizer(row["question"]).input_ids
            out = fp32.generate(torch.tensor([prompt]), max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                                do_sample=True, top_k=0, temperature=1.0, pad_token_id=tokenizer.pad_token_id)
            sequences.append((len(prompt), out[0]))
    reference = [response_logprobs(fp32, s, n) for n, s in sequences]
    loaded = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()
    cast = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval().to(torch.bfloat16)
    variants = {"from_pretrained(dtype=bf16)": loaded, ".to(bf16), frequencies rounded": cast}
    for name, model in variants.items():
        frequencies = next(b for n, b in model.named_buffers() if n.endswith("inv_freq"))
        d = torch.stack([(response_logprobs(model, s, n) - r).abs() for (n, s), r in zip(sequences, reference)])
        print(f"{name:32s} inv_freq {str(frequencies.dtype):15s} mean |d| {d.mean():.3e}  "
              f"positions 0-49 {d[:, :50].mean():.3e}  last 50 {d[:, -50:].mean():.3e}")


if __name__ == "__main__":
    main()
