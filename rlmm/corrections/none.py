"""No correction: PPO with the old log-probs recomputed by the trainer, the sampler's ignored."""
from __future__ import annotations

from rlmm.corrections.base import Anchor, Correction


class NoCorrection(Correction):
    """PPO with recomputed old log-probs; the training-inference mismatch goes uncorrected (``correction=none``).

    old = log pi_train,  w_t = 1,  mask unchanged.

    The classic PPO-with-recompute of most RL frameworks: PPO's ratio is pi_theta / pi_train, so it treats the
    responses as if the trainer had sampled them. Liu et al. 2025 ("When Speed Kills Stability") identify this
    silent assumption as a cause of RL collapse; it is the baseline every other method is compared to. The ratio
    metrics are still logged, so the mismatch this run ignored is visible. `Correction`'s identity in both places.
    """

    old_policy = Anchor.trainer
