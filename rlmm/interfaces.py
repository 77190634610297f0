"""The four interfaces the RL step, the checkpoint and the CLI use, declared in one place.

Each config group's options are classes that satisfy one of these (structurally: no base class needed);
`tests/test_interfaces.py` checks that every option of every group does.

- `Sampler` (`sampler=`): rollouts and their log-probs from the inference engine (rlmm/samplers/base.py).
- `Trainer` (`trainer=`): the training engine: scores rollouts, takes minibatch updates, hands its weights
  to the sampler, saves and restores its state.
- `Correction` (`correction=`): the two sides' log-probs in, old log-probs / weights / mask out
  (rlmm/corrections/base.py).
- `Algorithm` (`algo=`): advantages from rewards and the policy loss of one micro-batch.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import torch

from rlmm.corrections.base import Correction, CorrectionOutput
from rlmm.precision import SidePrecision
from rlmm.samplers.base import Rollouts, Sampler
from rlmm.trainers.packing import MicroBatching

__all__ = ["Algorithm", "Correction", "CorrectionOutput", "MinibatchUpdate", "Rollouts", "Sampler", "Trainer"]


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
        with it instead of a copy (rlmm/train.py's `Evaluation`)."""
        ...

    def logprobs(self, rollouts: Rollouts, micro_batch_size: int | None = None, *,
                 layout: MicroBatching | None = None) -> torch.Tensor:
        """[B, T] float32 log π_train of every response token (no grad; laid out like
        `rollouts.padded_sampler_logprobs()`), in micro-batches as configured (`micro_batch_size`, or a
        `micro_batch_tokens` budget: then a collective, every rank scores together) or of this many rows.
        `layout`: another micro-batching and layout than the trainer's own, for this call only (the probe
        scores the same rollouts padded, under a token budget and padding-free)."""
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

    def loss_normalizer(self, mask: torch.Tensor, max_length: int | None = None) -> float:
        """The divisor of a minibatch's loss for its [B, T] kept-token mask; the step takes it once per
        minibatch and passes it to every micro-batch's `policy_loss`."""
        ...

    def policy_loss(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, weights: torch.Tensor, ref_logprobs: torch.Tensor | None = None,
                    entropy: torch.Tensor | None = None, *, max_length: int | None = None,
                    normalizer: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """The scalar loss of one micro-batch and its metrics: the names of rlmm/loss_stats.py's
        `PolicyLossStats` (the step combines them over micro-batches as its fields declare)."""
        ...

    # With a critic (`critic` set) the algorithm also provides
    #   value_targets(rewards [B], mask [B, T], values [B, T]) -> returns [B, T]
    #   value_loss(values, old_values, returns, mask, normalizer) -> (loss, metrics: `ValueLossStats` names)
