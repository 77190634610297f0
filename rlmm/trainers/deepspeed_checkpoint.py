"""A DeepSpeed engine's weights and trainer checkpoints (`trainer=deepspeed`): the full Hugging Face-named
weights every rank can read (gathered from ZeRO-3's partitions as they are read), and each rank's optimizer,
LR schedule and step counters saved and restored through rlmm's checkpoint (rlmm/run/checkpoint.py), not
DeepSpeed's own `save_checkpoint` directory layout. The reaches into DeepSpeed's internals are
`deepspeed_internals`.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from rlmm.trainers.deepspeed_head import FP32HeadOptimizer
from rlmm.trainers.deepspeed_internals import (engine_counters, load_zero_optimizer, local_partition,
                                               restore_engine_counters)


class ZeRO3Weights(Mapping):
    """Hugging Face-named weights of a ZeRO-3 module, each parameter gathered from its partitions as it is
    read (`deepspeed.zero.GatheredParameters([p])`) and returned as a detached clone, so the extra peak is
    one full tensor, not the model twice (the gather, then its clone). Reading is a collective: every rank
    must read the same names in the same order (the names of `module.state_dict()`, tied aliases included:
    a tied head is read under both names). Buffers are whole on every rank. `local_shards()`: this rank's
    partitions (`local_partition`), for the NaN guard (rlmm/trainers/weight_sync.py)."""

    def __init__(self, module: torch.nn.Module):
        self.names = list(module.state_dict(keep_vars=True))
        self.params = dict(module.named_parameters(remove_duplicate=False))
        self.buffers = dict(module.named_buffers(remove_duplicate=False))
        self.module = module

    def __getitem__(self, name: str) -> torch.Tensor:
        import deepspeed

        if name in self.params:
            param = self.params[name]
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                return param.detach().clone()
        return self.buffers[name].detach()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def local_shards(self) -> list[torch.Tensor]:
        own = {id(p): local_partition(p) for p in self.module.parameters()}
        return [*own.values(), *(self.buffers[n] for n in self.names if n in self.buffers)]


def full_weights(engine) -> Mapping[str, torch.Tensor]:
    """Full Hugging Face-named weights on every rank. Under ZeRO-3 each is gathered from its partitions as
    it is read (`ZeRO3Weights`: a collective, every rank reads them all in one order, as a weight sync
    does), one tensor at a time."""
    if engine.zero_optimization_stage() == 3:
        return ZeRO3Weights(engine.module)
    return {k: v.detach() for k, v in engine.module.state_dict().items()}


def checkpoint_state(engine, head_optimizer: FP32HeadOptimizer | None) -> dict:
    """This rank's optimizer (ZeRO: its partition and fp32 master weights), LR schedule and step
    counters: tensors and plain values only, so `torch.load(weights_only=True)` reads them back
    (with DeepSpeed's bookkeeping types allowed, `deepspeed_internals.checkpoint_types`)."""
    state = {"optimizer": engine.optimizer.state_dict(), "lr_schedule": engine.lr_scheduler.state_dict(),
             "counters": engine_counters(engine)}
    if head_optimizer is not None:
        state["fp32_head"] = head_optimizer.state_dict()
    return state


def load_checkpoint(engine, head_optimizer: FP32HeadOptimizer | None, weights: dict[str, torch.Tensor],
                    rank_states: list[dict]) -> None:
    """Restore the state `full_weights` and every rank's `checkpoint_state` saved (same world size)."""
    import torch.distributed as dist

    if len(rank_states) != dist.get_world_size():
        raise ValueError(f"train.resume: the checkpoint was written by {len(rank_states)} ranks, this run has "
                         f"{dist.get_world_size()} (resume with the same number of ranks)")
    if engine.zero_optimization_stage() == 0:
        engine.module.load_state_dict(weights)
        engine.optimizer.load_state_dict(rank_states[dist.get_rank()]["optimizer"])
    else:
        if engine.zero_optimization_stage() < 3:
            engine.module.load_state_dict(weights)
        # ZeRO restores each rank's fp32 partition and rebuilds the 16-bit / partitioned weights from it.
        load_zero_optimizer(engine, [s["optimizer"] for s in rank_states])
    own = rank_states[dist.get_rank()]
    engine.lr_scheduler.load_state_dict(own["lr_schedule"])
    if head_optimizer is not None:  # its weight came back with the module's state dict, in fp32
        head_optimizer.load_state_dict(own["fp32_head"])
    restore_engine_counters(engine, own["counters"])
