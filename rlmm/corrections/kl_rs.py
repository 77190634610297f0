"""KL-based rejection sampling."""
from __future__ import annotations

from enum import Enum

import torch

from rlmm.corrections.base import (BatchView, Correction, CorrectionOutput, choice, finish, log_ratios, masked_max,
                                   masked_mean)
from rlmm.mismatch import kl


def _as_is(score: torch.Tensor) -> torch.Tensor:
    return score


class KLEstimator(Enum):
    """kl_rs's ``estimator:``: which of Schulman's estimators (rlmm/mismatch/kl.py) is thresholded, and what of it:
    k2 and k3 are >= 0 and compared as they are; k1 is signed, so its absolute value is compared."""

    # (per-token estimate, what the threshold bounds)
    k1 = (kl.k1, torch.abs)
    k2 = (kl.k2, _as_is)
    k3 = (kl.k3, _as_is)

    def __init__(self, estimate, compared):
        self.estimate, self.compared = estimate, compared


def _per_token(estimate: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return estimate, mask


def _per_sequence(estimate: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # padding is 0 in the estimate; an empty sequence's 0/0 = NaN is never in the mask
    return estimate.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True), mask.any(dim=1, keepdim=True)


class Level(Enum):
    """kl_rs's ``level:``: what the threshold is compared with, ``scores(estimate, mask) -> (score, where it is
    defined)``: each token's estimate ([B, T], rejecting that token), or each sequence's mean over its response
    tokens ([B, 1], rejecting every token of the sequence)."""

    token = (_per_token,)
    sequence = (_per_sequence,)

    def __init__(self, scores):
        self.scores = scores


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
        estimator: one of k1, k2, k3 (`KLEstimator`).
        level: token or sequence (`Level`).
        threshold: largest accepted KL estimate, >= 0.
    """

    def __init__(self, estimator: KLEstimator, level: Level, threshold: float):
        self.estimator = choice(KLEstimator, estimator, "estimator")
        self.level = choice(Level, level, "level")
        if not threshold >= 0.0:
            raise ValueError(f"correction.threshold: must be >= 0, got {threshold}")
        self.threshold = float(threshold)

    def before_update(self, batch: BatchView) -> CorrectionOutput:
        delta, m = log_ratios(batch.trainer_logprobs, batch.sampler_logprobs, batch.mask)
        estimate = self.estimator.estimate(delta)
        score, scored = self.level.scores(estimate, m)
        score = self.estimator.compared(score)
        keep = score <= self.threshold  # a NaN score fails <=: rejected
        return finish(old_logprobs=batch.trainer_logprobs, weights=torch.ones_like(delta), keep=keep, delta=delta, mask=m,
                      extra={"kl_mean": masked_mean(estimate, m), "kl_max": masked_max(score, scored)})
