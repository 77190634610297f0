"""Which device and which communication backend each rank uses, from the launcher's environment.

Pure functions of (LOCAL_RANK, WORLD_SIZE, what the machine has), so the choices a GPU node makes are
testable on a CPU. The facts behind them (docs/precision.md#one-gpu-and-a-slurm-gpu-node):

- vLLM's single-process executor runs on the current CUDA device (`cuda` means GPU 0), and so do
  `torch.empty(device="cuda")`, NCCL and DeepSpeed's accelerator: every rank must call
  `torch.cuda.set_device(LOCAL_RANK)` before any engine starts, or all of them land on GPU 0.
- With several ranks, each holding its own engine, vLLM must not start its own process group: the
  `external_launcher` executor joins the world torchrun / SLURM made (TRL's colocate mode does this).
- rlmm all-reduces CPU tensors (stop flags, metrics, the loss normaliser), which NCCL cannot carry:
  on GPUs the default group is `cpu:gloo,cuda:nccl`, one backend per device type.
"""
from __future__ import annotations

import os

import torch


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def global_rank() -> int:
    """This process's rank in the world (torch.distributed's when it runs, else the launcher's RANK)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def rank_device(local_rank: int, cuda_devices: int) -> torch.device:
    """The device of the rank with this LOCAL_RANK on a node with `cuda_devices` visible GPUs: its own
    GPU, or the CPU where there is none. A node with fewer GPUs than ranks is refused, not shared."""
    if cuda_devices == 0:
        return torch.device("cpu")
    if local_rank >= cuda_devices:
        raise ValueError(f"LOCAL_RANK {local_rank}: this node has {cuda_devices} visible GPU(s); start at most "
                         f"{cuda_devices} rank(s) per node (torchrun --nproc_per_node, hydra.launcher.tasks_per_node)")
    return torch.device("cuda", local_rank)


def process_group_backend(cuda: bool) -> str:
    """gloo on CPUs; on GPUs NCCL for CUDA tensors and gloo for the CPU ones rlmm reduces."""
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def vllm_executor_backend(world: int) -> str | None:
    """vLLM's `distributed_executor_backend`: its default (one process, its own world of one) for a single
    rank; `external_launcher` when the rank is one of several, so the engine joins their world."""
    return "external_launcher" if world > 1 else None


def select_device() -> torch.device:
    """This rank's device, made current (torch.cuda.set_device) before any engine or process group
    starts on it. Idempotent."""
    device = rank_device(local_rank(), torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def init_process_group() -> None:
    """Start torch.distributed from the launcher's environment (torchrun, the deepspeed launcher, SLURM
    via submitit), or as a world of one; a no-op when it is already running. Call `select_device` first.

    The group, ours or the one in-process vLLM made, is destroyed when the process exits: a gloo rank that
    exits with its group alive aborts in the interpreter's finalization ("terminate called without an active
    exception", SIGABRT) when the group's worker threads still hold tensors (pytorch/pytorch#190489; ~2 in 90
    two-rank FSDP resumes here, 7 in 10 five-rank all-gathers)."""
    import atexit
    import socket

    import torch.distributed as dist

    # DeepSpeed checks these even when a process group exists (in-process vLLM creates its own).
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(key, value)
    atexit.unregister(destroy_process_group)  # once per process, however many apps start in it
    atexit.register(destroy_process_group)
    if dist.is_available() and dist.is_initialized():
        return
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:  # a free port, so parallel runs on one node do not collide
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(backend=process_group_backend(torch.cuda.is_available()), init_method="env://")


def destroy_process_group() -> None:
    """torch.distributed's default group and every other, destroyed if one is running (see `init_process_group`)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
