"""Each rank joins rlmm's process group, takes part in one all-gather and returns without destroying the group:
the exit that aborted gloo ranks in the interpreter's finalization (pytorch/pytorch#190489). Run by
tests/test_devices.py:

    torchrun --nproc_per_node 5 tests/gloo_exit.py
"""
import torch
import torch.distributed as dist

from rlmm.runtime.devices import init_process_group

init_process_group()
gathered = [torch.empty(1) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, torch.tensor([float(dist.get_rank())]))
assert [t.item() for t in gathered] == list(range(dist.get_world_size()))
