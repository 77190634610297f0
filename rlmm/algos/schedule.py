"""How the RL step samples and passes over a batch, the settings every algorithm has and checks alike:
`group_size` responses per prompt, `epochs` passes of `minibatches` optimizer steps."""
from __future__ import annotations

__all__ = ["check_schedule"]


def check_schedule(group_size: int, epochs: int, minibatches: int, min_group_size: int) -> None:
    """A one-line ValueError naming the first setting out of range. `min_group_size`: 2 for advantages
    relative to the group (a group of one has advantage 0), 1 with a critic's baseline (PPO)."""
    if group_size < min_group_size:
        raise ValueError(f"algo.group_size: must be >= {min_group_size}, got {group_size}"
                         + (" (a group of one has advantage 0)" if min_group_size == 2 else ""))
    if epochs < 1:
        raise ValueError(f"algo.epochs: must be >= 1, got {epochs}")
    if minibatches < 1:
        raise ValueError(f"algo.minibatches: must be >= 1, got {minibatches}")
