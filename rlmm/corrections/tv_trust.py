"""DPPO's binary total-variation trust region: drop the tokens whose probability moved too far from the sampler's."""
from __future__ import annotations

import functools
import math

import torch

from rlmm.corrections.base import (Anchor, BatchView, Correction, CorrectionOutput, InUpdate, MicroBatchView, finish,
                                   log_ratios)


class TVTrustRegion(Correction):
    """Binary TV trust region around the sampler, inside the update (``correction=tv_trust``).

    PPO's pi_old := mu (the sampler's log-probs: no recomputed pi_old is the anchor), weight 1, and in each
    micro-batch, with d_t = pi_theta(y_t) - mu(y_t) a difference of probabilities (not a ratio):

        drop t  if  A_t > 0 and d_t > eps,  or  A_t <= 0 and d_t < -eps,

    so a token stops pushing its probability further in the direction its advantage pushes once it has moved eps
    away from the sampler's, and a penalty  kl_coef * (log pi_theta(y_t) - log mu(y_t))^2  on every token the stage
    was given (the response's tokens when it stands alone: prime-rl's loss mask), the ones it drops included (it
    pulls them back), is added to the loss, summed over tokens and divided by the loss's normaliser. A probability
    difference bounds the total variation a token can add, where a ratio bound lets low-probability tokens move
    freely and freezes high-probability ones.

    Sources: prime-rl's default loss, DPPO's binary-TV variant (`src/prime_rl/trainer/rl/loss.py`,
    `default_loss_fn`: `dppo_mask_low` = `dppo_mask_high` = 0.2, the (log r)^2 term with `kl_tau` 1e-3, masked
    tokens kept in the normaliser); SkyRL's `dppo_policy_loss` (`dppo_type: binary_tv`, 0.2, no penalty: kl_coef 0);
    ROLL's probability-difference train-infer filter (on pi_old, not conditioned on the advantage). Departure: prime-rl's loss is A * pi_theta / mu with no ratio clip;
    here the algorithm's clipped surrogate still applies to pi_theta / mu. For prime-rl's loss exactly, lift the
    clip: ``correction=tv_trust algo.objective.clip_low=1 algo.objective.clip_high=inf``. Logs, summed over the step's
    micro-batches:
    ``frac_tokens_dropped``, ``frac_dropped_high`` (A > 0, d > eps) and ``frac_dropped_low`` (A <= 0, d < -eps).

    Args:
        eps: the largest probability move in the advantage's direction; in (0, 1).
        kl_coef: weight of the (log pi_theta - log mu)^2 penalty; >= 0 (0 turns it off).
    """

    old_policy = Anchor.sampler

    def __init__(self, eps: float, kl_coef: float):
        if not 0.0 < eps < 1.0:
            raise ValueError(f"correction.eps: must be in (0, 1), got {eps}")
        if not (math.isfinite(kl_coef) and kl_coef >= 0.0):
            raise ValueError(f"correction.kl_coef: must be a finite number >= 0, got {kl_coef}")
        self.eps, self.kl_coef = float(eps), float(kl_coef)

    def before_update(self, batch: BatchView) -> CorrectionOutput:
        delta, m = log_ratios(batch.trainer_logprobs, batch.sampler_logprobs, batch.mask)
        return finish(old_logprobs=batch.sampler_logprobs, weights=torch.ones_like(delta), keep=m, delta=delta, mask=m)

    def in_update(self, micro: MicroBatchView) -> InUpdate:
        penalty = functools.partial(squared_log_ratio, micro.sampler_logprobs, micro.mask, self.kl_coef) \
            if self.kl_coef else None
        return tv_region(micro, micro.sampler_logprobs, self.eps, penalty)


def tv_region(micro: MicroBatchView, anchor: torch.Tensor, eps: float, penalty) -> InUpdate:
    """DPPO's binary TV mask around `anchor` (log-probs: mu for tv_trust, pi_old for dppo_tv): drop t if A_t > 0 and
    pi_theta - p_anchor > eps, or A_t <= 0 and pi_theta - p_anchor < -eps (probabilities, float64), with the counts
    both classes log."""
    m = micro.mask
    moved = torch.where(m, micro.logprobs.detach().to(torch.float64).exp() - anchor.to(torch.float64).exp(), 0.0)
    positive = micro.advantages > 0
    high = m & positive & (moved > eps)
    low = m & ~positive & (moved < -eps)
    tokens = float(m.sum())
    return InUpdate(weights=torch.ones_like(micro.weights), mask=m & ~(high | low), penalty=penalty, counts={
        "frac_tokens_dropped": (float((high | low).sum()), tokens),
        "frac_dropped_high": (float(high.sum()), tokens), "frac_dropped_low": (float(low.sum()), tokens)})


def squared_log_ratio(anchor: torch.Tensor, mask: torch.Tensor, coef: float, logprobs: torch.Tensor) -> torch.Tensor:
    """coef * (log pi_theta - anchor)^2 on `mask`, 0 elsewhere (differentiable in `logprobs`)."""
    diff = torch.where(mask, logprobs - anchor.to(logprobs.dtype), torch.zeros((), dtype=logprobs.dtype,
                                                                                device=logprobs.device))
    return coef * diff * diff
