"""Self-normalised importance weights: the batch's weights rescaled to mean 1."""
from __future__ import annotations

import torch

from rlmm.corrections.base import BatchView, Correction, CorrectionOutput, finish, log_ratios, masked_mean

SMALLEST_MEAN = 1e-8  # verl's and slime's guard: a mean weight below it leaves the weights as they are


class SelfNormalize(Correction):
    """Rescale the earlier stages' weights to mean 1 over the batch's kept tokens (``correction=tis+normalize``).

    old = log pi_train (unchanged), nothing dropped, and with w_t the weights of the stages before it:

        w_t <- w_t / mean_{kept tokens of the batch} w,

    the self-normalised importance sampling estimator: biased, lower variance, and its loss scale does not drift
    with the mean weight. Over every rank's tokens (the batch stage sees the whole batch): a rank's mean would give
    each rank its own scale. Put it after the truncation (``tis+normalize``): first it sees no weight (all 1) and
    does nothing.

    Sources: verl's ``rollout_is_batch_normalize`` (`trainer/ppo/rollout_corr_helper.py`: after truncation, across
    ranks) and slime's ``tis_batch_normalize`` (`examples/train_infer_mismatch_helper/mis.py`: after truncation,
    within one micro-batch). Departures: the mean is over the tokens the stack still keeps, where verl and slime
    average over the response mask, rejected tokens' weights included (their weights are computed before the
    rejection there; here a rejected token has weight 0 and would pull the mean down); token level only (verl's
    ``sequence`` level averages per-sequence means). Logs ``norm_factor``, 1 / mean(w).
    """

    def before_update(self, batch: BatchView) -> CorrectionOutput:
        delta, m = log_ratios(batch.trainer_logprobs, batch.sampler_logprobs, batch.mask)
        mean = masked_mean(batch.running_weights(), m)
        factor = torch.where(mean > SMALLEST_MEAN, 1.0 / mean, torch.ones_like(mean))
        return finish(old_logprobs=batch.trainer_logprobs, weights=factor.expand_as(delta), keep=m, delta=delta,
                      mask=m, extra={"norm_factor": torch.where(m.any(), factor, torch.nan)})
