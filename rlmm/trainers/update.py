"""One optimizer step over a minibatch, in micro-batches: the part every trainer backend shares
(`MicroBatchedUpdate`, which satisfies rlmm/run/interfaces.py's `MinibatchUpdate`), and `minibatch_step`, that
update driven with a loss of your own.

The forward of each micro-batch is the scoring forward with grad (rlmm/trainers/scoring.py); a backend adds
its `backward` and `step`.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from rlmm.models.head import OutputHead
from rlmm.policy.rollouts import Rollouts, SamplingOptions
from rlmm.runtime.collectives import any_rank
from rlmm.trainers.memory import ActivationBudget
from rlmm.trainers.packing import MicroBatching
from rlmm.trainers.scoring import ForwardFn, batch_of, response_logprobs, row_tokens


class MicroBatchedUpdate:
    """One optimizer step over the minibatch `rows` of some rollouts, as the RL loop drives it:

        update = trainer.begin_update(rollouts, rows)       # gradients zeroed, checkpointing chosen
        update.scale_lr(factor)                              # (optional) this step's rate: the schedule's x factor
        for micro in update.micro_batches:
            logprobs, entropy = update.forward(micro)        # [b, T] each, with grad
            update.backward(loss_of(micro, logprobs, entropy))
        metrics = update.step()                              # clip, step (or skip a non-finite one)

    The loss of each micro-batch must be normalised by the whole minibatch (e.g. its kept tokens), so the
    accumulated gradient is the gradient of the minibatch's loss, however the rows are grouped (a fixed row
    count or a token budget, rlmm/trainers/packing.py; under a budget the ranks agree on the count).
    `holds_graphs`: whether every micro-batch may be forwarded before the first backward (their graphs held
    at once), which lets the loop take the old policy's log-probs from these forwards (one epoch of one
    minibatch); every rank gets the same answer, so all take the same path. An update that is never
    stepped (the step found a fault) changes nothing but the gradients it zeroed.

    A backend subclasses it with its `backward` and `step`; the forward is the same for all.
    """

    def __init__(self, forward: ForwardFn, head: OutputHead | None, rollouts: Rollouts, rows: list[int],
                 options: SamplingOptions, pad_id: int, batching: MicroBatching, budget: ActivationBudget,
                 model: torch.nn.Module):
        self.rollouts, self.rows = rollouts, rows
        self.micro_batches = batching.split(row_tokens(rollouts, rows), rows)
        self._forward, self._head, self._options, self._pad_id = forward, head, options, pad_id
        self._batching, self._budget = batching, budget
        # Positions each micro-batch's forward computes (padding included): what its activations scale with.
        self._tokens = [batching.positions(row_tokens(rollouts, micro)) for micro in self.micro_batches]
        self._graphs_fit = budget.for_update(model, self._tokens)
        self.lr_scale = 1.0  # `scale_lr`: this step's factor on the schedule's learning rate

    @property
    def holds_graphs(self) -> bool:
        return not any_rank(not self._graphs_fit(sum(self._tokens)))

    def forward(self, micro_batch: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[b, T] log π and entropy of the micro-batch's response tokens, differentiable (a value model:
        V and None)."""
        return response_logprobs(self._forward, self._head,
                                 batch_of(self.rollouts, micro_batch, self._batching, self._pad_id),
                                 self._options, with_entropy=True)

    def scale_lr(self, factor: float) -> None:
        """Step at the schedule's learning rate times `factor` (finite, >= 0; 1 unless called): this optimizer step
        only, the schedule untouched (rlmm/trainers/optim.py::scaled_lr). Call it before the first `backward`
        (DeepSpeed steps inside the last one). The RL step passes its correction's `step_size`."""
        if not (math.isfinite(factor) and factor >= 0.0):
            raise ValueError(f"a correction's step scale must be finite and >= 0, got {factor}")
        self.lr_scale = float(factor)

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self) -> dict[str, float]:
        """Step the optimizer once (or skip a non-finite step); metrics: grad_norm, lr (the rate this step used: the
        schedule's x `lr_scale`), skipped (1.0 when
        the step was skipped for a fault: a non-finite gradient that is no normal loss-scale overflow),
        and with fp16 loss scaling loss_scale (the scale this step's backward used) and loss_scale_skipped
        (1.0 when the loss scaler skipped the step on an overflow it lowers its scale for; at most one of
        the two is 1; rlmm/trainers/loss_scale.py)."""
        raise NotImplementedError

    def _settled(self) -> None:
        self._budget.settled()


# loss_fn(micro_rows, logprobs [b, T], entropy [b, T]) -> (loss, metrics); rows index the rollouts; each metric
# is the micro-batch's share of the minibatch's (as the loss is), so the minibatch's is their sum
LossFn = Callable[[list[int], torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, float]]]


def minibatch_step(trainer, rollouts: Rollouts, rows: list[int], loss_fn: LossFn) -> dict[str, float]:
    """One optimizer step on `rows` with a loss of your own (scripts, tests): the RL loop's update without
    its scoring, correction and algorithm. Returns the loss function's metrics summed over the micro-batches
    (the RL step's typed loss statistics are rlmm/mismatch/loss_stats.py) and the step's metrics."""
    update = trainer.begin_update(rollouts, rows)
    parts = []
    for micro in update.micro_batches:
        loss, metrics = loss_fn(micro, *update.forward(micro))
        update.backward(loss)
        parts.append(metrics)
    return {**{key: sum(part[key] for part in parts) for key in (parts[0] if parts else ())}, **update.step()}

