"""PPO's critic: a value model V(s_t) trained beside the policy (the component `algo=ppo` adds), and the
null critic every other algorithm gets, with the same calls doing nothing (as `NoOpLogger` and `NoMonitor`):
the RL step (rlmm/run/step.py) never asks whether it has a critic. Both satisfy `rlmm.run.interfaces.Critic`.

The value model is the policy's architecture with a scalar head (transformers' *ForTokenClassification
with one label: the checkpoint's body, a new head), initialised from the same checkpoint, and trained by
the run's own trainer backend (`trainer=`: DeepSpeed or torch, the trainer side's dtype) with its own
optimizer and learning rate (`algo.critic_lr`). V(s_t) is read where the policy's logits for response
token t sit: the state before token t (rlmm/trainers/scoring.py::response_logprobs).

For the first `algo.critic_warmup_steps` RL steps only the critic trains (the policy waits for a value
baseline worth following); the count is part of the checkpoint, so a resumed run warms up as the
uninterrupted one did.

One RL step of the critic (`begin_step`): its values before the step's updates and their targets (the
algorithm's `value_targets`, PPO's GAE returns), one optimizer step per minibatch on the algorithm's
`value_loss` (`train`), then its fault and its metrics (critic/).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from rlmm.mismatch.loss_stats import ValueLossStats, combined_metrics
from rlmm.policy.rollouts import Rollouts
from rlmm.run.interfaces import MinibatchUpdate, Trainer, ValueLoss
from rlmm.runtime.collectives import divisor_over_ranks
from rlmm.runtime.timing import timed

__all__ = ["NoCritic", "ValueCritic", "critic_metrics"]


class ValueCritic:
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

    def begin_step(self, algo: ValueLoss, rollouts: Rollouts, rewards: torch.Tensor, mask: torch.Tensor,
                   seconds: dict[str, float]) -> ValueCriticStep:
        """This RL step's values V(s_t) (timed as critic_values) and the algorithm's targets R_t for them."""
        with timed(seconds, "critic_values"):
            values = self.values(rollouts)
        return ValueCriticStep(self, algo, rollouts, values, algo.value_targets(rewards, mask, values), mask,
                               self.warming_up)

    def step_done(self) -> None:
        self.steps += 1

    def state_dict(self) -> Mapping[str, torch.Tensor]:
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


class ValueCriticStep:
    """One RL step of a `ValueCritic`: `values` V(s_t) before the step's updates, `returns` R_t, both [B, T]
    over the step's rollouts, and the metrics of each optimizer step `train` takes."""

    def __init__(self, critic: ValueCritic, algo: ValueLoss, rollouts: Rollouts, values: torch.Tensor,
                 returns: torch.Tensor, mask: torch.Tensor, warming_up: bool):
        self.critic, self.algo, self.rollouts = critic, algo, rollouts
        self.values, self.returns, self.mask, self.warming_up = values, returns, mask, warming_up
        self.losses: list[dict[str, float]] = []  # one entry per optimizer step

    def checked(self) -> dict[str, torch.Tensor]:
        """What the step's fault check covers besides the rewards and the log-probs: the values."""
        return {"critic_values": self.values[self.mask]}

    def train(self, rows: list[int]) -> None:
        """One optimizer step of the critic on the minibatch `rows`: the algorithm's value loss of each
        micro-batch against the returns, its values before the step as the clip's anchor."""
        update = self.critic.begin_update(self.rollouts, rows)
        normalizer = divisor_over_ranks(float(self.mask[rows].sum().clamp_min(1)))  # token-level, as the policy's
        parts = []
        for micro in update.micro_batches:
            values, _ = update.forward(micro)
            width = values.size(1)
            loss, metrics = self.algo.value_loss(values, self.values[micro, :width], self.returns[micro, :width],
                                                 self.mask[micro, :width], normalizer)
            update.backward(loss)
            parts.append(metrics)
        self.losses.append({**combined_metrics(ValueLossStats, parts), **update.step()})

    def fault(self) -> str | None:
        if any(m["skipped"] for m in self.losses):
            return "non-finite critic gradient (its optimizer step skipped)"
        return None

    def metrics(self) -> dict[str, float]:
        return critic_metrics(self.values, self.returns, self.mask, self.losses, self.warming_up)


def critic_metrics(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, losses: list[dict[str, float]],
                   warming_up: bool) -> dict[str, float]:
    """critic/: the value mean, the explained variance 1 - Var(R - V) / Var(R) of the values the step
    started from (over response tokens; 1 is perfect, <= 0 no better than a constant), the loss and the
    clip fraction averaged over its optimizer steps, and whether the policy waited (warm-up)."""
    v, r = values[mask].double(), returns[mask].double()
    explained = 1 - (r - v).var() / r.var() if r.numel() > 1 and r.var() > 0 else torch.tensor(float("nan"))
    return {"critic/value_mean": v.mean().item(), "critic/return_mean": r.mean().item(),
            "critic/explained_variance": explained.item(),
            **{f"critic/{k}": sum(m[k] for m in losses) / len(losses)
               for k in ("loss", "value_clipfrac", "grad_norm") if losses},
            "critic/warming_up": float(warming_up)}


class NoCritic:
    """An algorithm without a value model (every one but PPO): the same calls, doing nothing, so the RL step
    and the checkpoint have no `if`. It never warms up, its step has no values (the algorithm's advantages
    get None), checks nothing, trains nothing and logs nothing; it has no weights and no state to save."""

    warming_up = False

    def begin_step(self, algo, rollouts: Rollouts, rewards: torch.Tensor, mask: torch.Tensor,
                   seconds: dict[str, float]) -> NoCriticStep:
        return NoCriticStep()

    def step_done(self) -> None:
        pass

    def state_dict(self) -> Mapping[str, torch.Tensor]:
        return {}

    def checkpoint_state(self) -> dict:
        return {}

    def load_checkpoint(self, weights: dict[str, torch.Tensor], rank_states: list[dict]) -> None:
        pass

    def safe_checkpoint_types(self) -> list[type]:
        return []

    def close(self) -> None:
        pass


class NoCriticStep:
    values = None

    def checked(self) -> dict[str, torch.Tensor]:
        return {}

    def train(self, rows: list[int]) -> None:
        pass

    def fault(self) -> str | None:
        return None

    def metrics(self) -> dict[str, float]:
        return {}

