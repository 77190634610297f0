"""Schulman's KL estimators (2020, "Approximating KL Divergence"), the one home of k1, k2 and k3.

For x drawn from p and the log-ratio log_ratio = log q(x) - log p(x), r = q(x) / p(x), each estimates
KL(p || q) = E_p[-log r] from one draw:

    k1 = -log r                     unbiased, signed, high variance
    k2 = (log r)^2 / 2              biased, >= 0, low variance (KL up to O(log r ^ 3))
    k3 = (r - 1) - log r            unbiased, >= 0, low variance; computed as expm1(log r) - log r, which
                                    keeps r - 1 accurate when log r ~ 1e-8 (the bf16-vs-fp32 gap)

Used by the algorithms' KL penalty (p = pi_theta, q = pi_ref: rlmm/algos/surrogate.py) and `approx_kl`
(k3 of pi_old vs pi_theta), the `kl_rs` correction (p = the sampler, q = the trainer) and the mismatch
metrics (rlmm/mismatch/metrics.py: kl_k1, kl_k2, kl_k3). Exact: nothing is clamped (verl clamps its k3 penalty to
[-10, 10]; docs/algorithms.md).
"""
from __future__ import annotations

import torch

__all__ = ["ESTIMATORS", "k1", "k2", "k3", "kl_estimate"]

ESTIMATORS = ("k1", "k2", "k3")


def k1(log_ratio: torch.Tensor) -> torch.Tensor:
    """-log r."""
    return -log_ratio


def k2(log_ratio: torch.Tensor) -> torch.Tensor:
    """(log r)^2 / 2."""
    return log_ratio * log_ratio / 2


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """r - 1 - log r, as expm1(log r) - log r."""
    return torch.expm1(log_ratio) - log_ratio


def kl_estimate(log_ratio: torch.Tensor, estimator: str) -> torch.Tensor:
    """The estimator named `estimator` ("k1", "k2" or "k3") of each element of `log_ratio`."""
    return {"k1": k1, "k2": k2, "k3": k3}[estimator](log_ratio)
