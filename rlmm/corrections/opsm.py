"""OPSM, off-policy sequence masking: drop negative-advantage sequences the current policy has moved away from."""
from __future__ import annotations

import math

import torch

from rlmm.corrections.base import Anchor, Correction, InUpdate, MicroBatchView, choice


class OffPolicySequenceMask(Correction):
    """Off-policy sequence masking, inside the update (``correction=opsm``).

    PPO's pi_old the trainer's (as `none`), weight 1, and in each micro-batch, with pi_theta the current policy:

        D_i = mean_{t in y_i} (log mu(y_t) - sg log pi_theta(y_t)),     keep_i = [A_i >= 0] or [D_i <= delta]

    A sequence with a negative advantage that pi_theta has moved away from (D_i large: mu found it much likelier
    than the policy now does) teaches mostly noise about tokens the policy no longer produces; one with A >= 0 is
    always kept. Acts inside the update, since pi_theta changes across minibatches and epochs.

    Sources: DeepSeek-AI 2025, "DeepSeek-V3.2" §3.1 (off-policy sequence masking: mu the inference engine's policy);
    TRL's `GRPOTrainer.get_off_policy_mask` (the sampler's log-probs when vLLM gives them, mean over the completion
    mask, `off_policy_mask_threshold`: off by default, its docs suggest 0.5); slime's `compute_opsm_mask`
    (`slime/utils/ppo_utils.py`: the recomputed pi_old by default, mu with `--use-rollout-logprobs`,
    `--opsm-delta` 1e-4). The anchors disagree on delta; the default here is slime's 1e-4, its only coded default,
    with DeepSeek's and TRL's mu (``anchor: sampler``): E_mu[log mu - log pi] = KL(mu || pi) >= 0, so at a bf16
    mismatch of KL ~1e-4 a token this drops a good share of the negative sequences (docs/corrections.md). A_i is the
    sequence's mean advantage over its tokens (GRPO's one advantage). Masked sequences stay in the loss's normaliser,
    as in TRL and slime (the normaliser is fixed before the update's forwards). Logs, summed over the step's
    micro-batches: ``frac_sequences_dropped`` (of the sequences seen), ``frac_tokens_dropped`` and
    ``frac_negative_sequences``.

    Args:
        threshold: delta, the largest accepted mean log-ratio of a negative-advantage sequence; finite.
        anchor: an `Anchor`: sampler (mu, DeepSeek-V3.2, TRL) or trainer (the recomputed pi_old, slime's default).
    """

    old_policy = Anchor.trainer

    def __init__(self, threshold: float, anchor: Anchor):
        if not math.isfinite(threshold):
            raise ValueError(f"correction.threshold: must be finite, got {threshold}")
        self.threshold, self.anchor = float(threshold), choice(Anchor, anchor, "anchor")

    def in_update(self, micro: MicroBatchView) -> InUpdate:
        m = micro.mask
        anchor = self.anchor.logprobs(micro)
        zero = torch.zeros((), dtype=torch.float64, device=m.device)
        log_ratio = torch.where(m, anchor.to(torch.float64) - micro.logprobs.detach().to(torch.float64), zero)
        tokens = m.sum(dim=1)
        nonempty = tokens > 0
        divergence = log_ratio.sum(dim=1) / tokens.clamp_min(1)
        advantage = torch.where(m, micro.advantages.to(torch.float64), zero).sum(dim=1) / tokens.clamp_min(1)
        keep = (advantage >= 0) | (divergence <= self.threshold)  # NaN divergence fails <=: dropped if A < 0
        dropped = nonempty & ~keep
        seen = float(nonempty.sum())
        return InUpdate(weights=torch.ones_like(micro.weights), mask=m & keep[:, None], counts={
            "frac_sequences_dropped": (float(dropped.sum()), seen),
            "frac_tokens_dropped": (float(tokens[dropped].sum()), float(tokens.sum())),
            "frac_negative_sequences": (float((nonempty & (advantage < 0)).sum()), seen)})
