"""transformers' expert kernels on the built-in MoE model (`model=tiny_moe`), on this machine: whether rlmm's
trainers should load another one than transformers' default (grouped_mm) on a CPU. On the AVX2 machine of
2026-12-01 grouped_mm was the faster (benchmarks/README.md), so the loaders keep the default.

    .venv/bin/python -m benchmarks.moe_experts [--repeats 5] [--rows 128] [--tokens 14] [--threads 1] [--out FILE.json]

One batch of `rows` x `tokens` token ids (the default step's 16 prompts x 8 samples, ~14 tokens a row), in fp32,
through the shipped checkpoint loaded once per kernel: a no-grad forward (π_old's scoring) and a forward with the
backward of a log-sum-exp loss (an update's micro-batch). The kernels run in rotating order within each repeat (a
change of load falls on each alike); medians over the repeats, and the largest |Δ logit| against "eager".
"""
from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import machine_info, set_runtime_env, write_record

KERNELS = ("eager", "grouped_mm")  # "batched_mm" ran 60-100x slower than eager here: not worth its minutes


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=14)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    set_runtime_env()
    import torch
    from transformers import AutoModelForCausalLM

    from rlmm.models.tiny import BUILTIN_DIR

    torch.set_num_threads(args.threads)
    path = str(next(BUILTIN_DIR.glob("tiny_moe-*")))  # the shipped model=tiny_moe
    models = {k: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation=k)
              for k in KERNELS}
    ids = torch.randint(4, 60, (args.rows, args.tokens), generator=torch.Generator().manual_seed(0))
    times: dict[str, dict[str, list[float]]] = {k: {"forward": [], "forward_backward": []} for k in KERNELS}
    logits = {}
    for repeat in range(args.repeats + 1):  # the first round warms up and is not counted
        for kernel in KERNELS[repeat % len(KERNELS):] + KERNELS[:repeat % len(KERNELS)]:
            model = models[kernel]
            start = time.perf_counter()
            with torch.no_grad():
                logits[kernel] = model(input_ids=ids).logits
            middle = time.perf_counter()
            model(input_ids=ids).logits.logsumexp(-1).sum().backward()
            end = time.perf_counter()
            model.zero_grad()
            if repeat:
                times[kernel]["forward"].append(middle - start)
                times[kernel]["forward_backward"].append(end - middle)
    summary = {k: {part: statistics.median(v) for part, v in parts.items()} for k, parts in times.items()}
    for kernel in KERNELS:
        summary[kernel]["vs_eager"] = {part: summary[kernel][part] / summary["eager"][part] for part in times[kernel]}
        summary[kernel]["max_abs_logit_diff_vs_eager"] = (logits[kernel] - logits["eager"]).abs().max().item()
    print(f"{'kernel':<12}{'forward s':>12}{'fwd+bwd s':>12}{'x eager (fwd, fwd+bwd)':>26}{'max |Δ logit|':>16}")
    for kernel, s in summary.items():
        print(f"{kernel:<12}{s['forward']:>12.3f}{s['forward_backward']:>12.3f}"
              f"{s['vs_eager']['forward']:>13.2f}{s['vs_eager']['forward_backward']:>13.2f}"
              f"{s['max_abs_logit_diff_vs_eager']:>16.3g}")
    record = {"args": vars(args), "machine": machine_info(), "summary": summary, "times": times}
    print("record:", write_record("moe_experts", record, args.out))
    return record


if __name__ == "__main__":
    main()
