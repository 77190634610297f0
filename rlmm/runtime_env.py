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


def set_runtime_env() -> None:
    """Environment that must be in place before torch or vLLM are imported."""
    return_freed_blocks_to_the_os()
    # In-process vLLM otherwise pins torch to one thread, halving the trainer's speed on CPU.
    os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if os.path.exists("/dev/nvidiactl") else "cpu")
