"""The process environment rlmm sets before torch or vLLM are imported (threads, allocator, engine
switches): a leaf module, so the CLI, the apps, submitted jobs and scripts all set it the same way."""
from __future__ import annotations

import os

from rlmm.runtime import cpu


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


# ATEN_CPU_CAPABILITY lowers only ATen's own vectorized kernels, to look at an AVX2 machine's numbers on an
# AVX-512 one. On an AMX CPU that leaves torch inconsistent: oneDNN still reports AMX brgemm, and SDPA's bf16
# flash kernel (sequences of ~300 tokens and more) then packs its blocks with ATen's pack_vnni2, which refuses
# below AVX-512 ("pack_vnni2 is only supported when avx512 is supported", torch 2.13). So oneDNN is held below
# AMX. vLLM's CPU kernels still choose AMX from the CPU's flags, and run only once the process holds the
# kernel's permission for AMX's tile data (arch_prctl ARCH_REQ_XCOMP_PERM), which oneDNN asks for only where
# it may use AMX itself: that is asked for here. Holding oneDNN to AVX2 instead fails in vLLM ("BFloat16 Brgemm
# VNNI format is only supported ... when `amx` is supported"). docs/testing.md#machine-dependent-figures
ONEDNN_ISA_BELOW_AMX = "AVX512_CORE_BF16"
SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18  # x86-64 Linux, <asm/prctl.h>


def hold_onednn_below_amx_for_a_forced_capability() -> None:
    """Where ATEN_CPU_CAPABILITY forces avx2 or default on a CPU with AMX: hold oneDNN below AMX (unless
    ONEDNN_MAX_CPU_ISA is set) and ask the kernel for AMX's tile data, so torch's and vLLM's CPU kernels both
    run. The permission is asked for in every process: it does not pass to a program a process starts."""
    if cpu.forced_capability() not in ("AVX2", "DEFAULT") or not cpu.features().amx:
        return
    import ctypes

    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", ONEDNN_ISA_BELOW_AMX)
    ctypes.CDLL(None, use_errno=True).syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)


def keep_compiled_kernels_apart_per_capability() -> None:
    """Where ATEN_CPU_CAPABILITY is set: torch.compile's kernels cached in a folder of that capability's own
    (unless TORCHINDUCTOR_CACHE_DIR is set). Inductor's cache key leaves the capability out (torch 2.13): C++
    vectorized for the CPU's own ISA and cached by a native run is reused under `default`, which compiles it
    without the vector headers ("'at::vec' has not been declared"), and vLLM's sampler fails. Kernels generated
    for `avx2` on an AVX-512 machine would be reused natively the other way round."""
    import tempfile

    capability = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if capability:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                              os.path.join(tempfile.gettempdir(), f"torchinductor_uid{os.getuid()}_{capability}"))


def set_runtime_env() -> None:
    """Environment that must be in place before torch or vLLM are imported."""
    return_freed_blocks_to_the_os()
    hold_onednn_below_amx_for_a_forced_capability()
    keep_compiled_kernels_apart_per_capability()
    # In-process vLLM otherwise pins torch to one thread, halving the trainer's speed on CPU.
    os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if os.path.exists("/dev/nvidiactl") else "cpu")
