"""PPO with a critic (Schulman et al. 2017; Ouyang et al. 2022 for LLMs): per-token advantages from a
learned value model by GAE, PPO's clipped surrogate, and a clipped value loss.

The response is an episode of |y| actions (tokens); the task's reward r arrives at its last token:

    r_t = r if t = |y| - 1 else 0,     V(s_|y|) = 0 (the episode ends)
    delta_t = r_t + gamma * V(s_{t+1}) - V(s_t)
    A_t = delta_t + gamma * lambda * A_{t+1}              (GAE, Schulman et al. 2016)
    R_t = A_t + V(s_t)                                    (the critic's target)

with V the critic's values before the update (rlmm/run/critic.py). With `whiten_advantages` the A_t of
the step's batch (every rank's rows) are shifted and scaled to mean 0 and (Bessel-corrected) std 1 over its
response tokens (dividing by std + 1e-8; verl multiplies by rsqrt(var + 1e-8), which differs where the std is
tiny: 41% apart at std 1e-4). The [B, T] advantages go through the mismatch correction's weights and
PPO's clipped surrogate unchanged (`rlmm.algos.surrogate.SurrogateLoss` on each token's ratio,
token-level aggregation by default). The critic minimises

    L_V = 0.5 * max( (V - R)^2, (V_old + clip(V - V_old, -value_clip, value_clip) - R)^2 )

averaged over the minibatch's response tokens (verl and OpenRLHF clip the value the same way).

How this departs from common recipes: the KL to a reference enters the loss (`kl_coef`), not the reward;
`group_size` responses per prompt (8 by default, as GRPO, so the arms of a comparison sample alike).
"""
from __future__ import annotations

import torch
from torch import Tensor

from rlmm.algos.schedule import check_schedule
from rlmm.algos.surrogate import Objective, SurrogateLoss
from rlmm.runtime.collectives import rows_of_every_rank

__all__ = ["PPO", "gae"]


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """[B, T] float32 advantages A_t and returns R_t from [B] sequence rewards, [B, T] values V(s_t) and the
    [B, T] right-padded response mask (module docstring); 0 on padding. Computed in float64. A mask that is
    not right-padded (a gap, or a response after padding) is a ValueError: the reward would land on the
    last masked token and V(s_{t+1}) would be read across the gap."""
    m = mask.to(torch.bool)
    check_right_padded(m)
    v = torch.where(m, values.to(torch.float64), 0.0)
    lengths = m.sum(1)
    token_rewards = torch.zeros_like(v)
    rows = torch.nonzero(lengths > 0).squeeze(1)
    token_rewards[rows, lengths[rows] - 1] = rewards.to(torch.float64)[rows]
    # V(s_{t+1}) and whether token t+1 exists: one column past the end, 0 and False (v is 0 on padding).
    next_value = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1)
    following = torch.cat([m[:, 1:], torch.zeros_like(m[:, :1])], dim=1)
    advantages = torch.zeros_like(v)
    running = torch.zeros(v.size(0), dtype=torch.float64)
    for t in reversed(range(v.size(1))):
        delta = token_rewards[:, t] + gamma * next_value[:, t] - v[:, t]
        running = delta + gamma * lam * torch.where(following[:, t], running, 0.0)
        advantages[:, t] = torch.where(m[:, t], running, 0.0)
    returns = torch.where(m, advantages + v, 0.0)
    return advantages.float(), returns.float()


def check_right_padded(mask: Tensor) -> None:
    """A ValueError unless every row of the [B, T] bool mask is some true entries followed by false ones."""
    right_padded = torch.arange(mask.size(1), device=mask.device) < mask.sum(1, keepdim=True)
    if not torch.equal(mask, right_padded):
        rows = torch.nonzero((mask != right_padded).any(1))
        raise ValueError(f"gae: the response mask must be right-padded (each row's tokens first, then padding); "
                         f"rows {rows.squeeze(1).tolist()} are not")


class PPO:
    """The policy loss's arguments (objective, loss_aggregation, kl_coef, kl_estimator, entropy_coef,
    count_rejected: `rlmm.algos.surrogate.SurrogateLoss`), epochs, minibatches (no normalize_std: advantages come
    from the critic), and:

    Args:
        group_size: responses sampled per prompt.
        gamma, lam: GAE's discount and lambda.
        whiten_advantages: shift and scale the batch's advantages to mean 0, std 1.
        value_clip: the critic's value may move at most this far from its old value before the loss
            stops pulling it (0: no clipping).
        critic_lr: the critic's learning rate (its other optimizer settings are the trainer's).
        critic_warmup_steps: RL steps at the start that train the critic alone.
    """

    max_sampling_rounds = 0  # every sampled group is trained on

    def __init__(self, group_size: int, objective: Objective, loss_aggregation: str, kl_coef: float,
                 kl_estimator: str, entropy_coef: float, count_rejected: bool, epochs: int, minibatches: int,
                 gamma: float, lam: float, whiten_advantages: bool, value_clip: float, critic_lr: float, critic_warmup_steps: int):
        # The critic gives every response its own baseline: one response per prompt is enough.
        check_schedule(group_size, epochs, minibatches, min_group_size=1)
        self.loss = SurrogateLoss(objective, loss_aggregation, kl_coef, kl_estimator, entropy_coef, count_rejected)
        self.policy_loss, self.loss_normalizer = self.loss, self.loss.normalizer  # the Algorithm's two loss calls
        self.group_size, self.epochs, self.minibatches = group_size, epochs, minibatches
        for name, value in (("gamma", gamma), ("lam", lam)):
            if not 0 <= value <= 1:
                raise ValueError(f"algo.{name}: must be in [0, 1], got {value}")
        if not value_clip >= 0:
            raise ValueError(f"algo.value_clip: must be >= 0 (0: off), got {value_clip}")
        if not critic_lr > 0:
            raise ValueError(f"algo.critic_lr: must be > 0, got {critic_lr}")
        self.gamma, self.lam, self.whiten = float(gamma), float(lam), bool(whiten_advantages)
        self.value_clip = float(value_clip)
        self.critic = {"lr": float(critic_lr), "warmup_steps": int(critic_warmup_steps)}

    def keep_groups(self, rewards: Tensor) -> Tensor:
        """Every group."""
        return torch.ones(rewards.numel() // self.group_size, dtype=torch.bool)

    def shape_rewards(self, rewards: Tensor, lengths: Tensor, max_length: int) -> Tensor:
        """The task's rewards as they are."""
        return rewards

    def advantages(self, rewards: Tensor, mask: Tensor | None = None, values: Tensor | None = None) -> Tensor:
        """[B, T] GAE advantages (whitened when asked) from [B] rewards, the [B, T] response mask and the
        critic's [B, T] values."""
        if mask is None or values is None:
            raise ValueError("algo=ppo: advantages need the response mask and the critic's values")
        advantages, _ = gae(rewards, values, mask, self.gamma, self.lam)
        if not self.whiten:
            return advantages
        m = mask.to(torch.bool)
        # over every rank's response tokens, as verl whitens the whole batch: a rank's own mean and std would give
        # each rank's share of the step another scale (a 2-rank step was 5% apart from the 1-rank one in pg_loss)
        every, every_mask = rows_of_every_rank(advantages, m)
        kept = every[every_mask].double()
        std = kept.std() if kept.numel() > 1 else torch.ones((), dtype=torch.float64)
        whitened = (advantages.double() - kept.mean()) / (std + 1e-8)
        return torch.where(m, whitened, 0.0).float()

    def value_targets(self, rewards: Tensor, mask: Tensor, values: Tensor) -> Tensor:
        """[B, T] returns R_t = A_t + V(s_t) (unwhitened GAE), what the critic regresses on."""
        return gae(rewards, values, mask, self.gamma, self.lam)[1]

    def value_loss(self, values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
                   normalizer: float) -> tuple[Tensor, dict[str, float]]:
        """The critic's clipped value loss of one micro-batch (summed over its response tokens, divided by
        the minibatch's `normalizer`), and its metrics: loss, value_clipfrac, num_tokens."""
        m = mask.to(values.device) != 0
        old = old_values.to(values.device, values.dtype)
        target = returns.to(values.device, values.dtype)
        unclipped = (values - target).pow(2)
        if self.value_clip > 0:
            clipped = (old + (values - old).clamp(-self.value_clip, self.value_clip) - target).pow(2)
            per_token = 0.5 * torch.maximum(unclipped, clipped)
            clipfrac = (m & (clipped > unclipped)).sum().item() / max(m.sum().item(), 1)
        else:
            per_token, clipfrac = 0.5 * unclipped, 0.0
        loss = torch.where(m, per_token, 0.0).sum() / normalizer
        return loss, {"loss": loss.item(), "value_clipfrac": clipfrac, "num_tokens": int(m.sum().item())}

    def __repr__(self) -> str:
        return (f"PPO(group_size={self.group_size}, objective={self.loss.objective}, "
                f"gamma={self.gamma:g}, lam={self.lam:g}, whiten={self.whiten}, value_clip={self.value_clip:g}, "
                f"critic={self.critic}, loss_aggregation={self.loss.loss_aggregation}, epochs={self.epochs}, "
                f"minibatches={self.minibatches})")
