"""No correction: PPO with the old log-probs recomputed by the trainer, the sampler's ignored."""
from __future__ import annotations

import torch

from rlmm.corrections.base import CorrectionOutput, finish, log_ratios


class NoCorrection:
    """PPO with recomputed old log-probs; the training-inference mismatch goes uncorrected (``correction=none``).

    old = log pi_train,  w_t = 1,  mask unchanged.

    The classic PPO-with-recompute of most RL frameworks: PPO's ratio is pi_theta / pi_train, so it treats the
    responses as if the trainer had sampled them. Liu et al. 2025 ("When Speed Kills Stability") identify this
    silent assumption as a cause of RL collapse; it is the baseline every other method is compared to. The ratio
    metrics are still logged, so the mismatch this run ignored is visible.
    """

    def __call__(self, train_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                 mask: torch.Tensor) -> CorrectionOutput:
        delta, m = log_ratios(train_logprobs, sampler_logprobs, mask)
        return finish(old_logprobs=train_logprobs, weights=torch.ones_like(delta), keep=m, delta=delta, mask=m)
