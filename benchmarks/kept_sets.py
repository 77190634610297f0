"""What carrying the sampler's kept sets costs (issue 48, `support=`): their size and bytes a token, and vLLM's
generation with and without the processed log-prob listing they are read from, through rlmm's own `VLLMSampler`.

    .venv/bin/python -m benchmarks.kept_sets [--model qwen2.5-0.5b] [--rows 8] [--new-tokens 16] [--repeats 3] \
        [--truncations top_p=0.9 top_k=50] [--max-kept 512] [--out FILE.json]

For each truncation (one process each: an engine's listing width is fixed when it starts) the sampler generates
`--rows` rows of `--new-tokens` tokens (the benchmark model's eos cannot be sampled) with the kept sets listed
(`max_logprobs` = min(max_kept, vocabulary)), then the same calls with the listing turned off on the same engine
(`listed = 0`: the sampled token's log-prob alone, as before issue 48), alternating `--repeats` times; the table
gives medians. Figures: the kept set's size a token (mean, max), the share capped at `max_kept`, its bytes a token
as rlmm carries it (int32 ids and offsets) beside a vocabulary bitmap (V / 8) and a dense fp32 mask (4 V), and the
decode tokens/s with and without the listing. With `--exact`, transformers' sampler on the same model gives the
uncapped sizes (its sets come from its own logits: no listing).

Models: benchmarks/models.py's (`qwen2.5-0.5b`: Qwen2.5-0.5B's architecture, 151,936 tokens, random init: a nearly
flat distribution, the worst case for a kept set) or `builtin` (the shipped tiny model, 100 tokens, trained).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from benchmarks.common import ROOT, machine_info, set_runtime_env, write_record


def model_path(name: str) -> str:
    if name == "builtin":
        from rlmm.models.tiny import BUILTIN_DIR

        return str(next(BUILTIN_DIR.glob("tiny-*")))
    from benchmarks.quantized_rollouts import model_path as bench_model

    return bench_model(name)


def truncation_options(spec: str) -> dict:
    key, _, value = spec.partition("=")
    if key not in ("top_p", "top_k"):
        raise SystemExit(f"--truncations: {spec!r} (allowed: top_p=P, top_k=K)")
    return {"top_p": float(value)} if key == "top_p" else {"top_k": int(value)}


def worker(job: dict) -> dict:
    set_runtime_env("cpu")
    import torch

    from rlmm.config.options import from_yaml
    from rlmm.policy.precision import SidePrecision
    from rlmm.policy.rollouts import SamplingOptions

    options = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, **truncation_options(job["truncation"])}
    sampling = SamplingOptions(**options, max_new_tokens=job["new_tokens"], logprobs="processed",
                               support=from_yaml("support", "sampler", max_kept=job["max_kept"]))
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 60, (16,), generator=generator).tolist() for _ in range(job["rows"])]
    engine = "hf" if job["exact"] else "vllm"
    sampler = from_yaml("sampler", engine, model_path=job["path"], precision=SidePrecision("bf16", False),
                        sampling=sampling, seed=0, prompt_tokens=16, max_rows=job["rows"])
    try:
        sampler.generate(prompts)  # warm-up
        timed = {"listed": [], "not_listed": []}
        kept = None
        listed = getattr(sampler, "listed", 0)
        for _ in range(job["repeats"]):
            for arm in ("listed", "not_listed") if engine == "vllm" else ("listed",):
                sampler.listed = listed if arm == "listed" else 0
                wall = time.perf_counter()
                rollouts = sampler.generate(prompts)
                timed[arm].append(sum(map(len, rollouts.response_ids)) / (time.perf_counter() - wall))
                kept = rollouts.kept_tokens if arm == "listed" else kept
        vocab = sampler.vocab if engine == "vllm" else sampler.model.config.vocab_size
    finally:
        sampler.close()
    sizes = torch.cat([k.sizes() for k in kept]).float()
    tokens = sizes.numel()
    return {"truncation": job["truncation"], "engine": engine, "vocab": vocab, "tokens": tokens,
            "kept_size_mean": sizes.mean().item(), "kept_size_max": int(sizes.max()),
            "frac_capped": torch.cat([k.capped for k in kept]).float().mean().item(),
            "kept_bytes_per_token": sum(k.nbytes() for k in kept) / tokens,
            "bitmap_bytes_per_token": vocab / 8, "dense_fp32_bytes_per_token": 4 * vocab,
            "tokens_per_second_listed": statistics.median(timed["listed"]),
            "tokens_per_second_not_listed": statistics.median(timed["not_listed"]) if timed["not_listed"] else None}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kept_sets", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-0.5b", help="builtin, or a key of benchmarks/models.py's SIZES")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--truncations", nargs="+", default=["top_p=0.9", "top_k=50"])
    parser.add_argument("--max-kept", type=int, default=512)
    parser.add_argument("--exact", action="store_true", help="transformers' sampler, its sets uncapped")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    set_runtime_env("cpu")
    for spec in args.truncations:
        truncation_options(spec)
    path = model_path(args.model)
    rows = []
    for spec in args.truncations:
        job = {"path": path, "rows": args.rows, "new_tokens": args.new_tokens, "repeats": args.repeats,
               "truncation": spec, "max_kept": 10**9 if args.exact else args.max_kept, "exact": args.exact}
        result = subprocess.run([sys.executable, "-m", "benchmarks.kept_sets", "--worker", json.dumps(job)],
                                capture_output=True, text=True, cwd=ROOT)
        lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
        if result.returncode or not lines:
            raise RuntimeError(f"{spec}: the worker failed\n{(result.stdout + result.stderr)[-3000:]}")
        rows.append(json.loads(lines[-1].removeprefix("RESULT ")))
    print(f"model {args.model}, {args.rows} rows x {args.new_tokens} tokens, max_kept "
          f"{'none (exact)' if args.exact else args.max_kept}")
    print("| truncation | engine | \\|K_S\\| mean | max | capped | bytes/token (ids) | bitmap | dense fp32 | tok/s listed "
          "| tok/s not listed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['truncation']} | {r['engine']} | {r['kept_size_mean']:.1f} | {r['kept_size_max']} | "
              f"{r['frac_capped']:.0%} | {r['kept_bytes_per_token']:.0f} | {r['bitmap_bytes_per_token']:.0f} | "
              f"{r['dense_fp32_bytes_per_token']:.0f} | {r['tokens_per_second_listed']:.1f} | "
              f"{r['tokens_per_second_not_listed'] or float('nan'):.1f} |")
    print(f"record: {write_record('kept_sets', {'machine': machine_info(), 'args': vars(args), 'rows': rows}, args.out)}")


if __name__ == "__main__":
    main()
