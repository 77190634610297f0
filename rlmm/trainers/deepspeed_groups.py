"""DeepSpeed's handle on the process groups, kept in step with torch's.

DeepSpeed caches its process groups (and its communication backend) in module globals, made once by
`deepspeed.init_distributed` / `deepspeed.initialize`. In-process vLLM creates the default group and
destroys it when its engine closes, and a new trainer may then build on a new one: the cache must go
with the group it was made from. The reach into those globals is `deepspeed_internals`.
"""
from __future__ import annotations

from rlmm.trainers.deepspeed_internals import cached_process_groups, forget_process_groups, live_process_groups


def forget_stale_groups() -> None:
    """Drop DeepSpeed's cached process groups when they no longer belong to torch's current world.

    If the default group was destroyed and re-created since DeepSpeed cached it (in-process vLLM does both
    when engines come and go), the cache points at dead groups; before any group exists it is dropped too."""
    import torch.distributed as dist

    live = live_process_groups()
    stale = [g for g in cached_process_groups() if g not in live]
    if stale or not dist.is_initialized():
        forget_process_groups()


def release_groups() -> None:
    """Let go of every group DeepSpeed holds, when its engine closes (the group may be the one in-process
    vLLM created and is about to destroy)."""
    forget_process_groups()
