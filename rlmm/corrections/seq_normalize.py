"""Self-normalised importance weights at the sequence level: the weights rescaled so that sequences average 1."""
from __future__ import annotations

import torch

from rlmm.corrections.base import BatchView, Correction, CorrectionOutput, finish, log_ratios, masked_mean
from rlmm.corrections.normalize import SMALLEST_MEAN


class SequenceSelfNormalize(Correction):
    """Rescale the earlier stages' weights so that the mean sequence weight is 1 (``correction=seq_tis+seq_normalize``).

    old = log pi_train (unchanged), nothing dropped, and with w_t the weights of the stages before it, W_i the mean of
    w over sequence i's kept tokens (0 when it has none) and R the rows the mean runs over:

        w_t <- w_t / mean_{i in R} W_i,     R = the sequences with a kept token   (count_empty: false, verl)
                                            R = every sequence of the batch        (count_empty: true, slime)

    `normalize` divides by the mean over tokens, so long sequences weigh more in it; this divides by the mean over
    sequences, each sequence's weight once (the level of ``seq_tis``'s one weight per sequence). Over every rank's
    rows (the batch stage sees the whole batch). A mean below 1e-8 leaves the weights as they are.

    Sources: verl's ``rollout_is_batch_normalize`` with ``rollout_is: sequence`` (`verl/trainer/ppo/
    rollout_corr_helper.py`, ``compute_rollout_correction_weights``: the per-sequence masked mean averaged over the
    rows with a response token, across ranks) and slime's ``tis_batch_normalize`` with ``tis_level: sequence``
    (`examples/train_infer_mismatch_helper/mis.py`, ``compute_mis_weights``: the per-sample masked means summed and
    divided by the number of samples, an empty one included, within its micro-batch). Departures: W_i is over the
    tokens the stack still keeps (verl and slime average the weights before their rejection, rejected tokens and
    sequences included; the same figures when no stage before it rejects); with ``count_empty: false`` a sequence an
    earlier stage dropped entirely leaves R (verl's R holds it). Logs ``norm_factor``, 1 / mean.

    Args:
        count_empty: average over every sequence of the batch, one with no kept token counting 0 (slime), instead
            of over the sequences with a kept token (verl).
    """

    def __init__(self, count_empty: bool):
        self.count_empty = bool(count_empty)

    def before_update(self, batch: BatchView) -> CorrectionOutput:
        delta, m = log_ratios(batch.trainer_logprobs, batch.sampler_logprobs, batch.mask)
        per_sequence = torch.where(m, batch.running_weights(), 0.0).sum(dim=1) / m.sum(dim=1).clamp_min(1)
        rows = torch.ones_like(m[:, 0]) if self.count_empty else m.any(dim=1)
        mean = masked_mean(per_sequence, rows)
        factor = torch.where(mean > SMALLEST_MEAN, 1.0 / mean, torch.ones_like(mean))
        return finish(old_logprobs=batch.trainer_logprobs, weights=factor.expand_as(delta), keep=m, delta=delta,
                      mask=m, extra={"norm_factor": torch.where(m.any(), factor, torch.nan)})
