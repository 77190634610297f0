"""What quantized rollouts buy on this machine: decode throughput, weight-sync cost and the sampler's memory of each
`quantization=` x `sampler.kv_cache_dtype` mode against bf16, through rlmm's own `VLLMSampler`.

    .venv/bin/python -m benchmarks.quantized_rollouts [--model large] [--rows 64] [--new-tokens 64] \
        [--repeats 3] [--calls 3] [--modes bf16,int8,fp8kv,int8_fp8kv,fp8] [--out FILE.json]

Each (mode, repeat) is one process (an engine's settings are fixed when it starts, and one engine runs per
process), run in an order rotated per repeat so a change of load falls on every mode alike; the table gives
medians over the repeats. In each process: one warm-up generate, then `--calls` generate calls of `--rows` rows
(the benchmark model's eos cannot be sampled: every response is `--new-tokens` long) timed, then three weight
syncs of the checkpoint's tensors in bf16 (what a bf16 trainer sends; the sampler quantizes them at each one)
timed, the process's peak RSS before and after the syncs, and the bytes of the weights as the engine is given them. A mode vLLM refuses here (fp8 weights on a model
with biases or widths the CPU kernel cannot take) is recorded with its one-line reason.

Models: benchmarks/models.py's `large` (25M parameters, hidden 512) and `qwen2.5-0.5b` (Qwen2.5-0.5B's
architecture, random init).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from benchmarks.common import ROOT, machine_info, peak_rss_mib, set_runtime_env, write_record

MODES = {"bf16": ("none", "auto"), "int8": ("int8", "auto"), "fp8kv": ("none", "fp8_e4m3"),
         "int8_fp8kv": ("int8", "fp8_e4m3"), "fp8": ("fp8", "auto")}


def model_path(name: str) -> str:
    import hashlib
    from pathlib import Path

    from benchmarks.models import SIZES, build_bench_model
    from rlmm.models.tiny import default_cache_dir

    key = hashlib.sha256(json.dumps(SIZES[name], sort_keys=True).encode()).hexdigest()[:8]
    path = default_cache_dir() / "benchmarks" / f"{name}-{key}"
    build_bench_model(Path(path), **SIZES[name])
    return str(path)


def worker(job: dict) -> dict:
    """One mode in this process: the figures of module docstring's list."""
    set_runtime_env("cpu")
    import torch

    from rlmm.config.options import from_yaml
    from rlmm.policy.precision import SidePrecision
    from rlmm.policy.rollouts import SamplingOptions
    from rlmm.samplers.perturb import checkpoint_tensors

    quantization, kv_cache = MODES[job["mode"]]
    sampling = SamplingOptions(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=job["new_tokens"],
                               logprobs="processed",
                               support=from_yaml("support", "sampler"))
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 60, (job["prompt_tokens"],), generator=generator).tolist()
               for _ in range(job["rows"] * (job["calls"] + 1))]
    started = time.perf_counter()
    try:
        sampler = from_yaml("sampler", "vllm", model_path=job["path"], precision=SidePrecision("bf16", False),
                            sampling=sampling, seed=0, quantization=from_yaml("quantization", quantization),
                            kv_cache_dtype=kv_cache,
                            prompt_tokens=job["prompt_tokens"], max_rows=job["rows"])
    except ValueError as error:
        return {"mode": job["mode"], "refused": str(error)}
    start_seconds = time.perf_counter() - started
    try:
        sampler.generate(prompts[:job["rows"]])  # warm-up: the first call allocates
        calls = []
        for call in range(1, job["calls"] + 1):
            batch = prompts[call * job["rows"]:(call + 1) * job["rows"]]
            wall = time.perf_counter()
            rollouts = sampler.generate(batch)
            calls.append((time.perf_counter() - wall, sum(map(len, rollouts.response_ids))))
        weights = {name: tensor.to(torch.bfloat16) for name, tensor in checkpoint_tensors(job["path"])}
        rss_before_sync = peak_rss_mib()
        syncs = []
        for _ in range(3):
            wall = time.perf_counter()
            sampler.load_weights(weights)
            syncs.append(time.perf_counter() - wall)
        # The weights as the engine is given them (quantized layers at 1 byte and their fp32 scales, the rest bf16):
        # vLLM-CPU's bf16 linear layers keep their packed weights in oneDNN handles, out of `parameters()`.
        served_bytes = sum(t.numel() * t.element_size() for _, t in sampler.quantizer(weights.items()))
        report = sampler.actual_precision
    finally:
        sampler.close()
    seconds = [wall for wall, _ in calls]
    return {"mode": job["mode"], "start_seconds": start_seconds,
            "tokens_per_second": statistics.median(tokens / wall for wall, tokens in calls),
            "call_seconds": statistics.median(seconds), "tokens_per_call": calls[0][1],
            "sync_seconds": statistics.median(syncs), "served_weight_mib": served_bytes / 2**20,
            "peak_rss_mib_before_sync": rss_before_sync, "peak_rss_mib_after_sync": peak_rss_mib(),
            "kv_cache_bytes": report["engine"]["kv_cache_bytes"], "quantization": report["quantization"]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quantized_rollouts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="large", help="a key of benchmarks/models.py's SIZES")
    parser.add_argument("--rows", type=int, default=64, help="sequences per generate call")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per response (the eos cannot be sampled)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--calls", type=int, default=3, help="timed generate calls per process, after one warm-up")
    parser.add_argument("--repeats", type=int, default=3, help="processes per mode, in rotated order")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    set_runtime_env("cpu")
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)} (allowed: {', '.join(MODES)})")
    job = {"path": model_path(args.model), "rows": args.rows, "new_tokens": args.new_tokens,
           "prompt_tokens": args.prompt_tokens, "calls": args.calls}
    runs = []
    from tqdm import tqdm

    order = [(repeat, modes[(i + repeat) % len(modes)]) for repeat in range(args.repeats) for i in range(len(modes))]
    for repeat, mode in tqdm(order, desc="mode x repeat", unit="process"):
        result = subprocess.run([sys.executable, "-m", "benchmarks.quantized_rollouts", "--worker",
                                 json.dumps({**job, "mode": mode})], capture_output=True, text=True, cwd=ROOT)
        lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
        if result.returncode or not lines:
            raise RuntimeError(f"mode {mode}: the worker failed\n{(result.stdout + result.stderr)[-3000:]}")
        runs.append({**json.loads(lines[-1].removeprefix("RESULT ")), "repeat": repeat})
    summary = {}
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        if "refused" in mine[0]:
            summary[mode] = {"refused": mine[0]["refused"]}
            continue
        summary[mode] = {key: statistics.median(r[key] for r in mine) for key in
                         ("tokens_per_second", "call_seconds", "sync_seconds", "start_seconds",
                          "served_weight_mib", "peak_rss_mib_after_sync", "kv_cache_bytes")}
        summary[mode]["sync_extra_rss_mib"] = statistics.median(
            r["peak_rss_mib_after_sync"] - r["peak_rss_mib_before_sync"] for r in mine)
        summary[mode]["kernel"] = mine[0]["quantization"].get("kernel", "-")
    if "bf16" in summary and "refused" not in summary["bf16"]:
        for mode, figures in summary.items():
            if "refused" not in figures:
                figures["throughput_vs_bf16"] = figures["tokens_per_second"] / summary["bf16"]["tokens_per_second"]
    record = {"benchmark": "quantized_rollouts", "args": vars(args), "machine": machine_info(), "summary": summary,
              "runs": runs}
    path = write_record("quantized_rollouts", record, args.out)
    print(f"{'mode':<11} {'tok/s':>8} {'vs bf16':>8} {'sync s':>7} {'weights MiB':>11} {'peak RSS MiB':>12}  kernel")
    for mode, f in summary.items():
        if "refused" in f:
            print(f"{mode:<11} refused: {f['refused']}")
        else:
            print(f"{mode:<11} {f['tokens_per_second']:>8.1f} {f.get('throughput_vs_bf16', float('nan')):>8.2f} "
                  f"{f['sync_seconds']:>7.3f} {f['served_weight_mib']:>11.1f} {f['peak_rss_mib_after_sync']:>12.0f}"
                  f"  {f['kernel']}")
    print(f"record: {path}")


if __name__ == "__main__":
    main()
