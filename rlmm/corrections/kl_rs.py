"""KL-based rejection sampling."""
from __future__ import annotations


import torch

from rlmm.corrections.base import BatchView, Correction, CorrectionOutput, finish, log_ratios, masked_max, masked_mean
from rlmm.mismatch.kl import ESTIMATORS, kl_estimate
LEVELS = ("token", "sequence")


class KLRejection(Correction):
    """Reject tokens or sequences whose estimated sampler-to-trainer KL exceeds a threshold (``correction=kl_rs``).

    Per token, Schulman's (2020, "Approximating KL Divergence") estimators of KL(pi_sampler || pi_train) from
    sampler draws (rlmm/mismatch/kl.py), with delta = log pi_train - log pi_sampler and r = exp(delta):

        k1 = -delta,    k2 = delta^2 / 2,    k3 = r - 1 - delta  (computed as expm1(delta) - delta).

    ``level: token`` rejects token t when k_t > threshold; ``level: sequence`` rejects every token of sequence i
    when the mean of k_t over its response tokens exceeds the threshold. k2 and k3 are >= 0; k1 is unbiased but
    signed (a trainer *more* confident than the sampler gives k1 < 0), so for k1 the test is on the absolute
    value, |k1_t| > threshold or |mean_t k1_t| > threshold: the sequence mean is taken first, so opposite-signed
    tokens cancel as they do in the KL estimate. Kept tokens have weight 1 (pure rejection); old = log pi_train.

    This is rlmm's own variant, in the spirit of the rejection sampling of Liu et al. 2025 ("When Speed Kills
    Stability"), which thresholds ratios rather than KL. At the sequence level k1 is |S_i| / |y_i|, the absolute
    log of the geometric-mean ratio, so ``k1, sequence, tau`` is ``geo_rs`` with bounds [exp(-tau), exp(tau)];
    k2 and k3 average a squared log-ratio (k3 = delta^2 / 2 + O(delta^3)), so token errors of opposite sign do
    not cancel and a sequence with large but balanced noise is rejected too. A NaN estimate is rejected. Logs
    ``kl_mean`` (token mean of the chosen estimator) and ``kl_max`` (the largest value compared against the
    threshold: per token or per sequence, absolute for k1).

    Args:
        estimator: one of k1, k2, k3.
        level: token or sequence.
        threshold: largest accepted KL estimate, >= 0.
    """

    def __init__(self, estimator: str, level: str, threshold: float):
        if estimator not in ESTIMATORS:
            raise ValueError(f"correction.estimator: must be one of {', '.join(ESTIMATORS)}, got '{estimator}'")
        if level not in LEVELS:
            raise ValueError(f"correction.level: must be one of {', '.join(LEVELS)}, got '{level}'")
        if not threshold >= 0.0:
            raise ValueError(f"correction.threshold: must be >= 0, got {threshold}")
        self.estimator, self.level, self.threshold = estimator, level, float(threshold)

    def before_update(self, batch: BatchView) -> CorrectionOutput:
        delta, m = log_ratios(batch.trainer_logprobs, batch.sampler_logprobs, batch.mask)
        kl = kl_estimate(delta, self.estimator)
        if self.level == "token":
            score, scored = kl, m
        else:
            score, scored = kl.sum(dim=1, keepdim=True) / m.sum(dim=1, keepdim=True), m.any(dim=1, keepdim=True)
        if self.estimator == "k1":
            score = score.abs()
        keep = score <= self.threshold  # padding is 0 in kl; an empty sequence's 0/0 = NaN is never in the mask
        return finish(old_logprobs=batch.trainer_logprobs, weights=torch.ones_like(delta), keep=keep, delta=delta, mask=m,
                      extra={"kl_mean": masked_mean(kl, m), "kl_max": masked_max(score, scored)})
