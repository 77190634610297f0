"""fp16 dynamic loss scaling: which skipped steps are the scaler's normal business, and which are faults.

fp16's smallest normal is 6.1e-5, so the loss is multiplied by a scale S before the backward pass and the
gradient divided by S before the step (Micikevicius et al. 2018, "Mixed Precision Training"). S starts
large (2^16: `trainer.initial_loss_scale`); a gradient that overflows fp16 at that scale makes the scaler
skip the step and halve S, and after `trainer.loss_scale_growth_interval` clean steps S doubles. So the
first steps of an fp16 run, and an occasional step later, are skipped by design: they are not faults.

The rule every backend applies (torch and FSDP: `torch.amp.GradScaler`; DeepSpeed: its fp16 optimizers):
a non-finite gradient at a scale S_used is a normal overflow when S_used > S_min, and a fault when
S_used <= S_min. S_min is DeepSpeed's `fp16.min_loss_scale` (default 1, `MIN_LOSS_SCALE`): at S = 1 the
scaled gradient is the gradient itself, so lowering S no further helps fp16 represent it, and an
overflow there is a real non-finite gradient (DeepSpeed's ZeRO loss scaler raises at that point; rlmm
turns that off and reports a fault instead, so every backend ends the run through `train.max_bad_steps`).
A real NaN at a scale with headroom is taken for an overflow until S reaches S_min: at most
log2(S_0 / S_min) steps (16 from 2^16), then it is a fault. Without loss scaling (fp32, bf16) every
non-finite gradient is a fault.

`grad_scaler_step` is the torch and FSDP trainers' optimizer step under that rule (DeepSpeed's optimizers step
themselves: rlmm/trainers/deepspeed_backend.py).
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

from rlmm.trainers.optim import scaled_lr

# DeepSpeed's default `fp16.min_loss_scale`; the torch and FSDP trainers keep GradScaler's scale at it too.
MIN_LOSS_SCALE = 1.0


def skip_metrics(skipped: bool, loss_scale: float | None, min_loss_scale: float) -> dict[str, float]:
    """A step's `skipped` (a fault) and, with loss scaling, `loss_scale_skipped` (a normal overflow), from
    whether it was skipped and the scale its backward used (None: no loss scaling)."""
    if loss_scale is None:
        return {"skipped": float(skipped)}
    normal = skipped and loss_scale > min_loss_scale
    return {"skipped": float(skipped and not normal), "loss_scale_skipped": float(normal)}


def grad_scaler(device: torch.device, dtype: torch.dtype, initial_loss_scale: float,
                growth_interval: int) -> torch.amp.GradScaler:
    """The torch and FSDP trainers' loss scaler: dynamic from `initial_loss_scale` in fp16, a no-op otherwise
    (`enabled=False`: `scale` returns the loss, `step` steps)."""
    if dtype == torch.float16 and not (initial_loss_scale > 0 and growth_interval >= 1):
        raise ValueError(f"trainer.initial_loss_scale must be > 0 and trainer.loss_scale_growth_interval >= 1, "
                         f"got {initial_loss_scale} and {growth_interval}")
    return torch.amp.GradScaler(device.type, init_scale=initial_loss_scale, growth_interval=growth_interval,
                                enabled=dtype == torch.float16)


def grad_scaler_step(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, lr_schedule,
                     parameters: Iterable[torch.Tensor], grad_clip: float, lr_scale: float,
                     apply_step: Callable[[], None]) -> dict[str, float]:
    """One optimizer step of the torch and FSDP trainers, once the minibatch's gradients are on `parameters` (what
    `optimizer` steps, averaged over the ranks): unscale them, clip their global norm to `grad_clip` (0: off), and
    unless the norm is non-finite `apply_step()` (the optimizer's step, and whatever the backend does with it) at
    the schedule's rate x `lr_scale`, then advance the schedule. A non-finite norm (an fp16 overflow, a NaN) skips
    the step: weights, AdamW's moments and the schedule stay as they were. Then the scaler's update (fp16: halve
    the scale after an overflow, double it after growth_interval clean steps), floored at `MIN_LOSS_SCALE`.

    Returns the metrics `MicroBatchedUpdate.step` names: grad_norm, lr, `skip_metrics`' and, with loss
    scaling, loss_scale (the scale this step's backward used)."""
    metrics = {}
    loss_scale = scaler.get_scale() if scaler.is_enabled() else None  # the scale this step's backward used
    if loss_scale is not None:
        metrics["loss_scale"] = loss_scale
    scaler.unscale_(optimizer)
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    metrics["grad_norm"] = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()  # FSDP: a DTensor
    metrics["lr"] = lr_schedule.get_last_lr()[0] * lr_scale
    nonfinite = not math.isfinite(metrics["grad_norm"])
    metrics.update(skip_metrics(nonfinite, loss_scale, MIN_LOSS_SCALE))
    if not nonfinite:  # a NaN/Inf gradient never reaches the weights or AdamW's moments
        with scaled_lr(optimizer.param_groups, lr_scale):  # a correction's factor, this step only
            apply_step()
        lr_schedule.step()
    scaler.update()
    if loss_scale is not None and scaler.get_scale() < MIN_LOSS_SCALE:
        scaler.update(MIN_LOSS_SCALE)  # DeepSpeed's floor: an overflow there is a fault, not a lower scale
    optimizer.zero_grad(set_to_none=True)
    return metrics
