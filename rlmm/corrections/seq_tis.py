"""Sequence-level truncated importance sampling."""
from __future__ import annotations

from rlmm.corrections.base import (BatchView, CappedImportanceRatio, CorrectionOutput, finish, log_ratios, masked_mean,
                                   sequence_ratio)


class SequenceTIS(CappedImportanceRatio):
    """Sequence-level truncated importance sampling (``correction=seq_tis``).

    old = log pi_train,  w_{i,t} = min(exp(S_i), C)  for every token t of sequence i,  S_i = sum_t delta_{i,t},
    mask unchanged.

    The importance weight of a whole response, pi_train(y) / pi_sampler(y), is the product of its token ratios;
    truncating it at C is the sequence-level TIS of Liu et al. 2025 ("When Speed Kills Stability", Seq-TIS;
    verl ``rollout_is="sequence"``). Unbiased at the sequence level before truncation, but its variance grows
    with length (chi^2 of the product of token ratios), which the cap bounds at the price of bias. exp(S_i) is
    taken in float64, so S_i > ~709.8 overflows to inf and is then capped to C. Logs
    ``frac_sequences_truncated`` (non-empty sequences with exp(S_i) > C) and ``frac_tokens_truncated`` (the
    response tokens in them).

    Args:
        cap: C, the largest weight a sequence can get; finite and >= 1.
    """

    def before_update(self, batch: BatchView) -> CorrectionOutput:
        delta, m = log_ratios(batch.trainer_logprobs, batch.sampler_logprobs, batch.mask)
        seq_ratio = sequence_ratio(delta)  # [B, 1]
        truncated = seq_ratio > self.cap
        return finish(
            old_logprobs=batch.trainer_logprobs, weights=seq_ratio.clamp(max=self.cap).expand_as(delta), keep=m,
            delta=delta, mask=m,
            extra={
                "frac_tokens_truncated": masked_mean(truncated.expand_as(m).double(), m),
                "frac_sequences_truncated": masked_mean(truncated.squeeze(1).double(), m.any(dim=1)),
            },
        )
