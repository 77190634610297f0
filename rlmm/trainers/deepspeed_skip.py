"""Skipping a bad step on `trainer=deepspeed`, and telling a fault from the loss scaler's normal business.

A non-finite gradient skips the optimizer step (DeepSpeed's `skipped_steps` + 1, the LR warm-up held back).
In fp16/bf16 DeepSpeed's optimizers check for it and skip by themselves. Plain fp32 AdamW has no such
check, and a non-finite fp32 head (its fp32 gradient never overflows from the scale) must stop the body
too: there rlmm skips the step itself (`BadStep.skip`), a fault. metrics["skipped"] = 1 for a fault; an
fp16 overflow at a scale above `fp16.min_loss_scale` is the loss scaler's normal business,
metrics["loss_scale_skipped"] = 1 (rlmm/trainers/loss_scale.py). The reaches into the engine (a replaced
`optimizer.step`, a rewound scheduler) are `deepspeed_internals.step_without_optimizer` and
`book_skipped_step`.
"""
from __future__ import annotations

import math

from rlmm.trainers.deepspeed_internals import book_skipped_step, step_without_optimizer
from rlmm.trainers.loss_scale import skip_metrics


class BadStep:
    """One optimizer step's skip bookkeeping. `lr`: the rate this step uses (the schedule advances inside
    `engine.step`); `loss_scaled`: an fp16/bf16 optimizer that skips a non-finite step by itself."""

    def __init__(self, engine, lr: float, loss_scaled: bool):
        self.engine, self.lr, self.loss_scaled = engine, lr, loss_scaled
        self.fault = False  # rlmm skipped the step itself (a non-finite fp32 gradient or fp32 head)
        self.booked = False  # ... and the engine counted that skip itself (`step_without_optimizer`)
        self.skipped_before = engine.skipped_steps

    def is_fault(self, head_finite: bool, own_norm: float | None) -> bool:
        """Whether rlmm must skip this step: a non-finite fp32 head, or a non-finite body gradient that no
        loss-scaled optimizer will catch (`own_norm`: the body's norm where rlmm takes it, else None)."""
        own_finite = own_norm is None or math.isfinite(own_norm)
        return not head_finite or (not own_finite and not self.loss_scaled)

    def skip(self) -> None:
        """Finish the step without the optimizer stepping (instead of `engine.step()` at the boundary)."""
        self.fault = True
        self.booked = step_without_optimizer(self.engine)

    def settle(self) -> bool:
        """After the boundary's step: book a skip the engine did not count; True when the step was skipped
        (by rlmm, or by DeepSpeed's optimizer on an overflow)."""
        if self.fault and not self.booked:  # a plain optimizer: the engine counted a step it did not take
            book_skipped_step(self.engine, self.lr)
        return self.engine.skipped_steps > self.skipped_before

    def metrics(self, skipped: bool, loss_scale: float | None, min_loss_scale: float) -> dict[str, float]:
        """`skipped` and, with fp16 loss scaling, `loss_scale_skipped` (module docstring)."""
        if self.fault:  # rlmm's own skip (fp32, or the fp32 head): a fault, never an overflow of the scale
            return {"skipped": 1.0, **({"loss_scale_skipped": 0.0} if loss_scale is not None else {})}
        return skip_metrics(skipped, loss_scale, min_loss_scale)
