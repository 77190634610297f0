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
log-probs are pi_old. All else (advantages, KL and entropy terms, metrics) is `GRPO`'s; the ratio_*
and clipfrac metrics are of s_i.
"""
from __future__ import annotations

from torch import Tensor

from rlmm.algos.grpo import GRPO

__all__ = ["GSPO"]


class GSPO(GRPO):
    """GRPO with GSPO's sequence-level ratio (same arguments as `GRPO`)."""

    def importance_ratio(self, logratio: Tensor, mask: Tensor) -> Tensor:
        """Value s_i (the geometric mean of the sequence's token ratios) at every token, gradient
        s_i * grad log pi_theta(y_t) (GSPO-token)."""
        sequence = logratio.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp_min(1)
        return (sequence.detach() + logratio - logratio.detach()).exp()

    def __repr__(self) -> str:
        return "GSPO" + super().__repr__().removeprefix("GRPO")
