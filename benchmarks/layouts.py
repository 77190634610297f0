"""The train phase alone under each micro-batch layout, interleaved in one process (the varlen rows).

    .venv/bin/python -m benchmarks.layouts [--budget 1024] [--repeats 2] [--out FILE.json]
    python -m benchmarks.layouts --workload varlen-gpu --device cuda --precision bf16 --trainer fsdp \
        --budget 4096,8192,16384          # on a GPU (scripts/gpu_fsdp_check.sh runs this)

Why beside the suite: the suite runs each layout in its own process, minutes apart, and on a shared machine
the load changes between them; here every layout trains on the same minibatches one after the other, in
rotating order, so a change of load falls on all of them alike. What is timed: one optimizer step on a
minibatch of the workload's rows (its model, its prompts, its forced response lengths; response tokens
drawn at random, which costs the same as sampled ones), `rlmm.trainers.update.minibatch_step` with a
policy-gradient loss normalised by the minibatch's tokens (rlmm/run/step.py's normalisation): every
micro-batch's forward, backward, and the optimizer step. The layout is swapped on the one trainer
(`trainer.batching`), so every layout runs the same weights, engine and threads. Layouts: padded (the
workload's micro-batch size), padding-free, and for each `--budget` a token budget with and without
padding-free. A padding-free layout gets what the trainer would give it (`use_varlen_attention`:
flash-attention 2's varlen kernel on CUDA in 16 bits when `flash_attn` is installed), a padded one sdpa.

Per layout: median wall and CPU seconds (time.process_time: this process, all threads) of an update, the
positions computed (padding included), the micro-batch count, the attention implementation, whether
gradient checkpointing was on (rlmm decides per update from the largest micro-batch), and the peak
memory above the update's start: RSS on CPU (VmHWM reset through /proc/self/clear_refs before each
update), `torch.cuda.max_memory_allocated` on CUDA (reset before each update; the clock waits for the GPU).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import WORKLOADS, forced_lengths, machine_info, set_runtime_env, write_record


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    return 0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.layouts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="varlen", choices=["varlen", "varlen-gpu", "varlen-dry"])
    parser.add_argument("--budget", default="1024",
                        help="trainer.micro_batch_tokens of the budget layouts (comma-separated for several)")
    parser.add_argument("--repeats", type=int, default=2, help="passes over the minibatches (after one warm-up)")
    parser.add_argument("--trainer", default="deepspeed", choices=["deepspeed", "fsdp", "torch"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"], help="the trainer's body")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    try:
        budgets = [int(b) for b in args.budget.split(",")]
        assert budgets and all(b >= 1 for b in budgets)
    except (ValueError, AssertionError):
        parser.error(f"--budget: token counts >= 1, comma-separated (e.g. 1024 or 4096,8192), got {args.budget!r}")
    set_runtime_env(args.device)
    import torch
    from transformers import AutoTokenizer

    from benchmarks.models import SIZES, build_bench_model
    from rlmm.config.options import from_yaml
    from rlmm.models.tiny import default_cache_dir
    from rlmm.policy.precision import SidePrecision
    from rlmm.policy.rollouts import Rollouts, SamplingOptions
    from rlmm.trainers.packing import MicroBatching, use_varlen_attention
    from rlmm.trainers.scoring import row_tokens
    from rlmm.trainers.update import minibatch_step

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    w = WORKLOADS[args.workload]
    import hashlib

    key = hashlib.sha256(json.dumps(SIZES[w.model], sort_keys=True).encode()).hexdigest()[:8]
    path = default_cache_dir() / "benchmarks" / f"{w.model}-{key}"
    build_bench_model(path, **SIZES[w.model])
    tokenizer = AutoTokenizer.from_pretrained(path)
    task = from_yaml("task", "arithmetic", seed=0)
    steps = w.warmup + w.steps
    lengths = forced_lengths(w.response_lengths, steps * w.rollouts)
    prompts = [tokenizer(e.prompt).input_ids for e in task.examples("train", steps * w.prompts)]
    generator = torch.Generator().manual_seed(0)
    minibatches = []
    for step in range(steps):
        rows = range(step * w.rollouts, (step + 1) * w.rollouts)
        responses = [torch.randint(3, tokenizer.eos_token_id, (lengths[k],), generator=generator).tolist() for k in rows]
        minibatches.append(Rollouts([prompts[k // w.group_size] for k in rows], responses,
                                    [torch.zeros(len(r)) for r in responses], ["length"] * len(responses)))
    sampling = SamplingOptions(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=w.max_new_tokens,
                               logprobs="processed",
                               support=from_yaml("support", "sampler"))
    precision = SidePrecision(args.precision, False)
    trainer = from_yaml("trainer", args.trainer, model_path=str(path), precision=precision,
                        sampling=sampling, micro_batch_size=w.micro_batch_size)
    model = trainer.model  # the transformers model (inside DeepSpeed's engine, FSDP's shards)
    device = next(model.parameters()).device
    layouts = {"padded": MicroBatching(w.micro_batch_size, None, False),
               "packed": MicroBatching(w.micro_batch_size, None, True)}
    for budget in budgets:
        suffix = "" if len(budgets) == 1 else f"_{budget}"
        layouts[f"budget{suffix}"] = MicroBatching(w.micro_batch_size, budget, False)
        layouts[f"budget_packed{suffix}"] = MicroBatching(w.micro_batch_size, budget, True)
    cuda = device.type == "cuda"

    def loss_fn_for(rollouts):
        total = sum(map(len, rollouts.response_ids))
        advantages = torch.linspace(-1, 1, len(rollouts))

        def loss_fn(rows, logprobs, entropy):
            mask = torch.zeros_like(logprobs, dtype=torch.bool)
            for i, row in enumerate(rows):
                mask[i, :len(rollouts.response_ids[row])] = True
            loss = -torch.where(mask, advantages[rows].to(logprobs.device)[:, None] * logprobs, 0.0).sum() / total
            return loss, {"loss": loss.item()}
        return loss_fn

    def update(name: str, rollouts) -> dict:
        layout = trainer.batching = layouts[name]
        if layout.padding_free:
            attention = use_varlen_attention(model, device, precision.dtype)
        else:
            model.set_attn_implementation("sdpa")
            attention = "sdpa"
        rows = list(range(len(rollouts)))
        micro = layout.split(row_tokens(rollouts, rows), rows)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            before = rss_kib("VmRSS:") * 1024
        wall, cpu = time.perf_counter(), time.process_time()
        minibatch_step(trainer, rollouts, rows, loss_fn_for(rollouts))
        if cuda:
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        peak = torch.cuda.max_memory_allocated() if cuda else rss_kib("VmHWM:") * 1024
        return {"layout": name, "wall": wall, "cpu": cpu, "peak_above_mib": (peak - before) / 2 ** 20,
                "micro_batches": len(micro), "attention": attention,
                # rlmm turns it on per update when the largest micro-batch would not fit (rlmm/trainers/memory.py)
                "gradient_checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
                "positions": sum(layout.positions(row_tokens(rollouts, m)) for m in micro),
                "tokens": sum(row_tokens(rollouts, rows))}

    names = list(layouts)
    for name in names:  # warm-up: one update per layout on the warm-up step's rows, not counted
        update(name, minibatches[0])
    runs = []
    for repeat in range(args.repeats):
        for index, rollouts in enumerate(minibatches[w.warmup:]):
            shift = (repeat + index) % len(names)
            for name in names[shift:] + names[:shift]:  # rotating order
                runs.append({**update(name, rollouts), "minibatch": index, "repeat": repeat})
                print(json.dumps(runs[-1]), flush=True)
    summary = {}
    for name in names:
        mine = [r for r in runs if r["layout"] == name]
        summary[name] = {"wall_median": statistics.median(r["wall"] for r in mine),
                         "cpu_median": statistics.median(r["cpu"] for r in mine),
                         "wall_sum": sum(r["wall"] for r in mine), "cpu_sum": sum(r["cpu"] for r in mine),
                         "peak_above_mib_max": max(r["peak_above_mib"] for r in mine),
                         "attention": mine[0]["attention"], "micro_batch_tokens": layouts[name].tokens,
                         "gradient_checkpointing": sorted({r["gradient_checkpointing"] for r in mine}),
                         "positions_per_minibatch": [r["positions"] for r in mine if r["repeat"] == 0],
                         "micro_batches": [r["micro_batches"] for r in mine if r["repeat"] == 0]}
    for name in names:
        summary[name]["cpu_speedup_vs_padded"] = summary["padded"]["cpu_sum"] / summary[name]["cpu_sum"]
        summary[name]["wall_speedup_vs_padded"] = summary["padded"]["wall_sum"] / summary[name]["wall_sum"]
    record = {"machine": machine_info(), "budgets": budgets, "trainer": args.trainer, "workload": w.name,
              "device": device.type, "precision": args.precision, "memory": "cuda allocated" if cuda else "rss",
              "tokens_per_minibatch": [r["tokens"] for r in runs if r["repeat"] == 0 and r["layout"] == "padded"],
              "summary": summary, "runs": runs,
              "command": "python -m benchmarks.layouts " + " ".join(sys.argv[1:] if argv is None else argv)}
    print(json.dumps(summary, indent=1))
    write_record("layouts", record, args.out)
    trainer.close()


if __name__ == "__main__":
    main()
