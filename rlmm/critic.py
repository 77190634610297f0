"""PPO's critic: a value model V(s_t) trained beside the policy (the component `algo=ppo` adds).

The value model is the policy's architecture with a scalar head (transformers' *ForTokenClassification
with one label: the checkpoint's body, a new head), initialised from the same checkpoint, and trained by
the run's own trainer backend (`trainer=`: DeepSpeed or torch, the trainer side's dtype) with its own
optimizer and learning rate (`algo.critic_lr`). V(s_t) is read where the policy's logits for response
token t sit: the state before token t (rlmm/trainers/scoring.py::response_logprobs).

For the first `algo.critic_warmup_steps` RL steps only the critic trains (the policy waits for a value
baseline worth following); the count is part of the checkpoint, so a resumed run warms up as the
uninterrupted one did.
"""
from __future__ import annotations

import torch

from rlmm.interfaces import MinibatchUpdate, Trainer
from rlmm.samplers.base import Rollouts


class Critic:
    def __init__(self, trainer: Trainer, warmup_steps: int):
        if warmup_steps < 0:
            raise ValueError(f"algo.critic_warmup_steps: must be >= 0, got {warmup_steps}")
        self.trainer, self.warmup_steps, self.steps = trainer, warmup_steps, 0

    @property
    def warming_up(self) -> bool:
        """Whether this RL step trains the critic alone."""
        return self.steps < self.warmup_steps

    def values(self, rollouts: Rollouts) -> torch.Tensor:
        """[B, T] float32 V(s_t) of every response token's state (no grad), laid out like the log-probs."""
        return self.trainer.logprobs(rollouts)

    def begin_update(self, rollouts: Rollouts, rows: list[int]) -> MinibatchUpdate:
        """One optimizer step of the critic on `rows`; its forward gives [b, T] values (and None)."""
        return self.trainer.begin_update(rollouts, rows)

    def step_done(self) -> None:
        self.steps += 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.trainer.state_dict()

    def checkpoint_state(self) -> dict:
        return {"trainer": self.trainer.checkpoint_state(), "steps": self.steps}

    def load_checkpoint(self, weights: dict[str, torch.Tensor], rank_states: list[dict]) -> None:
        self.trainer.load_checkpoint(weights, [s["trainer"] for s in rank_states])
        self.steps = rank_states[0]["steps"]

    def safe_checkpoint_types(self) -> list[type]:
        return self.trainer.safe_checkpoint_types()

    def close(self) -> None:
        self.trainer.close()
