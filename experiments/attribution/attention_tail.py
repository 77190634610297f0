"""Why `sampler=hf trainer=deepspeed precision=bf16` agrees bit for bit on some CPUs and not on others.

The layer attribution (`rlmm probe sampler=hf trainer=deepspeed precision=bf16 probe.layers=true`) puts the first
difference at layer 0's attention block, at prompt positions: the sampler's prefill (its prompts left-padded to the
longest prompt of the batch) against the trainer's scoring (prompt + response right-padded to the longest row of
its micro-batch). The same query attends to the same keys on both sides; only the padded width of the key axis
differs, and the padded keys are masked (they add exact zeros). This script shows that torch's bf16
scaled_dot_product_attention on a CPU gives the same query rows different bits when only the number of masked
padding keys changes, and that it does so on the machine's vectorized kernels and not on ATen's unvectorized ones:
for each unpadded key length n (the rows here are 3-13 tokens long), a mark per padded width W = n .. 39: '.' the
same bits as unpadded, 'x' not.

    .venv/bin/python experiments/attribution/attention_tail.py

It runs itself twice, under the machine's own kernels and under ATEN_CPU_CAPABILITY=default.
"""
from __future__ import annotations

import os
import subprocess
import sys

HEADS, HEAD_DIM, WIDEST = 4, 64, 40


def pattern() -> list[str]:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    lines = []
    for n in (3, 7, 10, 13):
        q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM).to(torch.bfloat16) for _ in range(3))
        alone = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        marks = []
        for width in range(n, WIDEST):
            padding = lambda t: torch.cat([t, torch.randn(1, HEADS, width - n, HEAD_DIM).to(torch.bfloat16)], 2)
            mask = torch.zeros(width, width, dtype=torch.bool)
            mask[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
            mask[n:, :] = True  # padding rows attend to everything (their output is dropped)
            padded = F.scaled_dot_product_attention(padding(q), padding(k), padding(v), attn_mask=mask)[:, :, :n]
            marks.append("." if torch.equal(padded, alone) else "x")
        lines.append(f"n = {n:2d} keys, padded to {n:2d}..{WIDEST - 1}: {''.join(marks)}")
    return lines


if __name__ == "__main__":
    if sys.argv[1:] == ["--one"]:
        import torch

        print(f"torch {torch.__version__}, ATen CPU capability {torch.backends.cpu.get_cpu_capability()}")
        print("\n".join(pattern()))
    else:
        for capability in (None, "default"):
            env = dict(os.environ)
            if capability:
                env["ATEN_CPU_CAPABILITY"] = capability
            subprocess.run([sys.executable, __file__, "--one"], env=env, check=True)
