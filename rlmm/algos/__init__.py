"""RL algorithm maths (`algo=` group): advantages and policy losses, tensor in, tensor out.

Each algorithm is one module and one YAML in conf/algo/, and satisfies `rlmm.interfaces.Algorithm`:
the RL step (rlmm/step.py) asks it which sampled groups to keep and how to shape the rewards, then for
the advantages once per batch and for `policy_loss(...)` per micro-batch; it never asks which algorithm
it holds. docs/algorithms.md has the equations and every metric.

- `GRPO` (grpo.py): GRPO and Dr.GRPO (settings of one class).
- `DAPO` (dapo.py): GRPO with dynamic sampling and overlong reward shaping.
- `GSPO` (gspo.py): GRPO with the clip on the sequence's length-normalised ratio.
"""
from rlmm.algos.dapo import DAPO
from rlmm.algos.entropy import per_token_entropy
from rlmm.algos.grpo import GRPO
from rlmm.algos.gspo import GSPO

__all__ = ["DAPO", "GRPO", "GSPO", "per_token_entropy"]
