"""What the bitwise arm costs (`sampler=bitwise`, docs/precision.md#the-bitwise-arm-samplerbitwise), per token, against
transformers' `generate` and the trainer's own layout, on a workload's model:

    .venv/bin/python -m benchmarks.bitwise [--workload default,large] [--rows 8] [--out FILE.json]

For each workload (benchmarks/common.py: `default` is the built-in model with 8-token answers, `large` a random-init
25M-parameter Qwen2 whose answers always run to 128 tokens), `--rows` rows of its prompts (the workload's own count
when smaller) in bf16 on both sides:
  generate  `sampler=hf` (one `generate` call, KV cache) against `sampler=bitwise` (one row at width W, no cache):
            seconds per generated token;
  score     trainer=torch scoring the same rollouts in its default layout (micro-batches of the workload's size,
            padded to their longest row) against the bitwise layout (each row alone at W, each head position
            alone): seconds per scored token;
and the ratios, with the step's whole work (prompts x group size rows) extrapolated from the per-token figures
(linear in rows: each bitwise row is computed alone; the default arm's batched calls are cheaper per row than
this, so the extrapolated ratio is a lower bound). The bitwise sampler's work grows as T x W per answer of T
tokens (quadratic in the answer's length), so the ratio grows with the answers.
Timings depend on the machine and its load: compare the ratios of one run, and read its load figures.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from benchmarks.common import WORKLOADS, machine_info, set_runtime_env, write_record


def model_of(workload) -> str:
    """The workload's checkpoint: the built-in model, or a random-init benchmark model built once (as prepare.py)."""
    from hydra.utils import instantiate

    from benchmarks.models import sized_model
    from rlmm.config.options import to_container
    from rlmm.models.tiny import default_cache_dir

    if workload.model == "tiny":
        from benchmarks.rlmm_step import compose_train_config

        cfg, _ = compose_train_config([])
        return instantiate(cfg.model).resolve(instantiate(cfg.task), to_container(cfg.task))
    return sized_model(workload.model, default_cache_dir() / "benchmarks")[0]


def measure(name: str, rows: int) -> dict:
    import torch
    from transformers import AutoTokenizer

    from rlmm.config.options import from_yaml
    from rlmm.policy.precision import SidePrecision
    from rlmm.policy.rollouts import SamplingOptions
    from rlmm.samplers.bitwise import row_width

    workload = WORKLOADS[name]
    path = model_of(workload)
    task = from_yaml("task", "arithmetic", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = min(rows, workload.rollouts)
    prompts = [tokenizer(e.prompt).input_ids for e in task.examples("train", rows)]
    side = SidePrecision("bf16", False)
    sampling = SamplingOptions(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=workload.max_new_tokens,
                               logprobs="processed", support=from_yaml("support", "sampler"))
    width = row_width(max(map(len, prompts)), workload.max_new_tokens)
    out = {"workload": name, "model_path": path, "rows": rows, "width": width, "step_rows": workload.rollouts}
    samplers = {"hf": dict(batch_size=0, perturb=0.0), "bitwise": {}}
    rollouts = {}
    for sampler_name, values in samplers.items():
        sampler = from_yaml("sampler", sampler_name, model_path=path, precision=side, sampling=sampling, seed=0,
                            prompt_tokens=max(map(len, prompts)), **values)
        sampler.generate(prompts[:1])  # warm-up
        started = time.perf_counter()
        rollouts[sampler_name] = sampler.generate(prompts)
        seconds = time.perf_counter() - started
        tokens = sum(map(len, rollouts[sampler_name].response_ids))
        out[f"generate_{sampler_name}_seconds_per_token"] = seconds / tokens
        sampler.close()
    for layout, row in (("default", None), ("bitwise", width)):
        trainer = from_yaml("trainer", "torch", model_path=path, precision=side, sampling=sampling,
                            micro_batch_size=workload.micro_batch_size, row_width=row)
        trainer.logprobs(rollouts["bitwise"].select([0]))  # warm-up
        started = time.perf_counter()
        with torch.no_grad():
            trainer.logprobs(rollouts["bitwise"])
        seconds = time.perf_counter() - started
        out[f"score_{layout}_seconds_per_token"] = seconds / sum(map(len, rollouts["bitwise"].response_ids))
        trainer.close()
    out["generate_ratio"] = out["generate_bitwise_seconds_per_token"] / out["generate_hf_seconds_per_token"]
    out["score_ratio"] = out["score_bitwise_seconds_per_token"] / out["score_default_seconds_per_token"]
    step_tokens = workload.rollouts * workload.max_new_tokens  # an upper bound: answers that run to the limit
    out["step_generate_seconds"] = {k: out[f"generate_{k}_seconds_per_token"] * step_tokens for k in samplers}
    out["step_score_seconds"] = {k: out[f"score_{k}_seconds_per_token"] * step_tokens for k in ("default", "bitwise")}
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bitwise", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="default,large")
    parser.add_argument("--rows", type=int, default=8, help="rows generated and scored per workload")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    set_runtime_env()
    results, load = [], [os.getloadavg()[0]]
    for name in args.workload.split(","):
        if name not in WORKLOADS:
            parser.error(f"--workload: unknown {name!r} (known: {', '.join(WORKLOADS)})")
        results.append(measure(name, args.rows))
        load.append(os.getloadavg()[0])
    print(f"\n{'workload':<10}{'rows':>6}{'W':>6}{'gen hf s/tok':>14}{'gen bitwise':>13}{'ratio':>8}"
          f"{'score s/tok':>13}{'score bitwise':>15}{'ratio':>8}")
    for r in results:
        print(f"{r['workload']:<10}{r['rows']:>6}{r['width']:>6}{r['generate_hf_seconds_per_token']:>14.2e}"
              f"{r['generate_bitwise_seconds_per_token']:>13.2e}{r['generate_ratio']:>8.1f}"
              f"{r['score_default_seconds_per_token']:>13.2e}{r['score_bitwise_seconds_per_token']:>15.2e}"
              f"{r['score_ratio']:>8.1f}")
    print(f"load average before and after each workload: {', '.join(f'{x:.1f}' for x in load)}")
    write_record("bitwise", {"machine": machine_info(), "results": results, "load": load,
                             "command": "python -m benchmarks.bitwise " + " ".join(sys.argv[1:] if argv is None else argv)},
                 args.out)


if __name__ == "__main__":
    main()
