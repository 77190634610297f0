"""Bypass: the sampler is PPO's old policy."""
from __future__ import annotations

import torch

from rlmm.corrections.base import Anchor, BatchView, Correction, CorrectionOutput, finish, log_ratios


class Bypass(Correction):
    """Use the sampler's log-probs as PPO's old policy (``correction=bypass``).

    old = log pi_sampler,  w_t = 1,  mask unchanged.

    PPO's ratio becomes pi_theta / pi_sampler: the behaviour policy that really drew the tokens, so the mismatch
    is absorbed into the ratio and bounded by PPO's clip (verl's "bypass mode", Liu et al. 2025; slime's
    ``--use-rollout-logprobs``). The trainer's log-probs only feed the metrics here. Compared with decoupled
    PPO (Hilton et al. 2021), the behaviour and proximal policies are one, so the mismatch and the policy drift
    share one clip range.
    """

    old_policy = Anchor.sampler

    def before_update(self, batch: BatchView) -> CorrectionOutput:
        delta, m = log_ratios(batch.trainer_logprobs, batch.sampler_logprobs, batch.mask)
        return finish(old_logprobs=batch.sampler_logprobs, weights=torch.ones_like(delta), keep=m, delta=delta, mask=m)
