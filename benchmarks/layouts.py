"""The train phase alone under each micro-batch layout, interleaved in one process (the varlen rows).

    .venv/bin/python -m benchmarks.layouts [--budget 1024] [--repeats 2] [--out FILE.json]

Why beside the suite: the suite runs each layout in its own process, minutes apart, and on a shared machine
the load changes between them; here every layout trains on the same minibatches one after the other, in
rotating order, so a change of load falls on all of them alike. What is timed: one optimizer step on a
minibatch of the `varlen` workload's rows (its model, its prompts, its forced response lengths; response
tokens drawn at random, which costs the same as sampled ones), `rlmm.trainers.scoring.minibatch_step` with a
policy-gradient loss normalised by the minibatch's tokens (rlmm/step.py's normalisation): every
micro-batch's forward, backward, and the DeepSpeed step. The layout is swapped on the one trainer
(`trainer.batching`), so every layout runs the same weights, engine and threads.

Per layout: median wall and CPU seconds (time.process_time: this process, all threads) of an update, the
positions computed (padding included) and the micro-batch count, and the peak RSS above the RSS before the
update (VmHWM reset through /proc/self/clear_refs before each update).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import ROOT, WORKLOADS, forced_lengths, machine_info, set_runtime_env


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    return 0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.layouts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=int, default=1024, help="trainer.micro_batch_tokens of the budget layouts")
    parser.add_argument("--repeats", type=int, default=2, help="passes over the minibatches (after one warm-up)")
    parser.add_argument("--trainer", default="deepspeed")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    set_runtime_env("cpu")
    import torch
    from transformers import AutoTokenizer

    from benchmarks.models import SIZES, build_bench_model
    from rlmm.config import from_yaml
    from rlmm.models.tiny import default_cache_dir
    from rlmm.precision import SidePrecision
    from rlmm.samplers.base import Rollouts, SamplingOptions
    from rlmm.trainers.packing import MicroBatching
    from rlmm.trainers.scoring import minibatch_step, row_tokens

    w = WORKLOADS["varlen"]
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
                               logprobs="processed")
    trainer = from_yaml("trainer", args.trainer, model_path=str(path), precision=SidePrecision("fp32", False),
                        sampling=sampling, micro_batch_size=w.micro_batch_size, accumulation_steps=1)
    layouts = {"padded": MicroBatching(w.micro_batch_size, None, False),
               "budget": MicroBatching(w.micro_batch_size, args.budget, False),
               "packed": MicroBatching(w.micro_batch_size, None, True),
               "budget_packed": MicroBatching(w.micro_batch_size, args.budget, True)}

    def loss_fn_for(rollouts):
        total = sum(map(len, rollouts.response_ids))
        advantages = torch.linspace(-1, 1, len(rollouts))

        def loss_fn(rows, logprobs, entropy):
            mask = torch.zeros_like(logprobs, dtype=torch.bool)
            for i, row in enumerate(rows):
                mask[i, :len(rollouts.response_ids[row])] = True
            loss = -torch.where(mask, advantages[rows][:, None] * logprobs, 0.0).sum() / total
            return loss, {"loss": loss.item()}
        return loss_fn

    def update(name: str, rollouts) -> dict:
        trainer.batching = layouts[name]
        rows = list(range(len(rollouts)))
        micro = layouts[name].split(row_tokens(rollouts, rows), rows)
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        before = rss_kib("VmRSS:")
        wall, cpu = time.perf_counter(), time.process_time()
        minibatch_step(trainer, rollouts, rows, loss_fn_for(rollouts))
        return {"layout": name, "wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu,
                "peak_rss_above_mib": (rss_kib("VmHWM:") - before) / 1024, "micro_batches": len(micro),
                "positions": sum(layouts[name].positions(row_tokens(rollouts, m)) for m in micro),
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
                         "peak_rss_above_mib_max": max(r["peak_rss_above_mib"] for r in mine),
                         "positions_per_minibatch": [r["positions"] for r in mine if r["repeat"] == 0],
                         "micro_batches": [r["micro_batches"] for r in mine if r["repeat"] == 0]}
    for name in names:
        summary[name]["cpu_speedup_vs_padded"] = summary["padded"]["cpu_sum"] / summary[name]["cpu_sum"]
        summary[name]["wall_speedup_vs_padded"] = summary["padded"]["wall_sum"] / summary[name]["wall_sum"]
    record = {"machine": machine_info(), "budget": args.budget, "trainer": args.trainer, "workload": w.name,
              "tokens_per_minibatch": [r["tokens"] for r in runs if r["repeat"] == 0 and r["layout"] == "padded"],
              "summary": summary, "runs": runs, "command": "python -m benchmarks.layouts " + " ".join(sys.argv[1:] if argv is None else argv)}
    print(json.dumps(summary, indent=1))
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"layouts_{time.strftime('%Y-%m-%d_%H-%M-%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    trainer.close()


if __name__ == "__main__":
    main()
