"""rlmm at real scale: a Qwen2.5-0.5B-architecture model (494M parameters, 151,936-token vocabulary, tied
embeddings; random init, built here with a tokenizer that fills every row), run through the real CLI.

    .venv/bin/python scripts/scale_check.py cpu               # the real-scale CPU run (about 30 min on 2 cores)
    .venv/bin/python scripts/scale_check.py cpu --apps train --precisions fp32   # one row of it
    .venv/bin/python scripts/scale_check.py gpu               # the GPU check (scripts/gpu_check.sh), one GPU
    .venv/bin/python scripts/scale_check.py gpu --dry-run     # the GPU check's code path on CPU, tiny model
    .venv/bin/python scripts/scale_check.py gpu --part probe  # one part of it (probe, train, sweep): see below

`cpu`: `rlmm probe` and 2 steps of `rlmm train` (vLLM sampler + DeepSpeed trainer, 8 prompts x 4 samples x
128 new tokens) in bf16 and in fp32, each in its own process under a memory watchdog that samples the
process tree's RSS every 0.2 s and stops it past `--limit-gib` (16): peak RSS, time and the run's own
figures per row.

`gpu`: six parts, all of them unless `--part` names one: `probe`, `rlmm probe` in bf16, fp16, fp32 and
bf16_fp32head; `train`, 3 steps of `rlmm train` (DeepSpeed, bf16) and standalone vLLM on the same prompts;
`sweep`, a 2-job sweep through the per-job process launcher; `routing`, routing replay on the shipped MoE model;
`staleness`, benchmarks/staleness.py's step at staleness 0, 1 and 1 overlapped; `quantized`, `rlmm probe` with FP8 / INT8
weights and an FP8 KV cache (decode vs prefill, the matching sampler.perturb); `truncation`, `rlmm probe` with top-p and
top-k under each support (vLLM's sampling mask on CUDA). Figures: mismatch per precision, step time
by stage, peak GPU memory (nvidia-smi, sampled), peak RSS, rlmm's generation tokens/s against standalone
vLLM's. `--dry-run` runs them on the CPU with a tiny model of the same shape family (tied embeddings, a
padded vocabulary), in a few minutes.

Writes `scale_check.json` (`scale_check_<part>.json` for one part) into `--out` (default: a new folder
under benchmarks/results/) and prints a table. A row that fails keeps its one-line reason; the script
exits 1 if any row failed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QWEN_05B = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
                vocab_size=151936, tie_word_embeddings=True, max_position=32768, fill_vocab=True)
TINY = dict(hidden_size=64, num_layers=2, num_heads=1, num_kv_heads=1, intermediate_size=128, vocab_size=1024,
            tie_word_embeddings=True, max_position=1024, fill_vocab=True)


class Watchdog:
    """Samples a process tree's RSS (and the GPU's used memory) until it ends; stops it past a limit."""

    def __init__(self, process: subprocess.Popen, limit_bytes: float | None, gpu: bool):
        self.process, self.limit, self.gpu = process, limit_bytes, gpu
        self.peak_rss, self.peak_gpu_mib, self.killed = 0, None, False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _tree_rss(self) -> int:
        import psutil

        try:
            root = psutil.Process(self.process.pid)
            return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
        except psutil.Error:
            return 0

    def _gpu_used_mib(self) -> float | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i",
                                  os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]],
                                 capture_output=True, text=True, timeout=5).stdout
            return float(out.strip().splitlines()[0])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            return None

    def _run(self) -> None:
        while self.process.poll() is None:
            rss = self._tree_rss()
            self.peak_rss = max(self.peak_rss, rss)
            if self.gpu:
                used = self._gpu_used_mib()
                if used is not None:
                    self.peak_gpu_mib = max(self.peak_gpu_mib or 0.0, used)
            if self.limit and rss > self.limit:
                self.killed = True
                self.process.kill()
            time.sleep(0.2)


RLMM_ROOT = ROOT  # the checkout whose rlmm the runs use (--rlmm-root: measure another commit the same way)


def run(name: str, command: list[str], log_dir: Path, limit_gib: float | None, gpu: bool, timeout: float,
        env: dict | None = None) -> dict:
    """Run one command under the watchdog; its output goes to log_dir/<name>.log."""
    log = log_dir / f"{name}.log"
    started = time.perf_counter()
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=RLMM_ROOT,
                                   env={**os.environ, **(env or {})})
        dog = Watchdog(process, limit_gib * 2**30 if limit_gib else None, gpu)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
        dog.thread.join()
    lines = log.read_text(errors="replace").splitlines()
    error = next((line for line in reversed(lines) if line.startswith("rlmm: ")), lines[-1] if lines else "")
    row = {"name": name, "returncode": code, "seconds": round(time.perf_counter() - started, 1),
           "peak_rss_gib": round(dog.peak_rss / 2**30, 2), "log": str(log)}
    if dog.peak_gpu_mib is not None:
        row["peak_gpu_mib"] = dog.peak_gpu_mib
    if dog.killed:
        row["failed"] = f"stopped by the watchdog past {limit_gib} GiB"
    elif code != 0:
        row["failed"] = error[-300:]
    print(f"  {name}: {'ok' if code == 0 else 'FAILED'} in {row['seconds']} s, peak RSS {row['peak_rss_gib']} GiB"
          + (f", peak GPU {row.get('peak_gpu_mib')} MiB" if gpu else "") + (f" ({row['failed']})" if code else ""),
          flush=True)
    return row


def rlmm(*args: str) -> list[str]:
    return [str(ROOT / ".venv" / "bin" / "python"), "-m", "rlmm.cli", *args]


def probe_figures(run_dir: Path) -> dict:
    record = json.loads((run_dir / "probe.json").read_text())
    keys = ("logprob_abs_diff_mean", "logprob_abs_diff_max", "kl_k3", "prob_pearson", "chi2_token")
    return {"sampler_vs_trainer": {k: record["sampler_vs_trainer"][k] for k in keys},
            "trainer_vs_itself": {k: record["trainer_vs_itself"][k] for k in keys},
            "precision": record["precision"], "stage_seconds": record["stage_seconds"]}


def train_figures(run_dir: Path, rows_per_step: int) -> dict:
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    trained = [s for s in steps if s["step"] > 0]
    warm = trained[1:] or trained  # the first step pays for warm-up
    stages = sorted({k for s in warm for k in s if k.startswith("perf/") and k.endswith("_seconds")})
    tokens = [s["rollout/response_length_mean"] * rows_per_step / s["perf/generate_seconds"] for s in warm]
    return {"steps": len(trained), "skipped": sum(bool(s.get("train/skipped")) for s in trained),
            "stage_seconds_median": {k.removeprefix("perf/").removesuffix("_seconds"):
                                     statistics.median(s[k] for s in warm if s.get(k) is not None) for k in stages},
            "generate_tokens_per_second": statistics.median(tokens),
            "mismatch_kl_k3": [s.get("mismatch/kl_k3") for s in trained],
            "loss": [s.get("loss/loss") for s in trained]}


STANDALONE_VLLM = r"""
import json, os, sys, time
from rlmm.runtime.runtime_env import set_runtime_env
set_runtime_env()
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # 1 GiB: what rlmm's KV sizing gives these rows on CPU (its minimum)
import torch
from transformers import AutoTokenizer
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from rlmm.config.options import from_yaml
path, prompts, n, tokens, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
tokenizer = AutoTokenizer.from_pretrained(path)
ids = [tokenizer(e.prompt).input_ids for e in from_yaml("task", "arithmetic", seed=0).examples("train", prompts)]
gpu = {"gpu_memory_utilization": 0.5} if torch.cuda.is_available() else {}  # as rlmm's sampler default
llm = LLM(model=path, dtype=dtype, seed=0, max_model_len=max(map(len, ids)) + tokens, max_logprobs=1,
          enforce_eager=not torch.cuda.is_available(), **gpu)
params = SamplingParams(n=n, temperature=1.0, max_tokens=tokens, logprobs=0)
generate = lambda: llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params, use_tqdm=False)
generate()  # warm-up
started = time.perf_counter()
out = generate()
seconds = time.perf_counter() - started
count = sum(len(c.token_ids) for r in out for c in r.outputs)
print(json.dumps({"tokens": count, "generate_seconds": seconds, "tokens_per_second": count / seconds}))
"""


def build_model(spec: dict, cache: Path) -> str:
    from benchmarks.models import build_bench_model

    name = "qwen2.5-0.5b-fullvocab" if spec is QWEN_05B else "tiny-qwen-shape"
    path = cache / name
    info = build_bench_model(path, **spec)
    print(f"model: {path} ({info['num_parameters'] / 1e6:.1f}M parameters, vocabulary {info['vocab_size']}, "
          f"tokenizer {info['tokenizer_vocab']} tokens)", flush=True)
    return str(path)


def cpu_check(args, out: Path) -> dict:
    """The real-scale CPU run: probe + 2 train steps, bf16 and fp32, each under the memory watchdog."""
    model = build_model(QWEN_05B, Path(args.cache))
    # Micro-batches of 8 rows, checkpointed: with the defaults (32 rows, checkpointing left to the budget) the
    # bf16 train run peaked at 19.0 GiB on the 24 GiB development machine, with 8 rows at 15.5 GiB, with 8
    # rows checkpointed at 14.3 GiB (docs/precision.md#measured-at-real-scale-on-a-cpu).
    work = ["model=hf", f"model.path={model}", "sampler=vllm", "trainer=deepspeed", "logger=none",
            "sampling.max_new_tokens=128", "trainer.micro_batch_size=8", "trainer.gradient_checkpointing=true",
            *args.overrides]
    probe = ["probe.num_prompts=8", "probe.samples_per_prompt=4", "probe.trainer_micro_batch_sizes=[8,32]",
             "probe.batch_invariance.num_prompts=2", "probe.batch_invariance.num_completions=3",
             "probe.batch_invariance.max_batch_size=8"]
    train = ["train.steps=2", "train.prompts_per_step=8", "algo.group_size=4", "train.eval_prompts=8",
             "train.eval_every=2", "train.checkpoint_every=0"]
    rows = []
    for precision in args.precisions:
        for app, extra in (("probe", probe), ("train", train)):
            if app not in args.apps:
                continue
            run_dir = out / "runs" / f"{app}-{precision}"
            row = run(f"{app}-{precision}", rlmm(app, *work, f"precision={precision}", *extra,
                                                f"hydra.run.dir={run_dir}"),
                      out / "logs", args.limit_gib, gpu=False, timeout=args.timeout)
            if "failed" not in row:
                row.update(probe_figures(run_dir) if app == "probe" else train_figures(run_dir, 32))
            rows.append(row)
    return {"model": model, "rows": rows, "limit_gib": args.limit_gib}


GPU_PARTS = ("probe", "train", "sweep", "routing", "staleness", "quantized", "truncation", "bitwise")
# The quantized part's rollout modes (quantization=, sampler.kv_cache_dtype): FP8 weights only on the GPU, the
# dry run's tiny model having widths vLLM-CPU's FP8 kernel refuses (rlmm/policy/quantization.py).
QUANTIZED_MODES = {"gpu": [("fp8", "auto"), ("int8", "auto"), ("none", "fp8_e4m3"), ("fp8", "fp8_e4m3")],
                   "dry": [("int8", "auto"), ("none", "fp8_e4m3")]}


def gpu_check(args, out: Path) -> dict:
    """The GPU check (or its dry run on CPU), all parts or `args.part`: probes per precision (probe), train
    steps and standalone vLLM (train), a process-launcher sweep (sweep)."""
    dry = args.dry_run
    parts = GPU_PARTS if args.part == "all" else (args.part,)
    model = build_model(TINY if dry else QWEN_05B, Path(args.cache))
    prompts, samples, tokens = (4, 2, 16) if dry else (64, 8, 256)
    work = ["model=hf", f"model.path={model}", "sampler=vllm", "trainer=deepspeed", "logger=none",
            f"sampling.max_new_tokens={tokens}", *args.overrides]
    probe = [f"probe.num_prompts={prompts}", f"probe.samples_per_prompt={samples}",
             f"probe.trainer_micro_batch_sizes={'[2,8]' if dry else '[8,32]'}", "probe.batch_invariance.num_prompts=4",
             "probe.batch_invariance.num_completions=4", f"probe.batch_invariance.max_batch_size={4 if dry else 64}",
             "sampler.enforce_eager=true"]  # the mismatch needs no CUDA graphs; saves a compile per precision
    gpu = not dry
    rows = []
    for precision in args.precisions if "probe" in parts else ():
        run_dir = out / "runs" / f"probe-{precision}"
        row = run(f"probe-{precision}", rlmm("probe", *work, f"precision={precision}", *probe,
                                             f"hydra.run.dir={run_dir}"), out / "logs", None, gpu, args.timeout)
        if "failed" not in row:
            row.update(probe_figures(run_dir))
        rows.append(row)
    if "train" in parts:
        rows += train_and_standalone(args, out, model, work, prompts, samples, tokens, gpu)
    if "sweep" in parts:
        rows.append(sweep(args, out, work, probe, gpu))
    if "routing" in parts:
        rows += routing_replay(args, out, probe, gpu)
    if "staleness" in parts:
        rows.append(staleness_step(args, out, work, prompts, samples, gpu))
    if "quantized" in parts:
        rows += quantized_rollouts(args, out, work, probe, gpu)
    if "truncation" in parts:
        rows += truncated_sampling(args, out, work, probe, gpu)
    if "bitwise" in parts:
        rows += bitwise_arms(args, out, work, gpu)
    return {"model": model, "dry_run": dry, "part": args.part,
            "workload": {"prompts": prompts, "samples": samples, "tokens": tokens}, "rows": rows}


def train_and_standalone(args, out: Path, model: str, work: list[str], prompts: int, samples: int, tokens: int,
                         gpu: bool) -> list[dict]:
    """The train part: 3 steps of rlmm train (2 in the dry run), then standalone vLLM on the same prompts
    (its tokens/s against rlmm's generation)."""
    rows = []
    steps = 2 if args.dry_run else 3
    run_dir = out / "runs" / "train-bf16"
    row = run("train-bf16", rlmm("train", *work, "precision=bf16", f"train.steps={steps}",
                                 f"train.prompts_per_step={prompts}", f"algo.group_size={samples}",
                                 f"train.eval_prompts={prompts}", f"train.eval_every={steps}",
                                 "train.checkpoint_every=0", f"hydra.run.dir={run_dir}"),
              out / "logs", None, gpu, args.timeout)
    if "failed" not in row:
        row.update(train_figures(run_dir, prompts * samples))
    rows.append(row)
    python = str(ROOT / ".venv" / "bin" / "python")
    row = run("standalone-vllm", [python, "-c", STANDALONE_VLLM, model, str(prompts), str(samples), str(tokens),
                                  "bfloat16"], out / "logs", None, gpu, args.timeout)
    if "failed" not in row:
        lines = Path(row["log"]).read_text().strip().splitlines()
        row.update(json.loads(next(line for line in reversed(lines) if line.startswith("{"))))
        trained = rows[0]
        if "generate_tokens_per_second" in trained:
            row["rlmm_over_standalone"] = trained["generate_tokens_per_second"] / row["tokens_per_second"]
    rows.append(row)
    return rows


def bitwise_arms(args, out: Path, work: list[str], gpu: bool) -> list[dict]:
    """The bitwise part (issue 52): 2 train steps in bf16 on both sides of vLLM as it is, of vLLM with its
    batch-invariant kernels (`sampler.batch_invariant=true`: VLLM_BATCH_INVARIANT, and the same aten overrides in the
    trainer's process), and of `sampler=bitwise`, on 4 prompts x 2 samples x 32 tokens; each step's
    `agreement/frac_tokens_identical` and KL. Expected (not yet run on a GPU): sampler=bitwise 1.0 at every step (the
    same shapes on both sides; the run stops otherwise); vLLM batch-invariant above plain vLLM but below 1, its
    attention and paged KV cache not being transformers' sdpa. The dry run skips the batch-invariant arm, refused on
    a CPU (Triton)."""
    steps, prompts, samples, tokens = 2, 4, 2, 32
    common = [*work, "precision=bf16", f"train.steps={steps}", f"train.prompts_per_step={prompts}",
              f"algo.group_size={samples}", f"sampling.max_new_tokens={tokens}", "train.eval_prompts=4",
              f"train.eval_every={steps}", "train.checkpoint_every=0"]
    arms = {"train-vllm-bf16": [], "train-vllm-batch-invariant": ["sampler.batch_invariant=true"],
            "train-bitwise-bf16": ["sampler=bitwise"]}
    rows = []
    for name, arm in arms.items():
        if "sampler.batch_invariant=true" in arm and not gpu:
            rows.append({"name": name, "skipped": "vLLM's batch-invariant kernels need a GPU (Triton)"})
            continue
        run_dir = out / "runs" / name
        row = run(name, rlmm("train", *common, *arm, f"hydra.run.dir={run_dir}"), out / "logs", None, gpu,
                  args.timeout)
        if "failed" not in row:
            trained = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()][1:]
            row.update(agreement=[s.get("agreement/frac_tokens_identical") for s in trained],
                       kl_k3=[s.get("mismatch/kl_k3") for s in trained],
                       step_seconds=[round(sum(v for k, v in s.items() if k.startswith("perf/") and k.endswith(
                           "_seconds")), 3) for s in trained])
        rows.append(row)
    return rows


def routing_replay(args, out: Path, probe: list[str], gpu: bool) -> list[dict]:
    """The routing part (issue 25): the shipped MoE model (`model=tiny_moe`, no hub needed) through vLLM's own
    routed-experts capture on CUDA (`enable_return_routed_experts`; hooks on a CPU, the dry run) and the trainer
    replaying it: a probe with routing=r3 (the routing part of the gap) and 2 train steps with routing=r3."""
    work = ["model=tiny_moe", "sampler=vllm", "trainer=deepspeed", "logger=none", "routing=r3",
            "precision=bf16_sampler_fp32_trainer", *args.overrides]
    rows = []
    run_dir = out / "runs" / "probe-routing-r3"
    row = run("probe-routing-r3", rlmm("probe", *work, *probe, f"hydra.run.dir={run_dir}"), out / "logs", None,
              gpu, args.timeout)
    if "failed" not in row:
        row.update(probe_figures(run_dir))
        record = json.loads((run_dir / "probe.json").read_text())["routing"]
        row.update({"routing_frac_decisions_differ": record["disagreement"]["frac_decisions_differ"],
                    "routing_differing_decisions": record["disagreement"]["differing_decisions"],
                    "routing_differing_decisions_reaching_scores":
                        record["disagreement"]["differing_decisions_reaching_scores"],
                    "routing_share_removed_kl_k3": record["share_removed"]["kl_k3"]})
    rows.append(row)
    run_dir = out / "runs" / "train-routing-r3"
    row = run("train-routing-r3", rlmm("train", *work, "train.steps=2", "train.prompts_per_step=8",
                                       "train.eval_prompts=8", "train.eval_every=2", "train.checkpoint_every=0",
                                       f"hydra.run.dir={run_dir}"), out / "logs", None, gpu, args.timeout)
    if "failed" not in row:
        row.update(train_figures(run_dir, 64))
    rows.append(row)
    return rows


def staleness_step(args, out: Path, work: list[str], prompts: int, samples: int, gpu: bool) -> dict:
    """The staleness part (issue 26): benchmarks/staleness.py's step time at staleness 0, at 1 in one process,
    and at 1 with the sampler in its own process on a GPU of its own (train.overlap; skipped with one GPU): does
    the overlap hide generation behind the update where the two do not share a device?"""
    record_path = out / "staleness_benchmark.json"
    steps = 4 if args.dry_run else 8
    overrides = [*work, f"train.prompts_per_step={prompts}", f"algo.group_size={samples}"]
    command = [str(ROOT / ".venv" / "bin" / "python"), "-m", "benchmarks.staleness", "--steps", str(steps),
               "--repeats", "1" if args.dry_run else "2", "--device", "cuda" if gpu else "cpu",
               "--out", str(record_path)] + [f"--override={o}" for o in overrides if o != "logger=none"]
    row = run("staleness-step", command, out / "logs", None, gpu, args.timeout)
    if "failed" not in row:
        record = json.loads(record_path.read_text())
        row.update({"summary": record["summary"], "skipped": record["skipped"]})
    return row


def quantized_rollouts(args, out: Path, work: list[str], probe: list[str], gpu: bool) -> list[dict]:
    """The quantized part (issue 36): `rlmm probe` in bf16 with the sampler's weights and KV cache quantized on real
    kernels, each mode against the same sampler.perturb stand-ins: the gap, the matching ε, decode vs prefill
    (vLLM #54035: an FP8 KV cache departs from its own prefill from position ~97 on, on Hopper)."""
    rows = []
    for weights, kv_cache in QUANTIZED_MODES["gpu" if gpu else "dry"]:
        name = f"probe-quantized-{weights}-{kv_cache}"
        run_dir = out / "runs" / name
        row = run(name, rlmm("probe", *work, "precision=bf16", *probe, f"quantization={weights}",
                             f"sampler.kv_cache_dtype={kv_cache}", "probe.simulated=[0.01,0.02,0.04,0.08]",
                             f"hydra.run.dir={run_dir}"), out / "logs", None, gpu, args.timeout)
        if "failed" not in row:
            record = json.loads((run_dir / "probe.json").read_text())
            row.update(probe_figures(run_dir))
            row["decode_vs_prefill"] = {k: v for k, v in record["decode_vs_prefill"].items() if k != "position_profile"}
            row["matching_epsilon"] = record["real_vs_simulated"]["matching_epsilon"]
        rows.append(row)
    return rows


def truncated_sampling(args, out: Path, work: list[str], probe: list[str], gpu: bool) -> list[dict]:
    """The truncation part (issue 48): `rlmm probe` in bf16 with top-p 0.9 and top-k 50 under each support: the
    sampler's kept sets (on CUDA vLLM's own sampling mask, `return_sampling_mask`; the dry run's vLLM-CPU lists
    processed log-probs instead), the trainer's mass on them (log S), the share of sampled tokens outside the
    trainer's own set, and what the kept sets cost a token at a 151,936-token vocabulary."""
    rows = []
    for support in ("sampler", "trainer", "full"):
        name = f"probe-truncation-{support}"
        run_dir = out / "runs" / name
        row = run(name, rlmm("probe", *work, "precision=bf16", *probe, "sampling.top_p=0.9", "sampling.top_k=50",
                             f"support={support}", f"hydra.run.dir={run_dir}"), out / "logs", None, gpu, args.timeout)
        if "failed" not in row:
            record = json.loads((run_dir / "probe.json").read_text())
            row.update(probe_figures(run_dir))
            row["support"] = record["support"]
            row["kept_sets"] = record["precision"]["actual"]["sampler"]["engine"]["kept_sets"]
        rows.append(row)
    return rows


def sweep(args, out: Path, work: list[str], probe: list[str], gpu: bool) -> dict:
    """The sweep part: a 2-job `-m` sweep (bf16, fp32) through hydra/launcher=process."""
    sweep_dir = out / "runs" / "sweep"
    row = run("sweep-process-launcher", rlmm("probe", "-m", "hydra/launcher=process", "precision=bf16,fp32", *work,
                                             *probe, f"hydra.sweep.dir={sweep_dir}"), out / "logs", None, gpu,
              args.timeout)
    row["jobs_with_record"] = len(list(sweep_dir.glob("*/probe.json")))
    jobs = [json.loads(path.read_text()) for path in sorted(sweep_dir.glob("*/probe.json"))]
    # per job, "sampler dtype/trainer dtype": each job measured its own precision
    row["logprob_abs_diff_mean"] = {"{sampler}/{trainer}".format(**job["precision"]["requested"]):
                                    job["sampler_vs_trainer"]["logprob_abs_diff_mean"] for job in jobs}
    return row


def print_table(record: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"scale check: {record['check']} ({record['model']})", title_justify="left")
    for column in ("run", "ok", "seconds", "peak RSS GiB", "peak GPU MiB", "|δ| mean", "KL k3", "step s (median)"):
        table.add_column(column, justify="right" if column != "run" else "left")
    for row in record["rows"]:
        mismatch = row.get("sampler_vs_trainer", {})
        stages = row.get("stage_seconds_median", {})
        if isinstance(row.get("skipped"), str):  # not run here, with its reason (printed below)
            table.add_row(row["name"], "skipped", *["-"] * 6)
            continue
        table.add_row(row["name"], "yes" if "failed" not in row else "no", str(row["seconds"]),
                      str(row["peak_rss_gib"]), str(row.get("peak_gpu_mib", "-")),
                      f"{mismatch['logprob_abs_diff_mean']:.2e}" if mismatch else "-",
                      f"{mismatch['kl_k3']:.2e}" if mismatch else "-",
                      f"{sum(stages.values()):.1f}" if stages else "-")
    Console(width=150).print(table)
    for row in record["rows"]:
        if "failed" in row:
            print(f"{row['name']}: {row['failed']}")
        elif isinstance(row.get("skipped"), str):
            print(f"{row['name']}: skipped: {row['skipped']}")
        if "agreement" in row:
            print(f"{row['name']}: agreement/frac_tokens_identical per step {row['agreement']}, KL k3 {row['kl_k3']}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", choices=["cpu", "gpu"])
    parser.add_argument("--dry-run", action="store_true", help="gpu: the same code path on CPU with a tiny model")
    parser.add_argument("--part", default="all", choices=["all", *GPU_PARTS],
                        help="gpu: one part alone (each fits a machine lent for 8 minutes; default all)")
    parser.add_argument("--apps", nargs="+", default=["probe", "train"], choices=["probe", "train"],
                        help="cpu: the apps run per precision (default both)")
    parser.add_argument("--precisions", nargs="+", help="precision options (default: cpu bf16 fp32; gpu bf16 fp16 "
                                                        "fp32 bf16_fp32head)")
    parser.add_argument("--limit-gib", type=float, default=16.0, help="cpu: stop a run whose RSS passes this")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    parser.add_argument("--cache", default=os.environ.get("RLMM_CACHE", str(Path.home() / ".cache" / "rlmm")),
                        help="where the built model is kept")
    parser.add_argument("--out", type=Path, help="results folder (default: benchmarks/results/scale_<date>)")
    parser.add_argument("--rlmm-root", type=Path, default=ROOT,
                        help="run the rlmm of this checkout (e.g. a worktree of an older commit), with this .venv")
    parser.add_argument("overrides", nargs="*", help="extra overrides for every rlmm run, e.g. trainer.zero_stage=2")
    args = parser.parse_args(argv)
    if args.dry_run and args.check != "gpu":
        parser.error("--dry-run goes with the gpu check")
    if args.part != "all" and args.check != "gpu":
        parser.error("--part goes with the gpu check")
    global RLMM_ROOT
    RLMM_ROOT = args.rlmm_root.resolve()
    args.precisions = args.precisions or (["bf16", "fp32"] if args.check == "cpu"
                                          else ["bf16", "fp16", "fp32", "bf16_fp32head"])
    out = args.out or ROOT / "benchmarks" / "results" / time.strftime(f"scale_{args.check}_%Y-%m-%d_%H-%M-%S")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    from benchmarks.common import git_commit, machine_info

    started = time.perf_counter()
    record = {"check": args.check + (" (dry run)" if args.dry_run else ""), "machine": machine_info(),
              "commit": git_commit(RLMM_ROOT),
              "overrides": args.overrides}
    record.update(cpu_check(args, out) if args.check == "cpu" else gpu_check(args, out))
    record["seconds"] = round(time.perf_counter() - started, 1)
    path = out / ("scale_check.json" if args.part == "all" else f"scale_check_{args.part}.json")
    path.write_text(json.dumps(record, indent=2, default=str))
    print_table(record)
    print(f"wrote {path} ({record['seconds']} s)")
    if any("failed" in row for row in record["rows"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
