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
    Advantages are computed in float64, so a group of identical float32 rewards (the RL step's) gives
    exactly 0; identical float64 rewards give 0 up to rounding (their mean can differ from them in the
    last bit, which the std division then scales up: |A| up to ~1e-10, e.g. six rewards of 1/3).
  * The KL penalty is a per-token loss term evaluated on tokens drawn from the sampler, not from
    pi_theta; as a gradient, k1 has zero expectation on-policy, k2 gives the gradient of
    KL(pi_theta || pi_ref), and k3 (GRPO's choice) that of KL(pi_ref || pi_theta).
    DAPO and Dr.GRPO drop the KL term (kl_coef 0).
  * The dual clip is off by default (`objective.dual_clip: null`) and logratio is not clamped: for A < 0 the
    surrogate is unbounded in ratio, as in PPO; the metrics ratio_max and clipfrac_low show when that matters.
  * The per-token term is the YAML's `objective` node: `ClippedSurrogate` above, or `CISPO` (algo=cispo, MiniMax
    2025 "MiniMax-M1"): -w_t * sg(clip(ratio_t, 1 - clip_low, 1 + clip_high)) * A_i * log pi_theta(y_t), same
    advantages.
The loss is `rlmm.algos.surrogate.SurrogateLoss` (the policy loss every algorithm calls, its objective a strategy
it holds), the KL estimators rlmm/mismatch/kl.py's. See docs/algorithms.md for the derivations and for every metric returned.
"""
from __future__ import annotations

import torch
from torch import Tensor

from rlmm.algos.schedule import check_schedule
from rlmm.algos.surrogate import Objective, SurrogateLoss

__all__ = ["GRPO", "group_advantages"]

STD_EPS = 1e-6  # GRPO's epsilon in (r - mean) / (std + eps)


def group_advantages(rewards: Tensor, group_size: int, normalize_std: bool) -> Tensor:
    """``[B]`` float32 advantages from ``[B]`` rewards, B = num_prompts * group_size, grouped (prompt 0's
    first): A_i = r_i - mean(group), divided by (std(group) + 1e-6) when ``normalize_std``; std is
    Bessel-corrected. A group whose rewards are all equal gets 0 (no gradient): exactly for float32
    rewards, up to rounding (~1e-10) for float64 ones.
    Computed in float64; non-finite rewards propagate to their group."""
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"advantages: expected rewards of shape [num_prompts * {group_size}], "
                         f"got {tuple(rewards.shape)}")
    r = rewards.detach().to(torch.float64).view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if normalize_std:
        adv = adv / (r.std(dim=1, keepdim=True) + STD_EPS)
    return adv.view(-1).to(torch.float32)


class GRPO:
    """GRPO-family policy loss (GRPO, Dr.GRPO, DAPO-style clip-higher are settings of this class).

    Args:
        group_size: responses sampled per prompt (G); rewards come grouped, prompt 0's first.
        normalize_std: divide the centred rewards by the group std + 1e-6 (GRPO) or not (Dr.GRPO).
        objective, loss_aggregation, kl_coef, kl_estimator, entropy_coef, count_rejected: the loss's
            (`rlmm.algos.surrogate.SurrogateLoss`, held as `loss`; `objective` is the per-token term,
            `rlmm.algos.surrogate.ClippedSurrogate` or `CISPO`, with its clip range).
        epochs: passes over each batch of rollouts (read by the RL loop).
        minibatches: optimizer steps per epoch, each on 1/minibatches of the batch (RL loop).
    """

    # Every sampled group is trained on (DAPO's dynamic sampling drops some), and there is no critic (PPO's
    # settings for one: rlmm/run/critic.py).
    max_sampling_rounds = 0
    critic = None

    def __init__(self, group_size: int, normalize_std: bool, objective: Objective, loss_aggregation: str,
                 kl_coef: float, kl_estimator: str, entropy_coef: float, count_rejected: bool, epochs: int,
                 minibatches: int):
        check_schedule(group_size, epochs, minibatches, min_group_size=2)
        self.loss = SurrogateLoss(objective, loss_aggregation, kl_coef, kl_estimator, entropy_coef, count_rejected)
        self.policy_loss, self.loss_normalizer = self.loss, self.loss.normalizer  # the Algorithm's two loss calls
        self.group_size, self.normalize_std = group_size, bool(normalize_std)
        self.epochs, self.minibatches = epochs, minibatches

    def keep_groups(self, rewards: Tensor) -> Tensor:
        """``[num_prompts]`` bool: which sampled groups the step trains on (here: all)."""
        return torch.ones(rewards.numel() // self.group_size, dtype=torch.bool)

    def shape_rewards(self, rewards: Tensor, lengths: Tensor, max_length: int) -> Tensor:
        """The task's ``[B]`` rewards as they are (DAPO adds its overlong punishment)."""
        return rewards

    def advantages(self, rewards: Tensor, mask: Tensor | None = None, values: Tensor | None = None) -> Tensor:
        """`group_advantages` of the ``[B]`` rewards (the response mask and a critic's values are not needed)."""
        return group_advantages(rewards, self.group_size, self.normalize_std)

    def __repr__(self) -> str:
        return f"GRPO(group_size={self.group_size}, normalize_std={self.normalize_std}, {loss_settings(self)})"


def loss_settings(algo) -> str:
    """The loss's and the schedule's settings, as every algorithm's repr shows them."""
    loss = algo.loss
    return (f"objective={loss.objective}, loss_aggregation={loss.loss_aggregation}, "
            f"kl_coef={loss.kl_coef:g} ({loss.kl_estimator}), entropy_coef={loss.entropy_coef:g}, "
            f"count_rejected={loss.count_rejected}, "
            f"epochs={algo.epochs}, minibatches={algo.minibatches}")
