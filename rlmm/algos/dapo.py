"""DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"): GRPO with
four changes; two are settings of the clipped surrogate (conf/algo/dapo.yaml), two live here.

1. Clip-higher: eps_low 0.2, eps_high 0.28 (`objective.clip_low`, `objective.clip_high`).
2. Token-level loss: sum over all kept tokens / their number (`loss_aggregation: token`).
3. Dynamic sampling: a group whose rewards are all equal (all right or all wrong) has advantage 0 and no
   gradient; DAPO drops such groups and samples more prompts until the batch is full. `keep_groups`
   says which groups stay; the RL step (rlmm/run/step.py::sample_groups) refills the batch, for at most
   `max_sampling_rounds` more rounds, and logs the counts (rollout/groups_dropped, sampling_rounds,
   groups_filled_with_dropped: a batch still short after the rounds is filled with dropped groups, which
   add no gradient, so every step has the same shape).
4. Overlong reward shaping (soft punishment), with L_max = sampling.max_new_tokens and
   L_cache = overlong_buffer * L_max:

       R_length(y) = 0                                       |y| <= L_max - L_cache
                   = ((L_max - L_cache) - |y|) / L_cache      L_max - L_cache < |y| <= L_max
                   (= -1 at |y| = L_max; the sampler never returns longer)

   added, times `overlong_penalty`, to the task's reward before the advantages (the paper: 1.0).

How this departs from the paper: the filter acts on the task's reward before the length shaping (as
verl's `filter_groups.metric: acc`); the batch is refilled from prompts the run draws for this step
(rlmm/run/train.py), and a short batch is filled with dropped groups rather than sampled without bound.
"""
from __future__ import annotations

import torch
from torch import Tensor

from rlmm.algos.grpo import group_advantages, loss_settings
from rlmm.algos.schedule import check_schedule
from rlmm.algos.surrogate import Objective, SurrogateLoss

__all__ = ["DAPO"]


class DAPO:
    """GRPO's advantages and loss (`rlmm.algos.grpo.GRPO`'s arguments), and:

    Args:
        max_sampling_rounds: rounds of refill prompts after the first sampling while groups are missing
            (0: no dynamic sampling).
        overlong_buffer: L_cache as a fraction of sampling.max_new_tokens, in [0, 1) (0: no shaping).
        overlong_penalty: the factor on R_length (the paper: 1.0).
    """

    critic = None

    def __init__(self, group_size: int, normalize_std: bool, objective: Objective, loss_aggregation: str,
                 kl_coef: float, kl_estimator: str, entropy_coef: float, count_rejected: bool, epochs: int,
                 minibatches: int, max_sampling_rounds: int, overlong_buffer: float, overlong_penalty: float):
        check_schedule(group_size, epochs, minibatches, min_group_size=2)
        self.loss = SurrogateLoss(objective, loss_aggregation, kl_coef, kl_estimator, entropy_coef, count_rejected)
        self.policy_loss, self.loss_normalizer = self.loss, self.loss.normalizer  # the Algorithm's two loss calls
        if max_sampling_rounds < 0:
            raise ValueError(f"algo.max_sampling_rounds: must be >= 0, got {max_sampling_rounds}")
        if not 0 <= overlong_buffer < 1:
            raise ValueError(f"algo.overlong_buffer: a fraction of sampling.max_new_tokens in [0, 1), got "
                             f"{overlong_buffer}")
        if not overlong_penalty >= 0:
            raise ValueError(f"algo.overlong_penalty: must be >= 0, got {overlong_penalty}")
        self.group_size, self.normalize_std = group_size, bool(normalize_std)
        self.epochs, self.minibatches = epochs, minibatches
        self.max_sampling_rounds = max_sampling_rounds
        self.overlong_buffer = float(overlong_buffer)
        self.overlong_penalty = float(overlong_penalty)

    def keep_groups(self, rewards: Tensor) -> Tensor:
        """Groups whose rewards are not all equal (a NaN reward keeps its group: the step's fault check
        must see it)."""
        grouped = rewards.view(-1, self.group_size)
        return ~(grouped == grouped[:, :1]).all(dim=1)

    def shape_rewards(self, rewards: Tensor, lengths: Tensor, max_length: int) -> Tensor:
        """The task's rewards plus overlong_penalty * R_length (module docstring)."""
        buffer = self.overlong_buffer * max_length
        if buffer == 0 or self.overlong_penalty == 0:
            return rewards
        over = (lengths.to(torch.float64) - (max_length - buffer)).clamp_min(0)
        return (rewards.to(torch.float64) - self.overlong_penalty * over / buffer).to(rewards.dtype)

    def advantages(self, rewards: Tensor, mask: Tensor | None = None, values: Tensor | None = None) -> Tensor:
        """GRPO's `group_advantages` of the shaped ``[B]`` rewards."""
        return group_advantages(rewards, self.group_size, self.normalize_std)

    def __repr__(self) -> str:
        return (f"DAPO(group_size={self.group_size}, normalize_std={self.normalize_std}, {loss_settings(self)}, "
                f"max_sampling_rounds={self.max_sampling_rounds}, overlong_buffer={self.overlong_buffer:g}, "
                f"overlong_penalty={self.overlong_penalty:g})")
