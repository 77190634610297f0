"""RL algorithm maths (`algo=` group): advantages and policy losses, tensor in, tensor out.

Each algorithm is one module and one YAML in conf/algo/, and satisfies `rlmm.run.interfaces.Algorithm`:
the RL step (rlmm/run/step.py) asks it which sampled groups to keep and how to shape the rewards, then for
the advantages once per batch and for `policy_loss(...)` per micro-batch; it never asks which algorithm
it holds. docs/algorithms.md has the equations and every metric.

- `GRPO` (grpo.py): GRPO, Dr.GRPO and CISPO (settings of one class; CISPO's loss is its `objective:` node,
  `surrogate.CISPO`).
- `DAPO` (dapo.py): GRPO with dynamic sampling and overlong reward shaping.
- `GSPO` (gspo.py): GRPO with the clip on the sequence's length-normalised ratio.
- `PPO` (ppo.py): GAE advantages from a critic (rlmm/run/critic.py) and a clipped value loss.

None inherits from another: each holds a `SurrogateLoss` (surrogate.py: the penalties, aggregation and metrics
around an `Objective`, the per-token term its YAML's `objective:` node builds: `ClippedSurrogate`, PPO's with its
dual clip, or `CISPO`) and calls it with its importance ratio, checks its schedule with
`schedule.check_schedule`, and the group-relative ones share `grpo.group_advantages` (GSPO takes GRPO's
`keep_groups`, `shape_rewards` and `advantages` themselves, the same functions, not a subclass).
"""
from rlmm.algos.dapo import DAPO
from rlmm.algos.entropy import per_token_entropy
from rlmm.algos.grpo import GRPO
from rlmm.algos.gspo import GSPO
from rlmm.algos.ppo import PPO
from rlmm.algos.surrogate import CISPO, ClippedSurrogate, SurrogateLoss

__all__ = ["CISPO", "DAPO", "GRPO", "GSPO", "PPO", "ClippedSurrogate", "SurrogateLoss", "per_token_entropy"]
