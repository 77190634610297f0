"""Token-level masked importance sampling: IcePop and token-MIS."""
from __future__ import annotations

import math

import torch

from rlmm.corrections.base import Anchor, BatchView, Correction, CorrectionOutput, finish, log_ratios


class TokenMask(Correction):
    """Drop the tokens whose ratio leaves [low, high] (``correction=icepop``, ``mis``, ``token_rs``).

    old = log pi_train,  keep_t = [low <= r_t <= high],  w_t = r_t if reweight else 1 on kept tokens,
    and 0 (with mask False) on dropped ones.

    Sources: IcePop (Ling Team 2025, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale
    Thinking Model", Ring-1T) multiplies each token's PPO term by M(r_t; alpha, beta) = r_t on [alpha, beta]
    and 0 outside, with alpha = 0.5, beta = 5 (``icepop.yaml``). Token-level masked IS (token-MIS, Liu et al.
    2025, "When Speed Kills Stability") is the one-sided case r_t * [r_t <= C] (``mis.yaml``: low 0, high C).
    Both keep the importance weight r_t on the tokens they accept: unlike TIS, an outlier token is not
    down-weighted to C but removed. ``reweight: false`` gives pure token rejection with weight 1 (verl's
    ``rollout_rs="token"`` without ``rollout_is``), which trades the importance weight's variance for bias.
    A NaN ratio (a NaN log-prob on a response token) is outside every interval, so that token is dropped.

    Args:
        low: alpha, the smallest accepted ratio; in [0, 1] so that r = 1 (no mismatch) is always kept.
        high: beta, the largest accepted ratio; finite and >= 1.
        reweight: weight kept tokens by r_t (IcePop, token-MIS) instead of 1.
    """

    @property
    def old_policy(self):  # the weight r_t assumes pi_old = pi_train; as a pure mask it assumes nothing
        return Anchor.trainer if self.reweight else None

    @property
    def importance_weighted(self) -> bool:
        return self.reweight

    def __init__(self, low: float, high: float, reweight: bool):
        if not 0.0 <= low <= 1.0:
            raise ValueError(f"correction.low: must be in [0, 1], got {low}")
        if not (math.isfinite(high) and high >= 1.0):
            raise ValueError(f"correction.high: must be a finite number >= 1, got {high}")
        self.low, self.high, self.reweight = float(low), float(high), bool(reweight)

    def before_update(self, batch: BatchView) -> CorrectionOutput:
        delta, m = log_ratios(batch.trainer_logprobs, batch.sampler_logprobs, batch.mask)
        r = delta.exp()
        keep = (r >= self.low) & (r <= self.high)
        weights = r if self.reweight else torch.ones_like(r)
        return finish(old_logprobs=batch.trainer_logprobs, weights=weights, keep=keep, delta=delta, mask=m)
