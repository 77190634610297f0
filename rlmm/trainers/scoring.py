"""Trainer-side log-probs of sampled responses, recomputed in micro-batches, and one minibatch update.

How rows become micro-batches (a fixed row count, or a token budget) and how a micro-batch is laid out
(right-padded rows, or one padding-free packed row) is rlmm/trainers/packing.py (`MicroBatching`). Padded,
each micro-batch packs `prompt + response` rows right-padded to its own longest row, so position ids are
the plain 0..L-1 that the sampler used, and padding only follows real tokens (causal attention never looks
at it); only the positions that predict response tokens reach the head (`logits_to_keep`). Either way the
head (`rlmm.models.head.OutputHead`, aimed at those positions and tokens) returns log π and entropy chunk
by chunk instead of [b, T, V] logits, so a real vocabulary costs `chunk_size x V` logits at a time, not a
micro-batch's worth.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from rlmm.collectives import any_rank
from rlmm.models.head import OutputHead
from rlmm.trainers.memory import ActivationBudget
from rlmm.trainers.packing import Batch, MicroBatching, micro_batches  # noqa: F401 (micro_batches: re-exported)
from rlmm.samplers.base import Rollouts, SamplingOptions, pad_right

# forward(batch) -> the model output's `logits` field on the batch's kept positions: [rows, kept, 2]
# (log π, entropy) while the head is aimed (see response_logprobs), or a value model's [rows, kept] values
ForwardFn = Callable[[Batch], torch.Tensor]


def model_scores(model: torch.nn.Module, batch: Batch, device: torch.device, value_model: bool) -> torch.Tensor:
    """A backend's forward (`ForwardFn`) on `model` (the module, or the engine that wraps it): the aimed
    `OutputHead`'s [rows, keep, 2] (log π, entropy) of the trailing `batch.keep` positions (0: all), or, for
    a value model (PPO's critic, no LM head), its [rows, keep] values there."""
    inputs = {"input_ids": batch.ids.to(device), "use_cache": False,
              "attention_mask": None if batch.attention is None else batch.attention.to(device),
              "position_ids": None if batch.positions is None else batch.positions.to(device)}
    if value_model:
        return model(**inputs).logits[:, -batch.keep:, 0]  # -0: every position
    return model(**inputs, logits_to_keep=batch.keep).logits


def batch_of(rollouts: Rollouts, rows: list[int], batching: MicroBatching, pad_id: int) -> Batch:
    """The rollout rows `rows` laid out for one forward (`MicroBatching.batch`)."""
    return batching.batch([rollouts.prompt_ids[i] for i in rows], [rollouts.response_ids[i] for i in rows], pad_id)


def row_tokens(rollouts: Rollouts, rows: list[int]) -> list[int]:
    """Tokens (prompt + response) of each of `rows`."""
    return [len(rollouts.prompt_ids[i]) + len(rollouts.response_ids[i]) for i in rows]


def response_logprobs(forward: ForwardFn, head: OutputHead | None, batch: Batch, options: SamplingOptions,
                      with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[b, T] float32 log π of each response token of the micro-batch (T = its longest response) on the
    model's device, and optionally the per-token entropy of the same (processed) distribution.
    Differentiable when grad is enabled. A value model (no LM head, `head` None: the critic) gives V(s_t)
    instead: its scalar output where the policy's logits for token t sit (the state before token t)."""
    rows, length = batch.index.shape
    # Aimed per model row: a packed batch is one row holding every sequence, so its [b, T] index is one
    # [1, b*T] index into that row (padded rows: unchanged).
    index, tokens = batch.index.reshape(batch.ids.size(0), -1), batch.tokens.reshape(batch.ids.size(0), -1)
    if head is None:
        values = forward(batch)  # [rows, kept]
        return values.float().gather(1, index.to(values.device)).view(rows, length), None
    with head.aimed_at(index, tokens, options, entropy=with_entropy):
        scored = forward(batch).view(rows, length, 2)
    return scored[..., 0], scored[..., 1] if with_entropy else None


@torch.no_grad()
def score_rollouts(forward: ForwardFn, head: OutputHead | None, rollouts: Rollouts, options: SamplingOptions,
                   batching: MicroBatching, pad_id: int, rows: list[int] | None = None) -> torch.Tensor:
    """[len(rows), T] float32 log π_train (a value model: V) of each response token of `rows` (default: all,
    in their order) on the CPU, laid out like `rollouts.padded_sampler_logprobs()`. Under a token budget a
    collective (every rank scores together)."""
    rows = list(range(len(rollouts))) if rows is None else rows
    chunks = batching.split(row_tokens(rollouts, rows), rows)
    logprobs = [response_logprobs(forward, head, batch_of(rollouts, chunk, batching, pad_id), options)[0]
                for chunk in chunks]
    return padded_rows(rollouts, chunks, logprobs, order=rows)


def padded_rows(rollouts: Rollouts, chunks: list[list[int]], logprobs: list[torch.Tensor],
                order: list[int] | None = None) -> torch.Tensor:
    """The micro-batches' [b, T_chunk] log-probs as one detached float32 [rows, T] tensor on the CPU, each
    row cut to its response and right-padded, in the order of `order` (default: ascending row index;
    micro-batches under a token budget hold the rows longest first)."""
    by_row = {i: lp[:len(rollouts.response_ids[i])].detach().float().cpu()
              for rows, chunk_logprobs in zip(chunks, logprobs) for i, lp in zip(rows, chunk_logprobs)}
    return pad_right([by_row[i] for i in (sorted(by_row) if order is None else order)])[0]


class MinibatchUpdate:
    """One optimizer step over the minibatch `rows` of some rollouts, as the RL loop drives it:

        update = trainer.begin_update(rollouts, rows)       # gradients zeroed, checkpointing chosen
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

    @property
    def holds_graphs(self) -> bool:
        return not any_rank(not self._graphs_fit(sum(self._tokens)))

    def forward(self, micro_batch: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[b, T] log π and entropy of the micro-batch's response tokens, differentiable (a value model:
        V and None)."""
        return response_logprobs(self._forward, self._head,
                                 batch_of(self.rollouts, micro_batch, self._batching, self._pad_id),
                                 self._options, with_entropy=True)

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self) -> dict[str, float]:
        """Step the optimizer once (or skip a non-finite step); metrics: grad_norm, lr, skipped (1.0 when
        the step was skipped for a fault: a non-finite gradient that is no normal loss-scale overflow),
        and with fp16 loss scaling loss_scale (the scale this step's backward used) and loss_scale_skipped
        (1.0 when the loss scaler skipped the step on an overflow it lowers its scale for; at most one of
        the two is 1; rlmm/trainers/loss_scale.py)."""
        raise NotImplementedError

    def _settled(self) -> None:
        self._budget.settled()


# loss_fn(micro_rows, logprobs [b, T], entropy [b, T]) -> (loss, metrics); rows index the rollouts
LossFn = Callable[[list[int], torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, float]]]


def minibatch_step(trainer, rollouts: Rollouts, rows: list[int], loss_fn: LossFn) -> dict[str, float]:
    """One optimizer step on `rows` with a loss of your own (scripts, tests): the RL loop's update without
    its scoring, correction and algorithm. Returns the loss metrics combined and the step's metrics."""
    update = trainer.begin_update(rollouts, rows)
    parts = []
    for micro in update.micro_batches:
        loss, metrics = loss_fn(micro, *update.forward(micro))
        update.backward(loss)
        parts.append(metrics)
    return {**combine_micro_batches(parts), **update.step()}


def combine_micro_batches(parts: list[dict[str, float]]) -> dict[str, float]:
    """One minibatch's loss metrics from its micro-batches' (`policy_loss`'s names):

    - `loss`, `pg_loss` (each micro-batch's share, already divided by the whole minibatch's normaliser)
      and `num_tokens` add up, so the logged loss is the minibatch's, whatever the micro-batch size;
    - `*_min` / `*_max` are the minimum / maximum over micro-batches (NaN ones, with no kept token, skipped);
    - every other key is a token mean: weighted by each micro-batch's `num_tokens` (by 1 without it).
    """
    combined: dict[str, float] = {}
    for key in parts[0] if parts else ():
        values = [p[key] for p in parts]
        if key in ("loss", "pg_loss", "num_tokens"):
            combined[key] = sum(values)
        elif key.endswith(("_min", "_max")):
            finite = [v for v in values if not math.isnan(v)]
            combined[key] = (min if key.endswith("_min") else max)(finite) if finite else math.nan
        else:
            weights = [p.get("num_tokens", 1) for p in parts]
            kept = [(v, w) for v, w in zip(values, weights) if w and not math.isnan(v)]
            total = sum(w for _, w in kept)
            combined[key] = sum(v * w for v, w in kept) / total if total else math.nan
    return combined
