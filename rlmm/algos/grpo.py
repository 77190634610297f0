"""GRPO and Dr.GRPO: group-normalised advantages and the PPO clipped surrogate (the `algo=` group).

For prompt q with a group of G sampled responses y_1..y_G and scalar rewards r_1..r_G:

    A_i = r_i - mean(r_1..r_G)                                   (Dr.GRPO: stop here)
    A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + 1e-6)        (GRPO: normalize_std=true)

and every token t of y_i gets A_i. With per-token log-ratio and ratio against the policy that
produced the batch (pi_old),

    logratio_t = log pi_theta(y_t) - log pi_old(y_t),    ratio_t = exp(logratio_t),

the per-token policy-gradient loss is the PPO clipped surrogate with decoupled clip range
(DAPO's clip-higher), times a detached importance weight w_t from the mismatch correction:

    pg_t = -w_t * min(ratio_t * A_i, clip(ratio_t, 1 - clip_low, 1 + clip_high) * A_i)

To it are added an optional penalty kl_coef * k_t towards a frozen reference policy and an
optional bonus -entropy_coef * H_t, and the per-token total is aggregated over the kept tokens:

    token:     sum_{i,t} x_{i,t} / sum_i |y_i|              (DAPO token-level)
    sequence:  mean_i ( sum_t x_{i,t} / |y_i| )             (original GRPO)
    constant:  sum_{i,t} x_{i,t} / (B * L)                  (Dr.GRPO; L = max_length, else T)

Sources:
  * Shao et al. 2024, "DeepSeekMath" (GRPO: group-normalised advantages, per-sequence mean, k3 KL).
  * Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective" (Dr.GRPO:
    drops the std division and the 1/|y_i| length normalisation, which bias towards long wrong
    answers and towards groups with low reward variance).
  * Yu et al. 2025, "DAPO" (decoupled clip_low / clip_high, token-level loss).
  * Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (clipped surrogate);
    CleanRL's ppo.py for the names and the approx_kl / clipfrac diagnostics.
  * Schulman 2020, "Approximating KL Divergence" (k1, k2, k3).
  * Yao et al. 2025 (TIS), Liu et al. 2025 "When Speed Kills Stability": the weights w_t that
    correct for sampling from vLLM rather than from the trainer's policy.

How this departs from the papers:
  * The mismatch correction enters only as the detached multiplier w_t on the surrogate; the
    KL and entropy terms are not reweighted.
  * The std is Bessel-corrected (unbiased, ÷ (G - 1)), as in TRL and verl; the papers do not say.
    Advantages are computed in float64 so a group of identical rewards gives exactly 0.
  * The KL penalty is a per-token loss term evaluated on tokens drawn from the sampler, not from
    pi_theta; as a gradient, k1 has zero expectation on-policy, k2 gives the gradient of
    KL(pi_theta || pi_ref), and k3 (GRPO's choice) that of KL(pi_ref || pi_theta).
    DAPO and Dr.GRPO drop the KL term (kl_coef 0).
  * No dual clip and no clamp of logratio: for A < 0 the surrogate is unbounded in ratio, as in
    PPO; the metrics ratio_max and clipfrac_low show when that matters.
See docs/algorithms.md for the derivations and for every metric returned.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["GRPO", "AGGREGATIONS", "KL_ESTIMATORS", "METRIC_KEYS"]

AGGREGATIONS = ("token", "sequence", "constant")
KL_ESTIMATORS = ("k1", "k2", "k3")
STD_EPS = 1e-6  # GRPO's epsilon in (r - mean) / (std + eps)

# Always returned by policy_loss; "kl" is added when ref_logprobs is given, "entropy" when entropy is.
METRIC_KEYS = (
    "loss",
    "pg_loss",
    "approx_kl",
    "clipfrac",
    "clipfrac_low",
    "clipfrac_high",
    "ratio_mean",
    "ratio_min",
    "ratio_max",
    "num_tokens",
)


class GRPO:
    """GRPO-family policy loss (GRPO, Dr.GRPO, DAPO-style clip-higher are settings of this class).

    Args:
        group_size: responses sampled per prompt (G); rewards come grouped, prompt 0's first.
        normalize_std: divide the centred rewards by the group std + 1e-6 (GRPO) or not (Dr.GRPO).
        clip_low: epsilon_low; ratios below 1 - clip_low stop pushing down tokens with A < 0.
        clip_high: epsilon_high; ratios above 1 + clip_high stop pushing up tokens with A > 0.
        loss_aggregation: "token", "sequence" or "constant" (see the module docstring).
        kl_coef: weight of the KL penalty to the reference policy; 0 turns it off.
        kl_estimator: "k1", "k2" or "k3" (Schulman 2020), per token, of KL(pi_theta || pi_ref).
        entropy_coef: weight of the entropy bonus (subtracted from the loss); 0 turns it off.
        epochs: passes over each batch of rollouts (read by the RL loop).
        minibatches: optimizer steps per epoch, each on 1/minibatches of the batch (RL loop).
    """

    def __init__(self, group_size: int, normalize_std: bool, clip_low: float, clip_high: float,
                 loss_aggregation: str, kl_coef: float, kl_estimator: str, entropy_coef: float, epochs: int,
                 minibatches: int):
        if group_size < self.min_group_size:
            raise ValueError(f"algo.group_size: must be >= {self.min_group_size}, got {group_size}"
                             + (" (a group of one has advantage 0)" if self.min_group_size == 2 else ""))
        if not 0 < clip_low < 1:
            raise ValueError(f"algo.clip_low: must be in (0, 1), got {clip_low}")
        if not clip_high > 0:
            raise ValueError(f"algo.clip_high: must be > 0, got {clip_high}")
        if loss_aggregation not in AGGREGATIONS:
            raise ValueError(
                f"algo.loss_aggregation: unknown mode '{loss_aggregation}' (allowed: {', '.join(AGGREGATIONS)})")
        if not kl_coef >= 0:
            raise ValueError(f"algo.kl_coef: must be >= 0, got {kl_coef}")
        if kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"algo.kl_estimator: unknown estimator '{kl_estimator}' (allowed: {', '.join(KL_ESTIMATORS)})")
        if not entropy_coef >= 0:
            raise ValueError(f"algo.entropy_coef: must be >= 0, got {entropy_coef}")
        if epochs < 1:
            raise ValueError(f"algo.epochs: must be >= 1, got {epochs}")
        if minibatches < 1:
            raise ValueError(f"algo.minibatches: must be >= 1, got {minibatches}")
        self.group_size = group_size
        self.normalize_std = bool(normalize_std)
        self.clip_low = float(clip_low)
        self.clip_high = float(clip_high)
        self.loss_aggregation = loss_aggregation
        self.kl_coef = float(kl_coef)
        self.kl_estimator = kl_estimator
        self.entropy_coef = float(entropy_coef)
        self.epochs = epochs
        self.minibatches = minibatches

    # GRPO trains on every group it samples (DAPO's dynamic sampling overrides these two), and has no critic
    # (PPO's settings for one: rlmm/critic.py).
    max_sampling_rounds = 0
    critic = None
    min_group_size = 2  # advantages relative to the group need two responses (PPO's critic needs one)

    def keep_groups(self, rewards: Tensor) -> Tensor:
        """``[num_prompts]`` bool: which sampled groups the step trains on (here: all)."""
        return torch.ones(rewards.numel() // self.group_size, dtype=torch.bool)

    def shape_rewards(self, rewards: Tensor, lengths: Tensor, max_length: int) -> Tensor:
        """The rewards the advantages are computed from, given the task's ``[B]`` rewards and the ``[B]``
        response lengths (here: the task's rewards; DAPO adds its overlong punishment)."""
        return rewards

    def importance_ratio(self, logratio: Tensor, mask: Tensor) -> Tensor:
        """``[B, T]`` ratio pi_theta / pi_old of each token from the masked ``[B, T]`` log-ratios: the ratio
        PPO's clip acts on (here per token; GSPO's is the sequence's geometric mean)."""
        return logratio.exp()

    def __repr__(self) -> str:
        return (f"GRPO(group_size={self.group_size}, normalize_std={self.normalize_std}, "
                f"clip=[{1 - self.clip_low:g}, {1 + self.clip_high:g}], loss_aggregation={self.loss_aggregation}, "
                f"kl_coef={self.kl_coef:g} ({self.kl_estimator}), entropy_coef={self.entropy_coef:g}, "
                f"epochs={self.epochs}, minibatches={self.minibatches})")

    def advantages(self, rewards: Tensor, mask: Tensor | None = None, values: Tensor | None = None) -> Tensor:
        """``[B]`` float32 advantages from ``[B]`` rewards, B = num_prompts * group_size, grouped (the
        response mask and a critic's values, which PPO uses, are not needed).

        A_i = r_i - mean(group), divided by (std(group) + 1e-6) when ``normalize_std``; std is
        Bessel-corrected. A group whose rewards are all equal gets exactly 0 (no gradient).
        Computed in float64; non-finite rewards propagate to their group.
        """
        if rewards.dim() != 1 or rewards.numel() % self.group_size:
            raise ValueError(f"advantages: expected rewards of shape [num_prompts * {self.group_size}], "
                             f"got {tuple(rewards.shape)}")
        r = rewards.detach().to(torch.float64).view(-1, self.group_size)
        adv = r - r.mean(dim=1, keepdim=True)
        if self.normalize_std:
            adv = adv / (r.std(dim=1, keepdim=True) + STD_EPS)
        return adv.view(-1).to(torch.float32)

    def loss_normalizer(self, mask: Tensor, max_length: int | None = None) -> float:
        """The divisor ``policy_loss`` uses for this mask: kept tokens (token), non-empty
        sequences (sequence) or B * L (constant).

        When the RL loop splits one minibatch into micro-batches for gradient accumulation, compute
        this once on the whole minibatch's mask and pass it as ``normalizer`` to every micro-batch's
        ``policy_loss``: the summed micro-batch losses then equal the whole minibatch's loss in every
        mode (do not also divide by the number of micro-batches).
        """
        return float(self._denominator(mask != 0, max_length))

    def _denominator(self, m: Tensor, max_length: int | None) -> Tensor | int:
        batch, width = m.shape
        if max_length is not None and not max_length >= max(width, 1):
            raise ValueError(f"policy_loss: max_length {max_length} is less than the padded width {width}")
        if self.loss_aggregation == "token":
            return m.sum().clamp_min(1)
        if self.loss_aggregation == "sequence":
            return m.any(dim=1).sum().clamp_min(1)
        return max(batch * (max_length if max_length is not None else width), 1)

    def policy_loss(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                    weights: Tensor, ref_logprobs: Tensor | None = None, entropy: Tensor | None = None, *,
                    max_length: int | None = None, normalizer: float | None = None
                    ) -> tuple[Tensor, dict[str, float]]:
        """Scalar loss to minimise, and its metrics as plain Python numbers.

        Args:
            logprobs: ``[B, T]`` log pi_theta of each response token (requires grad).
            old_logprobs: ``[B, T]`` log pi_old of the same tokens (detached here).
            advantages: ``[B]`` one advantage per sequence, broadcast over its tokens, or ``[B, T]`` one
                per token (PPO with a critic).
            mask: ``[B, T]`` bool or 0/1, true on the response tokens that count.
            weights: ``[B, T]`` per-token importance weights from the correction (1 = none; detached).
            ref_logprobs: ``[B, T]`` log pi_ref, required when kl_coef > 0; if given with kl_coef 0
                only the ``kl`` metric is computed.
            entropy: ``[B, T]`` per-token entropy (see ``per_token_entropy``), required when
                entropy_coef > 0; if given with entropy_coef 0 only the ``entropy`` metric is computed.
            max_length: L for "constant" aggregation, normally ``sampling.max_new_tokens``, so that the
                divisor does not depend on the longest response of the batch (defaults to T).
            normalizer: divisor replacing the one of this batch (see ``loss_normalizer``).

        Loss = agg(pg_t + kl_coef * k_t - entropy_coef * H_t), with agg the configured aggregation.
        Padding positions are replaced by 0 with ``torch.where`` before any arithmetic, so inf/NaN
        there reach neither the loss nor the gradient. The loss is float32 (float64 for float64
        inputs). Metrics (module docs, docs/algorithms.md): ``loss``, ``pg_loss`` (the aggregated pg
        term, including weights), token means over kept tokens of ``kl``, ``entropy``,
        ``approx_kl`` = mean(ratio - 1 - logratio), ``clipfrac{,_low,_high}`` = share of tokens whose
        gradient the clip removes, ``ratio_{mean,min,max}`` and ``num_tokens``. With no kept token
        the loss is 0 (with a zero gradient) and the token metrics are NaN.
        """
        shape = tuple(logprobs.shape)
        if logprobs.dim() != 2:
            raise ValueError(f"policy_loss: expected logprobs of shape [B, T], got {shape}")
        for name, t in (("old_logprobs", old_logprobs), ("mask", mask), ("weights", weights),
                        ("ref_logprobs", ref_logprobs), ("entropy", entropy)):
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"policy_loss: {name} has shape {tuple(t.shape)}, expected {shape} as logprobs")
        if tuple(advantages.shape) not in (shape[:1], shape):
            raise ValueError(f"policy_loss: advantages has shape {tuple(advantages.shape)}, expected {shape[:1]} "
                             f"or {shape}")
        if self.kl_coef > 0 and ref_logprobs is None:
            raise ValueError(f"policy_loss: algo.kl_coef is {self.kl_coef:g} but no ref_logprobs were given")
        if self.entropy_coef > 0 and entropy is None:
            raise ValueError(f"policy_loss: algo.entropy_coef is {self.entropy_coef:g} but no entropy was given")
        if normalizer is not None and not normalizer > 0:
            raise ValueError(f"policy_loss: normalizer must be > 0, got {normalizer}")

        device = logprobs.device
        dtype = torch.promote_types(logprobs.dtype, torch.float32)
        m = mask.to(device) != 0
        zero = torch.zeros((), dtype=dtype, device=device)
        denominator = self._denominator(m, max_length) if normalizer is None else normalizer

        def masked(x: Tensor) -> Tensor:
            # where, not multiplication: the unselected branch gets neither value nor gradient.
            return torch.where(m, x.to(device, dtype), zero)

        def aggregate(per_token: Tensor) -> Tensor:
            x = masked(per_token)
            if self.loss_aggregation == "sequence":
                x = x.sum(dim=1) / m.sum(dim=1).clamp_min(1)  # empty sequences contribute 0
            return x.sum() / denominator

        logratio = masked(logprobs) - masked(old_logprobs.detach())
        ratio = self.importance_ratio(logratio, m)
        adv = advantages.detach().to(device, dtype)
        adv = adv[:, None] if adv.dim() == 1 else masked(adv)
        pg_losses1 = -adv * ratio
        pg_losses2 = -adv * ratio.clamp(1 - self.clip_low, 1 + self.clip_high)
        # max of the negated terms = -min(ratio * A, clip(ratio) * A)
        pg_loss = aggregate(masked(weights.detach()) * torch.maximum(pg_losses1, pg_losses2))
        loss = pg_loss

        stats: dict[str, Tensor] = {}
        if ref_logprobs is not None:
            d = masked(ref_logprobs.detach()) - masked(logprobs)  # log(pi_ref / pi_theta)
            if self.kl_estimator == "k1":
                kl = -d
            elif self.kl_estimator == "k2":
                kl = d * d / 2
            else:
                kl = torch.expm1(d) - d  # pi_ref/pi_theta - 1 - log(pi_ref/pi_theta), as in GRPO
            if self.kl_coef > 0:
                loss = loss + self.kl_coef * aggregate(kl)
            stats["kl"] = kl.detach()
        if entropy is not None:
            ent = masked(entropy)
            if self.entropy_coef > 0:
                loss = loss - self.entropy_coef * aggregate(ent)
            stats["entropy"] = ent.detach()

        with torch.no_grad():
            n = m.sum()
            nan = torch.full((), float("nan"), dtype=dtype, device=device)

            def mean(x: Tensor) -> Tensor:
                return torch.where(m, x, zero).sum() / n  # 0 / 0 = NaN on an empty mask

            lr, r = logratio.detach(), ratio.detach()
            clipped_high = m & (adv > 0) & (r > 1 + self.clip_high)
            clipped_low = m & (adv < 0) & (r < 1 - self.clip_low)
            values = {
                "loss": loss.detach(),
                "pg_loss": pg_loss.detach(),
                **{k: mean(v) for k, v in stats.items()},
                "approx_kl": mean(torch.expm1(lr) - lr),
                "clipfrac": (clipped_high | clipped_low).sum() / n,
                "clipfrac_low": clipped_low.sum() / n,
                "clipfrac_high": clipped_high.sum() / n,
                "ratio_mean": mean(r),
                "ratio_min": torch.where(n > 0, torch.where(m, r, torch.inf).min(), nan),
                "ratio_max": torch.where(n > 0, torch.where(m, r, -torch.inf).max(), nan),
                "num_tokens": n,
            }
            # One device->host copy instead of one sync per metric.
            metrics = dict(zip(values, torch.stack([v.to(torch.float64) for v in values.values()]).tolist()))
            metrics["num_tokens"] = int(metrics["num_tokens"])
        return loss, metrics
