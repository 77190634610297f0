"""The process environment rlmm sets before torch or vLLM are imported (threads, allocator, engine
switches): a leaf module, so the CLI, the apps, submitted jobs and scripts all set it the same way."""
from __future__ import annotations

import os


# glibc's malloc serves blocks below its mmap threshold from its heap and keeps them resident after
# they are freed; the threshold rises (up to 32 MiB) each time a larger block is freed, so a training
# step's many-MiB activations and gradients end up there. Blocks of 1 MiB and more are mmapped instead,
# and go back to the OS when freed: at 0.5B parameters the fp32 train run peaked at 16.9 GiB without this
# and 14.6 GiB with it, in the same time (docs/precision.md#measured-at-real-scale-on-a-cpu).
MMAP_THRESHOLD_BYTES = 1 << 20


def return_freed_blocks_to_the_os() -> None:
    """Fix glibc's mmap threshold (MALLOC_MMAP_THRESHOLD_ if set, else 1 MiB) in this process and in the
    processes it starts (torchrun ranks, SLURM jobs); nothing on a libc other than glibc."""
    import ctypes

    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD_BYTES))
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_mmap_threshold = -3  # <malloc.h> M_MMAP_THRESHOLD
    mallopt(m_mmap_threshold, int(os.environ["MALLOC_MMAP_THRESHOLD_"]))


# ATEN_CPU_CAPABILITY lowers only ATen's own vectorized kernels; oneDNN still detects the CPU and picks
# AMX/AVX-512 brgemm, and SDPA's flash kernel then packs its bf16 blocks with ATen's pack_vnni2, which
# refuses below AVX-512: at sequences of ~300 tokens and more `ATEN_CPU_CAPABILITY=avx2` alone fails with
# "pack_vnni2 is only supported when avx512 is supported" on an AVX512-BF16/AMX CPU (torch 2.13). An AVX2
# machine has neither, so oneDNN is held to the same ISA (docs/testing.md#machine-dependent-figures).
ONEDNN_ISA_FOR_ATEN_CAPABILITY = {"default": "SSE41", "avx2": "AVX2"}


def hold_onednn_to_atens_capability() -> None:
    """Where ATEN_CPU_CAPABILITY forces a capability below AVX-512 and ONEDNN_MAX_CPU_ISA is unset, set
    ONEDNN_MAX_CPU_ISA to match, so the process computes as a machine with that capability does."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if capability in ONEDNN_ISA_FOR_ATEN_CAPABILITY:
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", ONEDNN_ISA_FOR_ATEN_CAPABILITY[capability])


def set_runtime_env() -> None:
    """Environment that must be in place before torch or vLLM are imported."""
    return_freed_blocks_to_the_os()
    hold_onednn_to_atens_capability()
    # In-process vLLM otherwise pins torch to one thread, halving the trainer's speed on CPU.
    os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if os.path.exists("/dev/nvidiactl") else "cpu")
