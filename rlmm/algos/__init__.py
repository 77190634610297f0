"""RL algorithm maths (`algo=` group): advantages and policy losses, tensor in, tensor out.

The RL loop calls `algo.advantages(rewards)` once per batch and `algo.policy_loss(...)` per
(micro-)batch; see docs/algorithms.md for the equations and every metric.
"""
from rlmm.algos.entropy import per_token_entropy
from rlmm.algos.grpo import GRPO

__all__ = ["GRPO", "per_token_entropy"]
