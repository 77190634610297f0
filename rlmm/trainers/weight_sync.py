"""Sending the trainer's weights to the sampler: the NaN guard and the one-tensor-at-a-time gather.

A sharded trainer hands out weights gathered as they are read (`trainer=fsdp`: `GatheredWeights`;
`trainer=deepspeed` at ZeRO-3: `ZeRO3Weights`): its parameters stay sharded until the sampler reads them,
and each read gathers one full tensor. So the sync's extra peak is the largest
tensor (the embedding or LM head), not a full copy of the model as a gathered state dict would be
(`benchmarks/weight_sync_memory.py` measures both). The guard checks the local shards and agrees over
the ranks, so a NaN stops the run before anything is gathered or sent.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from rlmm.runtime.collectives import all_reduce_min
from rlmm.runtime.errors import NonFiniteWeights


class GatheredWeights(Mapping):
    """Hugging Face-named weights whose values are DTensors sharded over the ranks; reading one gathers
    it (`full_tensor()`: a collective, so every rank must read the same names in the same order, as
    `sampler.load_weights(weights)` and `dict(weights.items())` do on every rank)."""

    def __init__(self, sharded: Mapping[str, torch.Tensor]):
        self.sharded = sharded

    def __getitem__(self, name: str) -> torch.Tensor:
        value = self.sharded[name]
        return value.full_tensor() if hasattr(value, "full_tensor") else value

    def __iter__(self) -> Iterator[str]:
        return iter(self.sharded)

    def __len__(self) -> int:
        return len(self.sharded)

    def local_shards(self) -> list[torch.Tensor]:
        """This rank's pieces (no communication)."""
        return [value.to_local() if hasattr(value, "to_local") else value for value in self.sharded.values()]


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """No NaN/Inf in any tensor. Fast path: one fused 2-norm per tensor (0.8 ms for the built-in model's
    51 tensors, against 7 ms for an element-wise check per tensor: 18% of a default weight sync); a
    non-finite norm (NaN/Inf, or squares past the dtype's range) falls back to the exact element-wise
    check, so huge but finite weights are never called non-finite."""
    tensors = [t for t in tensors if t.numel()]  # a rank's shard of a small tensor may be empty
    if not tensors or torch.stack(torch._foreach_norm(tensors)).isfinite().all():
        return True
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


def weights_finite(weights: Mapping[str, torch.Tensor]) -> bool:
    """Whether every weight is finite on every rank (for weights gathered as they are read, FSDP's
    `GatheredWeights` and DeepSpeed's `ZeRO3Weights`: their `local_shards()`, agreed over the ranks with one
    all-reduce, nothing gathered)."""
    if not hasattr(weights, "local_shards"):
        return all_finite(list(weights.values()))
    shards = weights.local_shards()
    finite = torch.tensor([float(all_finite(shards))], device=shards[0].device if shards else "cpu")
    return bool(all_reduce_min(finite).item())


def send_weights(weights: Mapping[str, torch.Tensor], sampler) -> None:
    """Load `weights` into `sampler` (every rank its own sampler), or raise `NonFiniteWeights` without
    sending anything when one holds NaN/Inf."""
    if not weights_finite(weights):
        raise NonFiniteWeights("the trainer's weights hold NaN/Inf after the update; they were not sent "
                               "to the sampler (resume from the last checkpoint with a lower trainer.lr)")
    sampler.load_weights(weights)
