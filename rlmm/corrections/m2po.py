"""M2PO: mask the tokens with the largest second moment of the log-ratio until the rest's mean is below tau."""
from __future__ import annotations

import math

import torch

from rlmm.corrections.base import BatchView, Correction, CorrectionOutput, finish, log_ratios, masked_mean


class SecondMomentMask(Correction):
    """M2PO's adaptive mask for stale rollouts (``correction=m2po``).

    old = log pi_train (unchanged),  w = 1,  and with m2_t = (log mu_t - log pi_old,t)^2 = delta_t^2 over the
    batch's N kept tokens sorted so that m2_(1) >= m2_(2) >= ... >= m2_(N):

        k = min { j >= 0 : mean(m2_(j+1), ..., m2_(N)) < tau },   keep_t = [m2_t < m2_(k)]  (all kept when k = 0)

    the fewest largest-m2 tokens whose removal brings the second moment of the rest below tau. A bound that adapts
    to the batch: at a small mismatch nothing is masked, under staleness just the outliers that carry the second
    moment. With no such k (every token's m2 >= tau) all tokens but the smallest-m2 one are masked, as AReaL does.
    Ties at the cut m2_(k) are masked together, so at most a few more than k tokens go.

    Source: Zheng et al. 2025, "Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale Data on LLMs?"
    (M2PO); AReaL's `_apply_m2po_masking` (`areal/engine/ppo/actor.py`, m2 = (behaviour - proximal)^2 on the
    loss mask, sorted descending, `m2_threshold`; its example `gsm8k_m2po.yaml` sets 0.04, the default here).
    Departures: AReaL masks per engine micro-batch and per rank; here the batch stage sees the whole batch, every
    rank's tokens, so the cut is the same at any micro-batching and number of ranks. A mask only: AReaL runs it
    with its decoupled loss, whose behaviour weight pi_prox / mu is rlmm's `mis` (``m2po+mis`` here). NaN m2
    (a NaN log-prob) is masked. Logs ``second_moment`` (before) and ``second_moment_kept`` (after).

    Args:
        threshold: tau, the largest accepted mean of (log mu - log pi_old)^2 over the kept tokens; > 0.
    """

    def __init__(self, threshold: float):
        if not (math.isfinite(threshold) and threshold > 0.0):
            raise ValueError(f"correction.threshold: must be a finite number > 0, got {threshold}")
        self.threshold = float(threshold)

    def before_update(self, batch: BatchView) -> CorrectionOutput:
        delta, m = log_ratios(batch.trainer_logprobs, batch.sampler_logprobs, batch.mask)
        m2 = delta * delta
        finite = m & ~m2.isnan()
        values = m2[finite].sort(descending=True).values  # [N]
        n = values.numel()
        keep = finite
        if n:
            # suffix_mean[j] = mean(values[j:]): the second moment once the j largest are masked (j = 0 .. N-1)
            suffix_mean = values.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, dtype=values.dtype,
                                                                          device=values.device)
            below = (suffix_mean < self.threshold).nonzero()
            if not below.numel():  # no cut brings it below tau: keep only the smallest, as AReaL does
                keep = finite & (m2 <= values[-1])
            elif (k := int(below[0])) > 0:
                keep = finite & (m2 < values[k - 1])
        return finish(old_logprobs=batch.trainer_logprobs, weights=torch.ones_like(delta), keep=keep, delta=delta,
                      mask=m, extra={"second_moment": masked_mean(m2, finite), "second_moment_kept": masked_mean(m2, keep)})
