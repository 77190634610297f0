"""The GPU check that fits the machine this project can be lent (issue 23): one H200, Python 3.12, torch 2.11 and
transformers 5.17, no vLLM, no DeepSpeed, no package index, 10 minutes a command, 64 MiB carried with the call.

    bash scripts/gpu_wheels.sh                # here: the wheels that machine lacks, into .gpu_wheels/ (~8 MiB)
    bash scripts/gpu_lent_check.sh            # there, carrying .gpu_wheels; writes into $OUT
    bash scripts/gpu_lent_check.sh --dry-run  # here, on CPU: the same parts with a tiny model (~4 min, 2 cores)

Parts, in this order, each under its own time limit: a run past its limit is stopped (its process group
killed), a part past its limit records the runs it could not start, and a part that fails keeps its one-line
reason while the next ones still run. Limits and estimates on one H200 (estimates, not measurements: no machine
was lent when this was written; the first run's figures, docs/precision.md "What has run where", are the base):

  part     limit  estimate  what
  setup     80 s     45 s   the wheels unzipped into a site folder on PYTHONPATH (no pip); each carried module
                            imported and traced to that folder; DeepSpeed's accelerator detected (and the one
                            rlmm's environment names), its build (no op compiled) and one DeepSpeed step with
                            torch's AdamW (`torch_adam`, no op to build); the Qwen2.5-0.5B-architecture model
                            (494M parameters, fp32, tied embeddings, built here with its 151,936-token tokenizer:
                            ~30 s) and, beside it, the layouts benchmark's model
  train    170 s    140 s   `rlmm train sampler=hf trainer=deepspeed` on CUDA, 3 steps of 8 prompts x 4 samples x
                            64 tokens (an entropy bonus of 0.01: the random-init model earns no reward), in
                            bf16, fp16 and bf16_fp32head at ZeRO-0 and bf16 at ZeRO-2, one after the
                            other (~35 s each: ~20 s to start, DeepSpeed's init of 0.5B ~5-10 s, ~4 s a step);
                            then `sampler=bitwise precision=bf16` on 4 prompts x 2 samples x 32 tokens, expected
                            bitwise at every step (`agreement_bitwise` 1; not yet run on a GPU)
  probe    120 s    100 s   `rlmm probe sampler=hf trainer=fsdp|torch` in bf16, fp16, fp32, bf16_fp32head on the
                            first run's workload (32 prompts x 4 samples x 64 tokens, micro-batches 1 vs 32),
                            4 runs at a time (30-58 s each alone in the first run): the 8 runs in ~2 waves;
                            then routing replay on CUDA (`model=tiny_moe routing=r3`, sampler=hf, trainer=torch),
                            if the part's limit leaves time
  layouts   90 s     60 s   benchmarks/layouts.py --workload varlen-gpu --device cuda --precision bf16
                            --trainer fsdp --budget 4096,8192,16384 --repeats 2

Limits 460 s together (the check ends inside 8 minutes whatever hangs), estimates ~6 minutes. `--dry-run` runs
every part on this CPU with a tiny model of the same family (tied embeddings, padded vocabulary), .venv's
packages instead of the wheels (the install code runs on a wheel it makes and, when .gpu_wheels exists, on
hjson's), and skips what the CPU cannot run with the reason (DeepSpeed's CPU accelerator refuses fp16 on CPUs
without AVX512-FP16).

Figures per train run: steps, skipped steps, the loss scale and loss-scale skips (any `*loss_scale*` metric the
steps log), mean |δ| and KL k3 per step, step seconds, the precision report (what the trainer really holds,
grad_accum_dtype among it where the trainer reports it), the DeepSpeed ops loaded or built at run time, peak GPU
memory (nvidia-smi every 0.5 s: the run's own processes, and the device's, which counts overlapping runs too).
Per probe run: sampler vs trainer and trainer vs itself; beside them torch against FSDP per precision (the
prediction after the RoPE cast fix: the same figures) and, on the GPU, the first run's figures. Layouts: each
layout's median seconds, peak memory, positions and micro-batches.

Writes into --out ($OUT when set, else benchmarks/results/gpu_lent_<date>): gpu_lent_check.json (the figures),
layouts.json (benchmarks/layouts.py's own record) and gpu_lent_runs.tar.gz (every run's log and run record);
prints a table. Exits 1 when any part failed.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scale_check import QWEN_05B, TINY  # noqa: E402  (scripts/: the model shapes of the other GPU checks)


@dataclass(frozen=True)
class Part:
    limit: float  # seconds on the GPU
    estimate: float  # seconds on one H200 (a guess until it has run there)
    dry_limit: float  # seconds in the dry run: only against a hang (a CI machine shared with other jobs is slow)


# The dry run's setup allows for DeepSpeed building its CPU shared-memory op (1-3 min on 2 cores) when this
# venv has not built it yet.
# probe's dry limit: the 8 grid runs and the routing probe
PARTS = {"setup": Part(80, 45, 240), "train": Part(170, 140, 240), "probe": Part(120, 100, 360),
         "layouts": Part(90, 60, 150)}
TRAIN_GRID = [("bf16", 0), ("fp16", 0), ("bf16", 2), ("bf16_fp32head", 0)]  # most wanted first
PROBE_PRECISIONS = ["bf16", "fp16", "fp32", "bf16_fp32head"]
PROBE_TRAINERS = ["fsdp", "torch"]
COMPARED = ("logprob_abs_diff_mean", "logprob_abs_diff_max", "kl_k3", "prob_pearson")
FIRST_RUN = ROOT / "docs" / "measured" / "gpu_fsdp_check_h200.json"  # the probe workload below is that run's
PROCESS_GROUP_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def workloads(dry: bool) -> dict:
    """The runs' sizes: the GPU's, or the dry run's tiny ones."""
    if dry:
        return {"train": dict(steps=2, prompts=2, group=2, tokens=8, eval_prompts=2),
                "bitwise": dict(prompts=2, group=2, tokens=8),
                "probe": dict(prompts=4, samples=2, tokens=16, micro_batch_sizes="[1,8]", bi=(2, 2, 4)),
                "layouts": ["--workload", "varlen-dry", "--device", "cpu", "--precision", "fp32", "--trainer", "fsdp",
                            "--budget", "64,128", "--repeats", "1"]}
    return {"train": dict(steps=3, prompts=8, group=4, tokens=64, eval_prompts=8),
            "bitwise": dict(prompts=4, group=2, tokens=32),
            "probe": dict(prompts=32, samples=4, tokens=64, micro_batch_sizes="[1,32]", bi=(4, 4, 16)),
            "layouts": ["--workload", "varlen-gpu", "--device", "cuda", "--precision", "bf16", "--trainer", "fsdp",
                        "--budget", "4096,8192,16384", "--repeats", "2"]}


# ---- wheels into a site folder, without pip -------------------------------------------------------------------

DATA = re.compile(r"^[^/]+\.data/([^/]+)/(.+)$")  # NAME-VERSION.data/<scheme>/<path> inside a wheel


def site_path(member: str) -> str | None:
    """Where pip would put a wheel's member in site-packages: the member itself, or a `.data/purelib|platlib`
    member's path below that folder; None for folders, scripts, headers, data files and unsafe paths."""
    data = DATA.match(member)
    if data:
        if data[1] not in ("purelib", "platlib"):
            return None
        member = data[2]
    if member.endswith("/") or member.startswith("/") or ".." in member.split("/"):
        return None
    return member


def wheel_modules(paths: list[str]) -> list[str]:
    """The importable top-level modules among a wheel's site paths (a namespace folder's packages one level
    down, e.g. hydra_plugins.hydra_submitit_launcher)."""
    paths = [p for p in paths if not p.split("/")[0].endswith(".dist-info")]
    modules = set()
    for path in paths:
        parts = path.split("/")
        if len(parts) == 1 and parts[0].endswith(".py"):
            modules.add(parts[0][:-3])
        elif len(parts) > 1 and f"{parts[0]}/__init__.py" in paths:
            modules.add(parts[0])
        elif len(parts) > 2 and f"{parts[0]}/{parts[1]}/__init__.py" in paths:
            modules.add(f"{parts[0]}.{parts[1]}")
    return sorted(modules)


def installed_version(distribution: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def install_wheels(folder: Path, site: Path) -> list[dict]:
    """Unzip folder/*.whl into `site` as pip would install them (packages and dist-info; not scripts or
    headers), and folder/if_missing/*.whl only for a distribution this Python lacks. One row per wheel."""
    site.mkdir(parents=True, exist_ok=True)
    rows = []
    for wheel, only_missing in [(w, False) for w in sorted(folder.glob("*.whl"))] + \
                               [(w, True) for w in sorted(folder.glob("if_missing/*.whl"))]:
        distribution = wheel.name.split("-")[0]
        row = {"wheel": str(wheel.relative_to(folder)), "bytes": wheel.stat().st_size}
        present = installed_version(distribution) if only_missing else None
        if present:
            rows.append({**row, "installed": False, "why": f"this machine has {distribution} {present}"})
            continue
        paths = []
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.namelist():
                path = site_path(member)
                if path:
                    (site / path).parent.mkdir(parents=True, exist_ok=True)
                    (site / path).write_bytes(archive.read(member))
                    paths.append(path)
        rows.append({**row, "installed": True, "modules": wheel_modules(paths)})
    return rows


def make_wheel(folder: Path, distribution: str, version: str, files: dict[str, str]) -> Path:
    """A minimal wheel (the dry run's test of install_wheels when no real wheel is at hand)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{distribution}-{version}-py3-none-any.whl"
    info = f"{distribution}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
        archive.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")
    return path


# The setup part's subprocess: imports through the site folder, DeepSpeed's accelerator and one engine step.
IMPORT_CHECK = r"""
import importlib, json, os, sys
site, root, modules = os.path.realpath(sys.argv[1]), sys.argv[2], [m for m in sys.argv[3].split(",") if m]
report = {"python": sys.version.split()[0], "executable": sys.executable, "modules": {}}
for name in modules:
    try:
        module = importlib.import_module(name)
        where = getattr(module, "__file__", None) or list(module.__path__)[0]
        report["modules"][name] = {"version": getattr(module, "__version__", None),
                                   "from_carried_wheels": os.path.realpath(where).startswith(site + os.sep)}
    except Exception as err:
        report["modules"][name] = {"error": f"{type(err).__name__}: {err}"[:300]}
import torch
report["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda,
                   "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    report["torch"]["device"] = torch.cuda.get_device_name(0)
    report["torch"]["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
import shutil
report["nvcc"] = shutil.which("nvcc")
report["dev_nvidiactl"] = os.path.exists("/dev/nvidiactl")
os.environ.pop("DS_ACCELERATOR", None)  # DeepSpeed's own choice first
import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.git_version_info import installed_ops, torch_info
accelerator = get_accelerator()
report["deepspeed"] = {"version": deepspeed.__version__, "accelerator_detected": accelerator.device_name(),
                       # bool(): the CPU accelerator answers None for fp16 on CPUs without AVX512-FP16
                       "bf16_supported": bool(accelerator.is_bf16_supported()),
                       "fp16_supported": bool(accelerator.is_fp16_supported()),
                       "ops_compiled_in_wheel": sorted(k for k, v in installed_ops.items() if v),
                       "wheel_torch_info": torch_info}
sys.path.insert(0, root)
from rlmm.runtime.runtime_env import set_runtime_env
set_runtime_env()
report["deepspeed"]["accelerator_rlmm_sets"] = os.environ["DS_ACCELERATOR"]  # what every rlmm run uses
from rlmm.runtime.devices import init_process_group, select_device
select_device()
init_process_group()
deepspeed.init_distributed(verbose=False)
dtype = "bf16" if accelerator.is_bf16_supported() else "fp32"
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1 << 30, "bf16": {"enabled": dtype == "bf16"},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
x = torch.randn(4, 16, device=engine.device, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
before = [p.detach().float().clone() for p in engine.module.parameters()]
loss = engine(x).float().pow(2).mean()
engine.backward(loss)
engine.step()
moved = any(not torch.equal(b, p.detach().float()) for b, p in zip(before, engine.module.parameters()))
report["deepspeed"]["one_step"] = {"dtype": dtype, "device": str(engine.device),
                                   "optimizer": type(engine.optimizer).__name__, "weights_moved": moved}
print("IMPORT_CHECK " + json.dumps(report))
"""

BUILD_MODEL = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from benchmarks.models import build_bench_model
if sys.argv[2] == "layouts":  # the model benchmarks/layouts.py builds for this workload, at the path it looks in
    import hashlib
    from benchmarks.common import WORKLOADS
    from benchmarks.models import SIZES
    from rlmm.models.tiny import default_cache_dir
    model = WORKLOADS[sys.argv[3]].model
    key = hashlib.sha256(json.dumps(SIZES[model], sort_keys=True).encode()).hexdigest()[:8]
    info = build_bench_model(default_cache_dir() / "benchmarks" / f"{model}-{key}", **SIZES[model])
else:
    info = build_bench_model(sys.argv[2], **json.loads(sys.argv[3]))
print("MODEL " + json.dumps(info))
"""


# ---- running commands ------------------------------------------------------------------------------------------

class GpuMemory:
    """Peak GPU memory of each watched command from nvidia-smi every 0.5 s: its process tree's (the compute
    apps whose pid is in it) and the whole device's (which also counts whatever else runs at the time)."""

    def __init__(self):
        self.lock, self.watched = threading.Lock(), {}
        self.available = shutil.which("nvidia-smi") is not None and self._sample() is not None
        if self.available:
            threading.Thread(target=self._loop, daemon=True).start()

    @staticmethod
    def _sample() -> tuple[dict[int, float], float] | None:
        try:
            smi = ["nvidia-smi", "--format=csv,noheader,nounits", "-i",
                   os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"]
            apps = subprocess.run([*smi, "--query-compute-apps=pid,used_memory"], capture_output=True, text=True,
                                  timeout=5).stdout
            used = subprocess.run([*smi, "--query-gpu=memory.used"], capture_output=True, text=True, timeout=5).stdout
            per_pid = {}
            for line in apps.splitlines():
                pid, _, mib = line.partition(",")
                if pid.strip().isdigit() and mib.strip().replace(".", "", 1).isdigit():
                    per_pid[int(pid)] = float(mib)
            return per_pid, float(used.strip().splitlines()[0])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            return None

    @staticmethod
    def _tree(pid: int) -> set[int]:
        try:
            import psutil

            root = psutil.Process(pid)
            return {pid, *(p.pid for p in root.children(recursive=True))}
        except Exception:  # psutil missing, or the process just ended
            return {pid}

    def _loop(self) -> None:
        while True:
            sample = self._sample()
            if sample:
                per_pid, device = sample
                with self.lock:
                    for peaks in self.watched.values():
                        own = sum(per_pid.get(p, 0.0) for p in self._tree(peaks["pid"]))
                        peaks["process"] = max(peaks["process"], own)
                        peaks["device"] = max(peaks["device"], device)
            time.sleep(0.5)

    def watch(self, key: str, pid: int) -> None:
        with self.lock:
            self.watched[key] = {"pid": pid, "process": 0.0, "device": 0.0}

    def done(self, key: str) -> dict:
        with self.lock:
            peaks = self.watched.pop(key)
        if not self.available:
            return {}
        return {"peak_gpu_mib": peaks["process"] or None, "peak_gpu_mib_device": peaks["device"]}


class Runner:
    """Runs one command at a time per caller thread, its output in logs/<name>.log, under a time limit."""

    def __init__(self, work: Path, env: dict[str, str]):
        self.logs, self.env, self.gpu = work / "logs", env, GpuMemory()
        self.logs.mkdir(parents=True, exist_ok=True)

    def run(self, name: str, command: list[str], timeout: float, env: dict | None = None) -> dict:
        log = self.logs / f"{name}.log"
        started, stopped = time.monotonic(), False
        with log.open("w") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                       env={**self.env, **(env or {})}, start_new_session=True)
            self.gpu.watch(name, process.pid)
            try:
                code = process.wait(timeout=max(timeout, 1))
            except subprocess.TimeoutExpired:
                stopped = True
                code = stop(process)
            peaks = self.gpu.done(name)
        row = {"name": name, "returncode": code, "seconds": round(time.monotonic() - started, 1), "log": log.name,
               **peaks}
        if stopped:
            row["failed"] = f"stopped at its time limit ({timeout:.0f} s)"
        elif code != 0:
            row["failed"] = failure_line(log)
        gpu = f", peak GPU {row['peak_gpu_mib']} MiB" if row.get("peak_gpu_mib") else ""
        print(f"  {name}: {'FAILED' if 'failed' in row else 'ok'} in {row['seconds']} s{gpu}"
              + (f" ({row['failed']})" if "failed" in row else ""), flush=True)
        return row


def stop(process: subprocess.Popen) -> int:
    """Stop a run's whole process group (its workers too): SIGINT first, so that `finally` blocks run (torch's
    extension builds release their lock file there: a killed DeepSpeed op build would leave it, and every later
    DeepSpeed start on the machine would wait for it), SIGKILL 10 s later."""
    for sig, grace in ((signal.SIGINT, 10), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            return process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
    return process.wait()


def failure_line(log: Path) -> str:
    """rlmm's own one-line error when it wrote one, else the last line that names an error, else the last."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    for pick in (lambda l: l.startswith("rlmm: "), lambda l: re.match(r"^\w*(Error|Exception)\b", l)):
        found = [line for line in lines if pick(line)]
        if found:
            return found[-1][:300]
    return (lines[-1] if lines else "no output")[:300]


def jit_ops(log: Path) -> list[str]:
    """Ops DeepSpeed (or torch's cpp_extension) built or loaded at run time, from a run's log: none expected
    on CUDA with torch_adam; on CPU DeepSpeed builds its shared-memory communication op."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return sorted(set(re.findall(r"(?:Building|Loading) extension module (\w+)", text))
                  | set(re.findall(r"DeepSpeed (\S+) built successfully", text)))


def not_started(name: str) -> dict:
    return {"name": name, "failed": "not started: its part's time limit was reached"}


# ---- the parts -------------------------------------------------------------------------------------------------

class Check:
    def __init__(self, args):
        self.args, self.dry = args, args.dry_run
        self.work, self.out = args.work, args.out
        self.site = self.work / "site"
        self.sizes = workloads(self.dry)
        self.model = str(Path(args.cache) / ("tiny-qwen-shape" if self.dry else "qwen2.5-0.5b-fullvocab"))
        self.facts: dict = {}  # what setup found that later parts use
        env = {k: v for k, v in os.environ.items() if k not in PROCESS_GROUP_VARS}
        env.update(PYTHONPATH=os.pathsep.join([str(self.site), str(ROOT), *filter(None, [env.get("PYTHONPATH")])]),
                   RLMM_CACHE=str(args.cache), PYTHONUNBUFFERED="1", DS_BUILD_OPS="0",
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # nothing to fetch; no network there
        self.runner = Runner(self.work, env)
        self.python = sys.executable

    def rlmm(self, *args: str) -> list[str]:
        return [self.python, "-m", "rlmm.cli", *args]

    # -- setup
    def setup(self, deadline: float) -> dict:
        record: dict = {}
        if self.dry:  # the install code on a wheel made here (and hjson's, when .gpu_wheels holds it)
            folder = self.work / "dry_wheels"
            make_wheel(folder, "rlmm_wheel_check", "1.0", {
                "rlmm_wheel_check/__init__.py": "VALUE = 'from the site folder'\n",
                "rlmm_wheel_check-1.0.data/purelib/rlmm_wheel_check_data.py": "VALUE = 'purelib'\n",
                "rlmm_wheel_check-1.0.data/scripts/rlmm-wheel-check": "#!/bin/sh\n"})
            make_wheel(folder / "if_missing", "packaging", "0.0", {"packaging/__init__.py": "raise ImportError\n"})
            make_wheel(folder / "if_missing", "rlmm_wheel_check_missing", "1.0",
                       {"rlmm_wheel_check_missing.py": "VALUE = 1\n"})
            for wheel in sorted(self.args.wheels.glob("hjson-*.whl"))[:1]:
                shutil.copy(wheel, folder)
        else:
            folder = self.args.wheels
        if folder.is_dir():
            record["wheels"] = install_wheels(folder, self.site)
        else:
            record["wheels"] = []
            record["note"] = f"no {folder}: nothing unzipped (bash scripts/gpu_wheels.sh makes it; carry it)"
        modules = sorted({m for row in record["wheels"] if row["installed"] for m in row["modules"]}
                         | {"deepspeed", "hydra", "omegaconf", "transformers"})
        started = time.monotonic()
        spec = TINY if self.dry else QWEN_05B
        builds = {
            "model": subprocess.Popen([self.python, "-c", BUILD_MODEL, str(ROOT), self.model, json.dumps(spec)],
                                      cwd=ROOT, env=self.runner.env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True),
            "layouts_model": subprocess.Popen([self.python, "-c", BUILD_MODEL, str(ROOT), "layouts",
                                               self.sizes["layouts"][1]], cwd=ROOT, env=self.runner.env,
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                              start_new_session=True)}
        check = self.runner.run("import-check", [self.python, "-c", IMPORT_CHECK, str(self.site), str(ROOT),
                                                 ",".join(modules)], deadline - time.monotonic())
        log = self.runner.logs / check["log"]
        line = next((l for l in log.read_text(errors="replace").splitlines() if l.startswith("IMPORT_CHECK ")), None)
        if line:
            record["imports"] = json.loads(line.removeprefix("IMPORT_CHECK "))
            self.facts["deepspeed"] = record["imports"]["deepspeed"]
            missing = [m for m, r in record["imports"]["modules"].items() if "error" in r]
            if missing:
                record["failed"] = f"cannot import {', '.join(missing)}"
        else:
            record["failed"] = f"import check: {check.get('failed', 'no report')}"
        record["import_check_seconds"] = check["seconds"]
        record["import_check_jit_ops"] = jit_ops(log)
        for name, process in builds.items():
            try:
                output, _ = process.communicate(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                stop(process)
                output = process.communicate()[0]
            (self.runner.logs / f"build-{name}.log").write_text(output or "")
            line = next((l for l in (output or "").splitlines() if l.startswith("MODEL ")), None)
            if line:
                record[name] = json.loads(line.removeprefix("MODEL "))
            else:
                problem = f"{name} not built: " + ((output or "").strip().splitlines() or ["no output"])[-1][:250]
                record["failed"] = f"{record['failed']}; {problem}" if "failed" in record else problem
        record["build_seconds"] = round(time.monotonic() - started, 1)
        return record

    # -- train
    def train(self, deadline: float) -> dict:
        w = self.sizes["train"]
        common = ["model=hf", f"model.path={self.model}", "sampler=hf", "trainer=deepspeed", "logger=none",
                  f"sampling.max_new_tokens={w['tokens']}", f"train.steps={w['steps']}",
                  f"train.prompts_per_step={w['prompts']}", f"algo.group_size={w['group']}",
                  f"train.eval_prompts={w['eval_prompts']}", f"train.eval_every={w['steps']}",
                  "train.checkpoint_every=0",
                  # A random-init model earns no reward, so every GRPO advantage is 0 and the loss with it: a small
                  # entropy bonus gives every step a gradient, so each update really moves the weights.
                  "algo.entropy_coef=0.01"]
        deepspeed = self.facts.get("deepspeed", {})
        runs = []
        # the zero-mismatch arm last (docs/precision.md#the-bitwise-arm-samplerbitwise), on fewer, shorter answers: it
        # decodes without a KV cache. Expected on CUDA as on CPU: agreement/bitwise 1 at every step (the same shapes
        # on both sides; a step that is not bitwise stops the run, naming the token)
        b = self.sizes["bitwise"]
        grid = [(precision, zero, f"train-{precision}-zero{zero}", []) for precision, zero in TRAIN_GRID] + [
            ("bf16", 0, "train-bitwise-bf16", ["sampler=bitwise", f"sampling.max_new_tokens={b['tokens']}",
                                               f"train.prompts_per_step={b['prompts']}", f"algo.group_size={b['group']}"])]
        for precision, zero, name, arm in grid:
            dtype = precision[:4]
            if deepspeed.get(f"{dtype}_supported", True) is False:  # fp32: no key, always supported
                runs.append({"name": name, "precision": precision, "zero_stage": zero,
                             "skipped": f"DeepSpeed's {deepspeed.get('accelerator_detected')} accelerator reports "
                                        f"{dtype} unsupported on this machine"})
                continue
            left = deadline - time.monotonic()
            if left < 5:
                runs.append({**not_started(name), "precision": precision, "zero_stage": zero})
                continue
            run_dir = self.work / "runs" / name
            row = self.runner.run(name, self.rlmm("train", *common, f"precision={precision}",
                                                  f"trainer.zero_stage={zero}", *arm, f"hydra.run.dir={run_dir}"),
                                  min(left, self.args.run_timeout))
            row.update(precision=precision, zero_stage=zero, jit_ops=jit_ops(self.runner.logs / row["log"]))
            if "failed" not in row:
                row.update(train_figures(run_dir))
            runs.append(row)
        return {"workload": w, "runs": runs, "zero2_vs_zero0": same_first_step(runs, "train-bf16-zero0",
                                                                                 "train-bf16-zero2")}

    # -- probe
    def probe(self, deadline: float) -> dict:
        w = self.sizes["probe"]
        bi_prompts, bi_completions, bi_batch = w["bi"]
        common = ["model=hf", f"model.path={self.model}", "sampler=hf", "logger=none",
                  f"sampling.max_new_tokens={w['tokens']}", f"probe.num_prompts={w['prompts']}",
                  f"probe.samples_per_prompt={w['samples']}",
                  f"probe.trainer_micro_batch_sizes={w['micro_batch_sizes']}",
                  f"probe.batch_invariance.num_prompts={bi_prompts}",
                  f"probe.batch_invariance.num_completions={bi_completions}",
                  f"probe.batch_invariance.max_batch_size={bi_batch}"]
        jobs = self.args.probe_jobs
        threads = str(max(1, len(os.sched_getaffinity(0)) // jobs))

        def one(job: tuple[str, str]) -> dict:
            trainer, precision = job
            name = f"probe-{trainer}-{precision}"
            left = deadline - time.monotonic()
            if left < 5:
                return {**not_started(name), "trainer": trainer, "precision": precision}
            run_dir = self.work / "runs" / name
            row = self.runner.run(name, self.rlmm("probe", *common, f"trainer={trainer}", f"precision={precision}",
                                                  f"hydra.run.dir={run_dir}"),
                                  min(left, self.args.run_timeout), env={"OMP_NUM_THREADS": threads})
            row.update(trainer=trainer, precision=precision)
            if "failed" not in row:
                row.update(probe_figures(run_dir))
            return row

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            grid = list(pool.map(one, [(t, p) for p in PROBE_PRECISIONS for t in PROBE_TRAINERS]))
        # the routing probe is no cell of the trainer x precision grid that compare_trainers pairs up
        return {"workload": {**w, "bi": list(w["bi"])}, "jobs_at_once": jobs,
                "runs": grid + [self.routing_probe(deadline)],
                "torch_vs_fsdp": compare_trainers(grid, first_run=None if self.dry else FIRST_RUN)}

    def routing_probe(self, deadline: float) -> dict:
        """Routing replay on CUDA (issue 25): the shipped MoE model (`model=tiny_moe`), the transformers sampler's
        captured experts replayed by the torch trainer (routing=r3), bf16 sampler against an fp32 trainer."""
        name = "probe-routing-r3"
        left = deadline - time.monotonic()
        if left < 5:
            return not_started(name)
        run_dir = self.work / "runs" / name
        row = self.runner.run(name, self.rlmm("probe", "model=tiny_moe", "routing=r3", "sampler=hf", "trainer=torch",
                                              "precision=bf16_sampler_fp32_trainer", "logger=none",
                                              "probe.num_prompts=16", "probe.batch_invariance.num_prompts=2",
                                              "probe.batch_invariance.num_completions=2",
                                              "probe.batch_invariance.max_batch_size=4", f"hydra.run.dir={run_dir}"),
                              min(left, self.args.run_timeout))
        if "failed" not in row:
            row.update(probe_figures(run_dir))
            routing = json.loads((run_dir / "probe.json").read_text())["routing"]
            row["routing"] = {"disagreement": routing["disagreement"], "share_removed": routing["share_removed"]}
        return row

    # -- layouts
    def layouts(self, deadline: float) -> dict:
        out = self.out / "layouts.json"
        row = self.runner.run("layouts", [self.python, "-m", "benchmarks.layouts", *self.sizes["layouts"], "--out",
                                          str(out)], deadline - time.monotonic())
        record = {"command": "python -m benchmarks.layouts " + " ".join(self.sizes["layouts"]), "run": row}
        if "failed" not in row:
            layouts = json.loads(out.read_text())
            record.update(device=layouts["device"], tokens_per_minibatch=layouts["tokens_per_minibatch"],
                          summary={name: {k: s[k] for k in ("wall_median", "wall_speedup_vs_padded",
                                                            "peak_above_mib_max", "attention", "micro_batch_tokens",
                                                            "gradient_checkpointing", "positions_per_minibatch",
                                                            "micro_batches")}
                                   for name, s in layouts["summary"].items()})
        return record


def train_figures(run_dir: Path) -> dict:
    """A train run's figures from its steps.jsonl and summary.json; metrics only some versions log are read
    by name where present (`*loss_scale*`, `*skipped*`)."""
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines() if line.strip()]
    trained = [s for s in steps if s.get("step", 0) > 0]
    extra = sorted({k for s in trained for k in s if "loss_scale" in k or k.endswith("skipped")})
    per_step = [{"step": s["step"],
                 "logprob_abs_diff_mean": s.get("mismatch/logprob_abs_diff_mean"),
                 "logprob_abs_diff_max": s.get("mismatch/logprob_abs_diff_max"),
                 "kl_k3": s.get("mismatch/kl_k3"),
                 "seconds": round(sum(v for k, v in s.items() if k.startswith("perf/") and k.endswith("_seconds")
                                      and isinstance(v, (int, float))), 3),
                 "loss": s.get("loss/loss"), "grad_norm": s.get("loss/grad_norm"),
                 "agreement_bitwise": s.get("agreement/bitwise"),
                 **{k: s.get(k) for k in extra}} for s in trained]
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    warm = per_step[1:] or per_step  # the first step pays for warm-up
    # Whether sampler and trainer gave bit-identical log-probs on every scored token (every step's largest |δ| 0):
    # the "bitwise on-policy" arm. Kernel-dependent: seen on AVX512-BF16 CPUs for sampler=hf trainer=deepspeed in
    # bf16 and fp16, not on AVX2 (docs/precision.md, "Bitwise on-policy on some CPUs").
    largest = [s["logprob_abs_diff_max"] for s in per_step]
    bitwise = None if None in largest or not largest else all(v == 0 for v in largest)
    return {"steps": len(trained), "skipped_steps": sum(bool(s.get("train/skipped")) for s in trained),
            "bitwise_on_policy": bitwise,
            "loss_scale": {k: [s.get(k) for s in trained] for k in extra if "loss_scale" in k},
            "step_seconds_median": statistics.median(s["seconds"] for s in warm) if warm else None,
            "per_step": per_step, "precision_report": summary.get("precision"),
            "bad_steps": summary.get("bad_steps"), "seconds_in_run": summary.get("seconds")}


def same_first_step(runs: list[dict], first: str, second: str) -> dict:
    """Whether two train runs scored their first step alike: the same model, seed and rollouts give the same
    first-step mismatch whatever the ZeRO stage (it shards the optimizer, not the forward), on any kernels. The
    check a kernel-dependent figure is tested by (tests/test_gpu_lent_check.py), since its size is not."""
    by = {run["name"]: run for run in runs if run.get("per_step")}
    if first not in by or second not in by:
        return {"missing": [name for name in (first, second) if name not in by]}
    a, b = by[first]["per_step"][0], by[second]["per_step"][0]
    keys = ("logprob_abs_diff_mean", "logprob_abs_diff_max", "kl_k3")
    return {"runs": [first, second], **{k: [a[k], b[k]] for k in keys}, "same": all(a[k] == b[k] for k in keys)}


def probe_figures(run_dir: Path) -> dict:
    record = json.loads((run_dir / "probe.json").read_text())
    keys = ("logprob_abs_diff_mean", "logprob_abs_diff_max", "kl_k3", "prob_pearson", "chi2_token")
    return {"sampler_vs_trainer": {k: record["sampler_vs_trainer"][k] for k in keys},
            "trainer_vs_itself": {k: record["trainer_vs_itself"][k] for k in ("micro_batch_sizes", *keys)},
            "precision_report": record["precision"], "seconds_in_run": record.get("seconds"),
            "mean_response_length": record.get("rollouts", {}).get("mean_response_length")}


def compare_trainers(runs: list[dict], first_run: Path | None) -> dict:
    """Per precision, torch's sampler-vs-trainer figures beside FSDP's (docs/precision.md predicts the same
    figures since the RoPE cast fix) and, on the GPU, the first run's (before that fix, same workload)."""
    by = {(r["trainer"], r["precision"]): r.get("sampler_vs_trainer") for r in runs}
    earlier = json.loads(first_run.read_text()) if first_run and first_run.exists() else {}
    table = {}
    for precision in PROBE_PRECISIONS:
        fsdp, torch_ = by.get(("fsdp", precision)), by.get(("torch", precision))
        if not (fsdp and torch_):
            table[precision] = {"missing": [t for t in PROBE_TRAINERS if not by.get((t, precision))]}
            continue
        row = {"fsdp": {k: fsdp[k] for k in COMPARED}, "torch": {k: torch_[k] for k in COMPARED},
               "torch_over_fsdp": {k: (torch_[k] / fsdp[k] if fsdp[k] else None) for k in COMPARED},
               "same_figures": all(fsdp[k] == torch_[k] for k in COMPARED)}
        before = {t: earlier.get(f"probe-{t}-{precision}", {}).get("sampler_vs_trainer") for t in PROBE_TRAINERS}
        if all(before.values()):
            row["first_run"] = {"source": str(first_run.relative_to(ROOT)),
                                **{t: {k: before[t][k] for k in COMPARED} for t in PROBE_TRAINERS}}
        table[precision] = row
    return table


# ---- report ----------------------------------------------------------------------------------------------------

def part_ok(record: dict) -> bool:
    runs = record.get("runs", []) + ([record["run"]] if "run" in record else [])
    return "failed" not in record and not any("failed" in r for r in runs)


def print_table(record: dict) -> None:
    print(f"\n{record['check']}: {record['seconds']} s")
    for name, part in record["parts"].items():
        print(f"  {name:8s} {'ok' if part['ok'] else 'FAILED':6s} {part['seconds']:6.1f} s of {part['limit_seconds']}"
              + (f"  ({part['failed']})" if "failed" in part else ""))
    setup = record["parts"].get("setup", {})
    ds = setup.get("imports", {}).get("deepspeed")
    if ds:
        print(f"  DeepSpeed {ds['version']}: accelerator {ds['accelerator_detected']} (rlmm sets "
              f"{ds['accelerator_rlmm_sets']}), one step {ds['one_step']}")
    header = f"  {'run':34s} {'ok':4s} {'s':>6s} {'GPU MiB':>8s} {'steps':>5s} {'skip':>4s} {'|δ| mean':>9s} " \
             f"{'KL k3':>9s} {'step s':>7s}  loss scale"
    print("\n" + header)
    for part in ("train", "probe"):
        for run in record["parts"].get(part, {}).get("runs", []):
            if "skipped" in run:
                print(f"  {run['name']:34s} skip  ({run['skipped']})")
                continue
            if part == "train" and run.get("per_step"):
                mean = statistics.mean(s["logprob_abs_diff_mean"] or 0 for s in run["per_step"])
                kl = statistics.mean(s["kl_k3"] or 0 for s in run["per_step"])
            else:
                figures = run.get("sampler_vs_trainer") or {}
                mean, kl = figures.get("logprob_abs_diff_mean"), figures.get("kl_k3")
            cell = lambda v, f: format(v, f) if isinstance(v, (int, float)) else "-"
            scale = "; ".join(f"{k.split('/')[-1]} {v}" for k, v in run.get("loss_scale", {}).items()) or "-"
            print(f"  {run['name']:34s} {'no' if 'failed' in run else 'yes':4s} {cell(run.get('seconds'), '6.1f')} "
                  f"{cell(run.get('peak_gpu_mib') or run.get('peak_gpu_mib_device'), '8.0f')} "
                  f"{cell(run.get('steps'), '5d')} "
                  f"{cell(run.get('skipped_steps'), '4d')} {cell(mean, '9.2e')} {cell(kl, '9.2e')} "
                  f"{cell(run.get('step_seconds_median'), '7.2f')}  {scale}"
                  + ("  (bitwise: every |δ| 0)" if run.get("bitwise_on_policy") else ""))
    compared = record["parts"].get("train", {}).get("zero2_vs_zero0", {})
    if "same" in compared:
        print(f"  ZeRO-2 vs ZeRO-0, bf16, step 1: mean |δ| {compared['logprob_abs_diff_mean'][1]:.3e} vs "
              f"{compared['logprob_abs_diff_mean'][0]:.3e}: {'the same' if compared['same'] else 'differ'}")
    for precision, row in record["parts"].get("probe", {}).get("torch_vs_fsdp", {}).items():
        if "fsdp" in row:
            print(f"  torch vs fsdp, {precision:14s} mean |δ| {row['torch']['logprob_abs_diff_mean']:.3e} vs "
                  f"{row['fsdp']['logprob_abs_diff_mean']:.3e}: {'the same' if row['same_figures'] else 'differ'}")
    for name, layout in record["parts"].get("layouts", {}).get("summary", {}).items():
        print(f"  layout {name:18s} {layout['wall_median']:.3f} s (x{layout['wall_speedup_vs_padded']:.2f}), "
              f"peak +{layout['peak_above_mib_max']:.0f} MiB, {layout['attention']}")
    for part in record["parts"].values():
        for run in part.get("runs", []):
            if "failed" in run:
                print(f"{run['name']}: {run['failed']}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="every part on this CPU with a tiny model")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".gpu_wheels", help="scripts/gpu_wheels.sh's folder")
    parser.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                        help="results folder (default: $OUT, else benchmarks/results/gpu_lent_<date>)")
    parser.add_argument("--work", type=Path, help="site folder, runs and logs (default: a new folder under /tmp)")
    parser.add_argument("--cache", default=os.environ.get("RLMM_CACHE", str(Path.home() / ".cache" / "rlmm")),
                        help="where the built models are kept")
    parser.add_argument("--probe-jobs", type=int, help="probe runs at once (default: 4 on the GPU, 2 in the dry run)")
    parser.add_argument("--run-timeout", type=float, default=110, help="seconds per train or probe run at most")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    if set(parts) - set(PARTS):
        parser.error(f"--parts: unknown {', '.join(sorted(set(parts) - set(PARTS)))} (allowed: {', '.join(PARTS)})")
    args.probe_jobs = args.probe_jobs or (2 if args.dry_run else 4)
    args.out = args.out or ROOT / "benchmarks" / "results" / time.strftime("gpu_lent_%Y-%m-%d_%H-%M-%S")
    args.out.mkdir(parents=True, exist_ok=True)
    args.work = args.work or Path(tempfile.mkdtemp(prefix="gpu_lent_check_"))
    args.work.mkdir(parents=True, exist_ok=True)
    from benchmarks.common import git_commit, machine_info

    started = time.monotonic()
    record = {"check": "lent GPU machine check" + (" (dry run on CPU)" if args.dry_run else ""),
              "dry_run": args.dry_run, "commit": git_commit(), "machine": machine_info(),
              "estimates_seconds": {name: p.estimate for name, p in PARTS.items()}, "parts": {}}
    check = Check(args)
    print(f"{record['check']}: work in {args.work}, results in {args.out}", flush=True)
    for name in parts:
        limit = PARTS[name].dry_limit if args.dry_run else PARTS[name].limit
        print(f"{name} (limit {limit:.0f} s)", flush=True)
        part_started = time.monotonic()
        try:
            part = getattr(check, name)(part_started + limit)
        except Exception as err:  # a part's own failure: the next parts still run
            part = {"failed": f"{type(err).__name__}: {err}"[:300]}
        part.update(seconds=round(time.monotonic() - part_started, 1), limit_seconds=limit)
        part["ok"] = part_ok(part)
        failed = [r for r in [*part.get("runs", []), part.get("run", {})] if "failed" in r]
        if failed and "failed" not in part:  # the part's one line: its first failing run's
            part["failed"] = f"{failed[0]['name']}: {failed[0]['failed']}"[:300] + (
                f" (and {len(failed) - 1} more)" if len(failed) > 1 else "")
        record["parts"][name] = part
    record["seconds"] = round(time.monotonic() - started, 1)
    (args.out / "gpu_lent_check.json").write_text(json.dumps(record, indent=2, default=str))
    with tarfile.open(args.out / "gpu_lent_runs.tar.gz", "w:gz") as archive:
        for folder in ("logs", "runs"):
            if (args.work / folder).exists():
                archive.add(args.work / folder, arcname=folder)
    print_table(record)
    print(f"wrote {args.out / 'gpu_lent_check.json'} ({record['seconds']} s)")
    if not all(part["ok"] for part in record["parts"].values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
