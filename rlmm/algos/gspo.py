"""GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): PPO's clip on the sequence's
length-normalised likelihood ratio instead of on each token's.

For response y_i of length |y_i| with GRPO's group advantage A_i,

    s_i(theta) = (pi_theta(y_i | x) / pi_old(y_i | x)) ^ (1 / |y_i|)
               = exp( (1 / |y_i|) * sum_t log(pi_theta(y_t) / pi_old(y_t)) )

    J = (1 / G) * sum_i min( s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i )

Implemented in the paper's token form (GSPO-token, its eq. 13):
s_{i,t} = sg[s_i] * pi_theta(y_t) / sg[pi_theta(y_t)], whose value is s_i and whose gradient is
s_i * grad log pi_theta(y_t), so with one advantage per sequence the gradient is GSPO's exactly; the
per-token loss is then aggregated per sequence (the mean over its tokens, then over sequences:
`loss_aggregation: sequence`). The clip removes whole sequences, never single tokens, which is why it is
argued to be robust to the training-inference mismatch (one token that the two engines disagree on moves
s_i by 1/|y_i| of its log-ratio instead of clipping alone); the clip range is therefore small (the
paper's 3e-4 and 4e-4).

The mismatch correction enters as for GRPO: its weights w_t multiply each token's term, and its old
log-probs are pi_old. All else (advantages, KL and entropy terms, metrics) is GRPO's: the same
`group_advantages` and `SurrogateLoss`, given `sequence_ratio`; the ratio_* and clipfrac metrics are of s_i.

How this departs from verl: verl's GSPO clamps the sequence log-ratio at 10 (from above) before `exp`, so
s_i <= e^10; here nothing is clamped (a mean log-ratio above ~88 would overflow fp32's `exp`).
"""
from __future__ import annotations

from torch import Tensor

from rlmm.algos.grpo import GRPO, loss_settings
from rlmm.algos.schedule import check_schedule
from rlmm.algos.surrogate import Objective, SurrogateLoss

__all__ = ["GSPO", "sequence_ratio"]


def sequence_ratio(logratio: Tensor, mask: Tensor) -> Tensor:
    """Value s_i (the geometric mean of the sequence's token ratios) at every token, gradient
    s_i * grad log pi_theta(y_t) (GSPO-token, the paper's eq. 13)."""
    sequence = logratio.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp_min(1)
    return (sequence.detach() + logratio - logratio.detach()).exp()


class GSPO:
    """GRPO's advantages and loss with GSPO's sequence-level ratio (`rlmm.algos.grpo.GRPO`'s arguments)."""

    max_sampling_rounds = 0
    critic = None

    def __init__(self, group_size: int, normalize_std: bool, objective: Objective, loss_aggregation: str,
                 kl_coef: float, kl_estimator: str, entropy_coef: float, count_rejected: bool, epochs: int,
                 minibatches: int):
        check_schedule(group_size, epochs, minibatches, min_group_size=2)
        self.loss = SurrogateLoss(objective, loss_aggregation, kl_coef, kl_estimator, entropy_coef, count_rejected,
                                  ratio=sequence_ratio)  # the clip acts on the sequence's ratio s_i
        self.policy_loss, self.loss_normalizer = self.loss, self.loss.normalizer  # the Algorithm's two loss calls
        self.group_size, self.normalize_std = group_size, bool(normalize_std)
        self.epochs, self.minibatches = epochs, minibatches

    # GRPO's own methods, not copies (no inheritance: only these three are shared): every group is kept, the
    # rewards are the task's, the advantages `group_advantages`.
    keep_groups, shape_rewards, advantages = GRPO.keep_groups, GRPO.shape_rewards, GRPO.advantages

    def __repr__(self) -> str:
        return f"GSPO(group_size={self.group_size}, normalize_std={self.normalize_std}, {loss_settings(self)})"
