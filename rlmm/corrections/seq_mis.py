"""Sequence-level masked importance sampling (Seq-MIS)."""
from __future__ import annotations

from rlmm.corrections.base import (BatchView, CappedImportanceRatio, CorrectionOutput, finish, log_ratios,
                                   sequence_ratio)


class SequenceMask(CappedImportanceRatio):
    """Sequence-level masked importance sampling (``correction=seq_mis``).

    old = log pi_train,  keep_i = [exp(S_i) <= C],  w_{i,t} = exp(S_i) on every token of a kept sequence,
    and 0 (with mask False) on every token of a rejected one.

    Liu et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference
    Mismatch", Seq-MIS: the sequence importance weight rho(y) = pi_train(y) / pi_sampler(y) times the indicator
    [rho(y) <= C]. Where Seq-TIS would cap an outlier sequence at C and still learn from it, Seq-MIS rejects it
    outright, the argument being that a huge ratio marks a response the trainer would almost never produce (a
    "toxic tail"), whose gradient is noise whatever its weight. Kept sequences keep their full, untruncated
    weight (at most C). The rejection is one-sided, as in the paper: sequences with tiny ratios are kept with
    their tiny weight. A NaN S_i is rejected.

    Args:
        cap: C, the largest accepted sequence ratio; finite and >= 1.
    """

    def before_update(self, batch: BatchView) -> CorrectionOutput:
        delta, m = log_ratios(batch.trainer_logprobs, batch.sampler_logprobs, batch.mask)
        seq_ratio = sequence_ratio(delta)  # [B, 1]
        keep = seq_ratio <= self.cap
        return finish(old_logprobs=batch.trainer_logprobs, weights=seq_ratio.expand_as(delta), keep=keep, delta=delta,
                      mask=m)
