"""Geometric-mean rejection sampling (Geo-RS)."""
from __future__ import annotations

import math

import torch

from rlmm.corrections.base import BatchView, Correction, CorrectionOutput, finish, log_ratios, masked_max, masked_min


class GeometricRejection(Correction):
    """Reject sequences whose geometric-mean ratio leaves [low, high] (``correction=geo_rs``).

    old = log pi_train,  g_i = exp(S_i / |y_i|),  keep_i = [low <= g_i <= high],  w_t = 1 on kept sequences,
    and 0 (with mask False) on every token of a rejected one.

    Liu et al. 2025, "When Speed Kills Stability" (part 3, geometric-level RS; verl ``rollout_rs="geometric"``):
    the product of token ratios grows with length, so a fixed threshold on it rejects long responses more often
    (the "length trap"); the per-token geometric mean does not. g_i is an average, so the bounds are tight
    (verl suggests 1.0001 to 1.001 on the upper side): a log-ratio of 1e-3 per token is already a large
    systematic mismatch. Pure rejection, no importance weight, as in the source. A NaN g_i is rejected. Logs
    ``geo_ratio_min`` / ``geo_ratio_max`` over non-empty sequences, to place the bounds.

    Args:
        low: smallest accepted g_i, in (0, 1].
        high: largest accepted g_i, finite and >= 1.
    """

    def __init__(self, low: float, high: float):
        if not 0.0 < low <= 1.0:
            raise ValueError(f"correction.low: must be in (0, 1], got {low}")
        if not (math.isfinite(high) and high >= 1.0):
            raise ValueError(f"correction.high: must be a finite number >= 1, got {high}")
        self.low, self.high = float(low), float(high)

    def before_update(self, batch: BatchView) -> CorrectionOutput:
        delta, m = log_ratios(batch.trainer_logprobs, batch.sampler_logprobs, batch.mask)
        nonempty = m.any(dim=1)
        geo = (delta.sum(dim=1) / m.sum(dim=1).clamp(min=1)).exp()  # [B]; empty sequences: exp(0) = 1
        keep = (geo >= self.low) & (geo <= self.high)
        return finish(old_logprobs=batch.trainer_logprobs, weights=torch.ones_like(delta), keep=keep.unsqueeze(1),
                      delta=delta, mask=m,
                      extra={"geo_ratio_min": masked_min(geo, nonempty), "geo_ratio_max": masked_max(geo, nonempty)})
