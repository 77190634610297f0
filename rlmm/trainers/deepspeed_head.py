"""The fp32 LM head's own optimizer beside DeepSpeed's (precision `*_fp32head` on `trainer=deepspeed`).

DeepSpeed casts the whole module to 16 bits and its optimizer keeps one dtype per group, so an fp32 head
stays out of it: its fp32 weight, gradient and AdamW moments are rlmm's. Its gradient is averaged over the
ranks once, in fp32, by rlmm (DeepSpeed's own ZeRO-0 reduction leaves it out:
`deepspeed_internals.keep_out_of_zero0_reduction`), fp16 loss scaling is undone, it is clipped to
`grad_clip` by the head's own norm, and it steps with the body (and skips with it). docs/precision.md.
"""
from __future__ import annotations

import math

import torch

from rlmm.runtime.collectives import average_over_ranks
from rlmm.trainers.optim import linear_warmup


class FP32HeadOptimizer:
    """torch AdamW on the fp32 head weight, the trainers' linear warm-up (module docstring)."""

    def __init__(self, param: torch.nn.Parameter, lr: float, weight_decay: float, warmup_steps: int,
                 grad_clip: float):
        self.param = param
        self.optimizer = torch.optim.AdamW([param], lr=lr, weight_decay=weight_decay)
        self.schedule = linear_warmup(self.optimizer, warmup_steps)
        self.grad_clip = grad_clip
        self.norm = 0.0

    def reduce(self, loss_scale: float | None) -> bool:
        """At the accumulation boundary, before DeepSpeed steps: average, unscale; True when finite."""
        grad = self.param.grad
        if grad is None:
            self.norm = 0.0
            return True
        average_over_ranks([grad])
        if loss_scale:
            grad.div_(loss_scale)
        self.norm = torch.linalg.vector_norm(grad).item()
        return math.isfinite(self.norm)

    def step(self, skip: bool) -> None:
        """Step with the body, or skip with it; the gradient is cleared either way."""
        if not skip and self.param.grad is not None:
            if self.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_([self.param], self.grad_clip)
            self.optimizer.step()
            self.schedule.step()
        self.param.grad = None

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "schedule": self.schedule.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
