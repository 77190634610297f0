"""Token-level truncated importance sampling (TIS)."""
from __future__ import annotations

from rlmm.corrections.base import BatchView, CappedImportanceRatio, CorrectionOutput, finish, log_ratios, masked_mean


class TokenTIS(CappedImportanceRatio):
    """Token-level truncated importance sampling (``correction=tis``).

    old = log pi_train,  w_t = min(r_t, C)  with r_t = pi_train(y_t) / pi_sampler(y_t),  mask unchanged.

    Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training": PPO's ratio is
    taken against the trainer's recomputed log-probs, and each token's loss is reweighted by the truncated
    importance ratio from sampler to trainer. Truncation is one-sided (only r > C is cut), as in the paper; tokens
    the trainer finds less likely than the sampler keep their small weight. Logs ``frac_tokens_truncated``, the
    fraction of response tokens with r_t > C.

    Args:
        cap: C, the largest weight a token can get; finite and >= 1 (1 turns every up-weight off).
    """

    def before_update(self, batch: BatchView) -> CorrectionOutput:
        delta, m = log_ratios(batch.trainer_logprobs, batch.sampler_logprobs, batch.mask)
        r = delta.exp()
        truncated = r > self.cap
        return finish(old_logprobs=batch.trainer_logprobs, weights=r.clamp(max=self.cap), keep=m, delta=delta, mask=m,
                      extra={"frac_tokens_truncated": masked_mean(truncated.double(), m)})
