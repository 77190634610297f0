"""The interfaces the RL step, the checkpoint and the CLI use, declared in one place.

Each config group's options are classes that satisfy one of these (structurally: no base class needed);
`tests/test_interfaces.py` checks that every option of every group does.

- `Sampler` (`sampler=`): rollouts and their log-probs from the inference engine (rlmm/samplers/base.py).
- `Trainer` (`trainer=`): the training engine: scores rollouts, takes minibatch updates, hands its weights
  to the sampler, saves and restores its state.
- `Correction` (`correction=`): a class with three places to act, each the identity unless overridden
  (rlmm/corrections/base.py): once per batch (`before_update`: the sampler's and the trainer's log-probs and the
  advantages in, old log-probs / weights / mask out), in each micro-batch of the update (`in_update`: the
  current policy's log-probs in, a weight, a mask and a penalty out), and on the step's learning rate
  (`step_size`: the batch in, a factor on this step's rate out; with `state_dict` / `load_state_dict` for what it
  carries from step to step).
- `Algorithm` (`algo=`): advantages from rewards and the policy loss of one micro-batch; one with a critic
  (`critic` set: PPO) is also a `ValueLoss`.
- `PromptFormat` (`chat_template=`): how a task's prompt becomes ids (rlmm/conversation/chat.py).
- `TokenPath` (`token_path=`): which ids a multi-turn conversation's sampler reads and its trainer scores
  (rlmm/conversation/token_path.py).
- `Critic`: the value model an algorithm with `critic` set trains beside the policy (rlmm/run/critic.py::
  ValueCritic), or `NoCritic` with the same calls doing nothing; `CriticStep` is one RL step of it.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol, runtime_checkable

import torch

from rlmm.conversation.chat import PromptFormat
from rlmm.conversation.token_path import TokenPath
from rlmm.corrections.base import Correction, CorrectionOutput
from rlmm.policy.precision import SidePrecision
from rlmm.policy.quantization import QuantizationMode
from rlmm.policy.rollouts import Rollouts
from rlmm.samplers.base import Sampler
from rlmm.trainers.packing import MicroBatching

__all__ = ["Algorithm", "Correction", "CorrectionOutput", "Critic", "CriticStep", "MinibatchUpdate", "PromptFormat",
           "Rollouts", "Sampler", "TokenPath", "Trainer", "ValueLoss"]


@runtime_checkable
class MinibatchUpdate(Protocol):
    """One optimizer step over a minibatch (rlmm/trainers/update.py::MicroBatchedUpdate, the
    backends' shared part, has the contract)."""

    micro_batches: list[list[int]]

    @property
    def holds_graphs(self) -> bool:
        """Whether every micro-batch may be forwarded before the first backward (graphs held at once)."""
        ...

    def forward(self, micro_batch: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """[b, T] log π and entropy of the micro-batch's response tokens, differentiable."""
        ...

    def scale_lr(self, factor: float) -> None:
        """This step's learning rate is the schedule's times `factor` (a correction's `step_size`); before `backward`."""
        ...

    def backward(self, loss: torch.Tensor) -> None:
        ...

    def step(self) -> dict[str, float]:
        """Step (or skip a non-finite step); metrics include grad_norm, lr and skipped (0.0 or 1.0)."""
        ...


@runtime_checkable
class Trainer(Protocol):
    """What every trainer backend provides. `actual_precision` records what it really runs in; `model` is the
    transformers model it trains (inside DeepSpeed's engine, or FSDP2-wrapped)."""

    actual_precision: dict[str, str]
    model: torch.nn.Module

    @property
    def generates_in_place(self) -> bool:
        """Whether `model` can generate the trained policy as it is, on this rank alone: it holds the full
        weights (not ZeRO-3's or several FSDP ranks' shards) and computes as a fresh load of the checkpoint in
        the trainer's precision would (no padding-free attention installed). The evaluation then generates
        with it instead of a copy (rlmm/run/evaluation.py's `Evaluation`)."""
        ...

    def logprobs(self, rollouts: Rollouts, micro_batch_size: int | None = None, *,
                 layout: MicroBatching | None = None) -> torch.Tensor:
        """[B, T] float32 log π_train of every response token (no grad; laid out like
        `rollouts.padded_sampler_logprobs()`), in micro-batches as configured (`micro_batch_size`, or a
        `micro_batch_tokens` budget: then a collective, every rank scores together) or of this many rows.
        `layout`: another micro-batching and layout than the trainer's own, for this call only (the probe
        scores the same rollouts padded, under a token budget and padding-free)."""
        ...

    def logprobs_with_entropy(self, rollouts: Rollouts) -> tuple[torch.Tensor, torch.Tensor]:
        """`logprobs(rollouts)` (the same values, to the bit) and the [B, T] float32 entropy H_t of the same forward's
        distribution at each response position (the one the log-probs are of; 0 past each response), in the
        trainer's own micro-batches. The probe's mismatch by token entropy (`rlmm.mismatch.metrics.entropy_profile`)."""
        ...

    def begin_update(self, rollouts: Rollouts, rows: list[int]) -> MinibatchUpdate:
        """Start one optimizer step on the rollout rows `rows` (gradients zeroed)."""
        ...

    def state_dict(self) -> Mapping[str, torch.Tensor]:
        """Full Hugging Face-named weights for the sampler. A collective when the weights are sharded (every
        rank reads all of them, in the same order): ZeRO-3 gathers them here, FSDP as each is read
        (`rlmm.trainers.weight_sync.GatheredWeights`)."""
        ...

    def checkpoint_state(self) -> dict:
        """This rank's optimizer, schedule and counters: tensors and plain values (and the classes
        `safe_checkpoint_types()` names), so `torch.load(weights_only=True)` reads them back."""
        ...

    def load_checkpoint(self, weights: dict[str, torch.Tensor], rank_states: list[dict]) -> None:
        """Restore what `state_dict()` and every rank's `checkpoint_state()` saved."""
        ...

    @staticmethod
    def safe_checkpoint_types() -> list[type]:
        ...

    @staticmethod
    def unsupported(precision: SidePrecision) -> str | None:
        """Why this machine cannot run `precision` on this backend (None when it can): asked by the CLI
        before a run or a sweep starts."""
        ...

    @staticmethod
    def fake_quantize_refusal(quantization: QuantizationMode, precision: SidePrecision) -> str | None:
        """Why this backend computing in `precision` cannot fake-quantize its forward as `quantization`'s sampler
        quantizes what it sends (`trainer.fake_quantize`, rlmm/trainers/fake_quantization.py; None when it can):
        asked by the CLI before a run or a sweep starts, and by the constructor."""
        ...

    def close(self) -> None:
        """Release the model, the optimizer and any process-group handle."""
        ...


@runtime_checkable
class Algorithm(Protocol):
    """An RL algorithm's maths, tensor in, tensor out (rlmm/algos/). The RL step samples `group_size`
    responses per prompt and makes `epochs` passes of `minibatches` optimizer steps over them."""

    group_size: int
    epochs: int
    minibatches: int
    max_sampling_rounds: int  # refill rounds for the groups `keep_groups` drops (0: none)
    critic: dict | None  # {"lr", "warmup_steps"} when the algorithm trains a critic (PPO), else None

    def keep_groups(self, rewards: torch.Tensor) -> torch.Tensor:
        """[num_prompts] bool: which groups of [B] task rewards the step trains on."""
        ...

    def shape_rewards(self, rewards: torch.Tensor, lengths: torch.Tensor, max_length: int) -> torch.Tensor:
        """[B] rewards the advantages are computed from, given the task's and the response lengths."""
        ...

    def advantages(self, rewards: torch.Tensor, mask: torch.Tensor | None = None,
                   values: torch.Tensor | None = None) -> torch.Tensor:
        """[B] (or [B, T]) advantages from [B] rewards, grouped (prompt 0's responses first), the [B, T]
        response mask and, with a critic, its [B, T] values."""
        ...

    def loss_normalizer(self, mask: torch.Tensor, max_length: int | None = None,
                        response_mask: torch.Tensor | None = None) -> float:
        """The divisor of a minibatch's loss for its [B, T] kept-token mask (and its sampled tokens' mask, for a
        loss that counts the tokens a correction rejected); the step takes it once per minibatch and passes it
        to every micro-batch's `policy_loss`."""
        ...

    def policy_loss(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, weights: torch.Tensor, ref_logprobs: torch.Tensor | None = None,
                    entropy: torch.Tensor | None = None, *, max_length: int | None = None,
                    normalizer: float | None = None,
                    penalty: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """The scalar loss of one micro-batch and its metrics: the names of rlmm/mismatch/loss_stats.py's
        `PolicyLossStats` (the step combines them over micro-batches as its fields declare). `penalty`: a
        correction's per-token term of the differentiable log π (`InUpdate.penalty`), added to the loss."""
        ...


@runtime_checkable
class ValueLoss(Protocol):
    """What an algorithm with a critic (`critic` set: PPO) also provides: the critic's targets and loss."""

    def value_targets(self, rewards: torch.Tensor, mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """[B, T] returns the critic regresses on, from [B] rewards, the [B, T] response mask and its values."""
        ...

    def value_loss(self, values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                   normalizer: float) -> tuple[torch.Tensor, dict[str, float]]:
        """The critic's scalar loss of one micro-batch ([b, T] values, differentiable; the step's values before
        its updates; returns; mask; the minibatch's divisor) and its metrics: the names of rlmm/mismatch/loss_stats.py's
        `ValueLossStats`."""
        ...


@runtime_checkable
class CriticStep(Protocol):
    """One RL step of a critic: its values before the step's updates, and its optimizer steps."""

    values: torch.Tensor | None  # [B, T] V(s_t) the algorithm's advantages use (None: no critic)

    def checked(self) -> dict[str, torch.Tensor]:
        """Tensors the step's NaN/Inf check covers besides the rewards and log-probs ({}: none)."""
        ...

    def train(self, rows: list[int]) -> None:
        """One optimizer step on the minibatch `rows` (nothing without a critic)."""
        ...

    def fault(self) -> str | None:
        """Why the step must be skipped (a non-finite critic gradient), or None."""
        ...

    def metrics(self) -> dict[str, float]:
        """critic/ metrics of the step ({} without a critic: a run without one logs no critic/ key)."""
        ...


@runtime_checkable
class Critic(Protocol):
    """A value model trained beside the policy (`ValueCritic`), or `NoCritic` (rlmm/run/critic.py). The RL step
    calls every method whichever it holds; the checkpoint saves what `state_dict` and `checkpoint_state`
    return (nothing when both are empty)."""

    @property
    def warming_up(self) -> bool:
        """Whether this RL step trains the critic alone (the policy waits)."""
        ...

    def begin_step(self, algo: ValueLoss, rollouts: Rollouts, rewards: torch.Tensor, mask: torch.Tensor,
                   seconds: dict[str, float]) -> CriticStep:
        """This RL step's values of the rollouts and their targets from the [B] shaped rewards and the [B, T]
        response mask (the time it scores in `seconds`)."""
        ...

    def step_done(self) -> None:
        """Count one RL step (the warm-up)."""
        ...

    def state_dict(self) -> Mapping[str, torch.Tensor]:
        """Its full weights ({}: none); a collective like `Trainer.state_dict`."""
        ...

    def checkpoint_state(self) -> dict:
        """This rank's optimizer, schedule and counters ({}: none)."""
        ...

    def load_checkpoint(self, weights: dict[str, torch.Tensor], rank_states: list[dict]) -> None:
        ...

    def safe_checkpoint_types(self) -> list[type]:
        ...

    def close(self) -> None:
        ...
