"""The reductions over ranks that rlmm makes itself, in one place.

DeepSpeed and FSDP reduce their own gradients; rlmm adds only these few: the torch backend's gradient mean
(`average_over_ranks`), the stop, fault and refill flags (`any_rank`), the loss normaliser
(rlmm/run/step.py), the micro-batch count under a token budget (rlmm/trainers/packing.py), the weight sync's
NaN guard (rlmm/trainers/weight_sync.py), and the step's whole batch for its mismatch and correction metrics
(`rows_of_every_rank`) and its loss statistics (`gathered_over_ranks`, rlmm/mismatch/loss_stats.py).

Each `all_reduce_*` takes a tensor and returns it reduced over the ranks: in place, as torch.distributed
does, so the tensor returned is the one passed in. Without a process group, or with one rank, it is returned
as it is, so a caller needs no case of its own for one process. Every rank must call the same reductions
in the same order (they are collectives). The flags and the normaliser are CPU tensors: on GPUs the
default group carries them over gloo (rlmm/runtime/devices.py).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["all_reduce_max", "all_reduce_mean", "all_reduce_min", "any_rank", "average_over_ranks", "divisor_over_ranks",
           "gathered_over_ranks", "mean_over_ranks", "rows_of_every_rank"]


def _several_ranks() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, element-wise the largest over the ranks."""
    if _several_ranks():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def all_reduce_min(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, element-wise the smallest over the ranks."""
    if _several_ranks():
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return tensor


def all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, element-wise the mean over the ranks: summed, then divided by their number in its own dtype
    (what DDP does to a gradient)."""
    if _several_ranks():
        dist.all_reduce(tensor)
        tensor.div_(dist.get_world_size())
    return tensor


def any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is true on any (a stop signal may reach only some ranks; a fault or a short
    batch on one rank must change the path of all)."""
    return bool(all_reduce_max(torch.tensor([float(flag)])).item())


def average_over_ranks(gradients: list[torch.Tensor]) -> None:
    """Data parallelism as DDP and DeepSpeed do it: every rank ends the backward pass holding the mean of
    all ranks' gradients, so the replicas take the same step (a NaN on one rank reaches all, and every
    rank skips that step). One all-reduce per tensor: no extra buffer the size of the model."""
    for gradient in gradients:
        all_reduce_mean(gradient)


def mean_over_ranks(metrics: dict[str, float]) -> dict[str, float]:
    """Average every metric over the ranks (one all-reduce, in float64); the identity with one rank."""
    if not _several_ranks():
        return metrics
    keys = sorted(metrics)
    values = all_reduce_mean(torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64))
    return dict(zip(keys, values.tolist()))


def divisor_over_ranks(local: float) -> float:
    """The loss divisor every rank uses for its share of a minibatch, so that the ranks' gradients, averaged
    by the trainer, are the gradient of the whole minibatch's loss: the mean over ranks of each rank's own
    divisor. Token-level: each rank divides by (all ranks' kept tokens) / ranks, not by its own count,
    which would weight a token of a rank with short responses more than one of a rank with long ones."""
    return mean_over_ranks({"divisor": local})["divisor"]


def gathered_over_ranks(value: object) -> list:
    """Every rank's `value` (a picklable object), in rank order; [value] with one rank."""
    if not _several_ranks():
        return [value]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def rows_of_every_rank(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each [B_r, T_r] tensor (this rank's rows, right-padded) with every rank's rows: [Σ B_r, max T_r], rank 0's
    rows first, each rank's padded with zeros (False for a bool mask) to the longest width, on every rank; the
    tensors as they are with one rank. All of them must have this rank's shape.

    For the metrics of the step's whole batch: a maximum, a standard deviation or a token mean over several
    ranks is not the mean of the ranks' own (`mean_over_ranks`): the mean of 8 ranks' largest |δ| is well
    below the largest, and ranks with unequal token counts weight their tokens unequally."""
    if not _several_ranks():
        return tensors
    rows, width = tensors[0].shape
    if any(tensor.shape != (rows, width) for tensor in tensors):
        raise ValueError(f"rows_of_every_rank: shapes {[tuple(t.shape) for t in tensors]} differ")
    world = dist.get_world_size()
    shapes = torch.tensor([rows, width], dtype=torch.int64)
    every_shape = [torch.zeros_like(shapes) for _ in range(world)]
    dist.all_gather(every_shape, shapes)
    most_rows, most_width = (max(int(s[i]) for s in every_shape) for i in (0, 1))
    out = []
    for tensor in tensors:
        sent = tensor.detach().cpu()
        sent = sent.to(torch.uint8) if sent.dtype == torch.bool else sent  # gloo has no bool
        padded = sent.new_zeros(most_rows, most_width)
        padded[:rows, :width] = sent
        gathered = [torch.zeros_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded)
        whole = torch.cat([g[:int(s[0])] for g, s in zip(gathered, every_shape)])
        out.append((whole.bool() if tensor.dtype == torch.bool else whole).to(tensor.device))
    return tuple(out)


def own_rows(rows: int, width: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function that cuts this rank's [rows, width] part out of a tensor of every rank's rows
    (`rows_of_every_rank`: rank 0's rows first, padded to the longest width); the identity with one rank. A
    collective (every rank calls it, once, with its own shape)."""
    if not _several_ranks():
        return lambda whole: whole
    start = sum(gathered_over_ranks(rows)[:dist.get_rank()])
    return lambda whole: whole[start:start + rows, :width]
