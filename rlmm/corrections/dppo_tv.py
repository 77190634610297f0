"""DPPO's binary TV trust region anchored on the trainer's recomputation (verl's ``dppo_tv`` in decoupled mode)."""
from __future__ import annotations

import torch

from rlmm.corrections.base import Anchor, Correction, InUpdate, MicroBatchView
from rlmm.corrections.tv_trust import tv_region


class ProximalTVTrustRegion(Correction):
    """Binary TV trust region around the recomputed pi_old, inside the update (``correction=dppo_tv``).

    PPO's pi_old the trainer's (as `none`), weight 1, and in each micro-batch, with d_t = pi_theta(y_t) - pi_old(y_t)
    a difference of probabilities:

        drop t  if  A_t > 0 and d_t > eps,  or  A_t <= 0 and d_t < -eps,

    `tv_trust`'s mask with the trainer's recomputation as its anchor instead of the sampler's mu: the trust region
    bounds the update's own move, and the mismatch mu -> pi_old is left to a batch stage's weight (``tis+dppo_tv``:
    verl's decoupled mode, its ``rollout_is`` weight pi_old / mu times the loss). No penalty.

    Source: verl's ``compute_policy_loss_dppo_tv`` (`verl/trainer/ppo/core_algos.py`, ``policy_loss.loss_mode:
    dppo_tv``; "Rethinking the Trust Region in LLM Reinforcement Learning", arXiv 2602.04879):
    valid_t = [p_theta - p_old <= clip_ratio_high] if A_t > 0 else [p_theta - p_old >= -clip_ratio_low], loss
    -A_t * sg(min(r_t, clip_ratio_c)) * log pi_theta * valid_t, r_t = exp(clamp(log pi_theta - log pi_old, -20, 20)),
    token-mean over the response mask (dropped tokens stay in the divisor, as here). Its old policy is pi_old in
    decoupled mode (this class) and mu in bypass mode (``tv_trust`` with ``kl_coef: 0``). verl's objective is CISPO's
    weight with the range [0, c]: ``correction=dppo_tv algo=cispo algo.objective.clip_low=1
    algo.objective.clip_high=2`` is verl's loss at its ActorConfig default c = 3 (``clip_ratio_c``; its DPPO example
    sets 10000: ``algo.objective.clip_high=9999``). eps is verl's ActorConfig ``clip_ratio`` 0.2 (its DPPO example: 0.15); verl's two sides (``clip_ratio_low`` /
    ``_high``) are one eps here. Departures: verl clamps the log-ratio to [-20, 20] before exp, which moves the
    weight only where log r < -20 (e^-20 = 2.1e-9 there, less here) and its ``ppo_kl`` there; verl's probabilities
    are in the input dtype, here float64. Logs, summed over the step's micro-batches: ``frac_tokens_dropped``
    (verl's ``pg_clipfrac``), ``frac_dropped_high`` (A > 0, d > eps) and ``frac_dropped_low`` (A <= 0, d < -eps).

    Args:
        eps: the largest probability move from pi_old in the advantage's direction; in (0, 1).
    """

    old_policy = Anchor.trainer

    def __init__(self, eps: float):
        if not 0.0 < eps < 1.0:
            raise ValueError(f"correction.eps: must be in (0, 1), got {eps}")
        self.eps = float(eps)

    def in_update(self, micro: MicroBatchView) -> InUpdate:
        return tv_region(micro, micro.trainer_logprobs.to(torch.float64), self.eps, penalty=None)
