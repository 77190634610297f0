"""Trainer-side log-probs of sampled responses, recomputed in micro-batches, and one minibatch update.

Each micro-batch packs `prompt + response` rows right-padded to the micro-batch's own longest row,
so position ids are the plain 0..L-1 that the sampler used, and padding only follows real tokens
(causal attention never looks at it). Only the positions that predict response tokens reach the head
(`logits_to_keep`), and the head (`rlmm.models.head.OutputHead`, aimed at those positions and tokens)
returns log π and entropy chunk by chunk instead of [b, T, V] logits, so a real vocabulary costs
`chunk_size x V` logits at a time, not a micro-batch's worth.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from rlmm.models.head import OutputHead
from rlmm.trainers.memory import ActivationBudget
from rlmm.samplers.base import Rollouts, SamplingOptions, pad_right

# forward(input_ids [B, L], attention_mask [B, L], logits_to_keep) -> the model output's `logits` field,
# which is [B, T, 2] (log π, entropy) while the head is aimed (see response_logprobs)
ForwardFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def micro_batches(rows: list[int], size: int) -> list[list[int]]:
    if size < 1:
        raise ValueError(f"trainer.micro_batch_size: must be >= 1, got {size}")
    return [rows[i:i + size] for i in range(0, len(rows), size)]


def micro_batch_tokens(rollouts: Rollouts, rows: list[int], size: int) -> list[int]:
    """Tokens (prompt + response) in each micro-batch of `rows`: what its activations scale with."""
    return [sum(len(rollouts.prompt_ids[i]) + len(rollouts.response_ids[i]) for i in chunk)
            for chunk in micro_batches(rows, size)]


def model_scores(model: torch.nn.Module, ids: torch.Tensor, attention: torch.Tensor, keep: int,
                 device: torch.device, value_model: bool) -> torch.Tensor:
    """A backend's forward (`ForwardFn`) on `model` (the module, or the engine that wraps it): the aimed
    `OutputHead`'s [b, keep, 2] (log π, entropy) of the trailing `keep` positions, or, for a value model
    (PPO's critic, no LM head), its [b, keep] values there."""
    ids, attention = ids.to(device), attention.to(device)
    if value_model:
        return model(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, -keep:, 0]
    return model(input_ids=ids, attention_mask=attention, logits_to_keep=keep, use_cache=False).logits


def packed(rollouts: Rollouts, rows: list[int], pad_id: int) -> tuple[torch.Tensor, ...]:
    """`rows` as one right-padded batch: ids and attention mask [b, L], `keep` (the trailing positions that
    predict a response token), and [b, T] `index` into those positions and `tokens` (the response tokens)."""
    prompts = [rollouts.prompt_ids[i] for i in rows]
    responses = [rollouts.response_ids[i] for i in rows]
    full = [p + r for p, r in zip(prompts, responses)]
    width = max(map(len, full))
    ids = torch.tensor([row + [pad_id] * (width - len(row)) for row in full])
    attention = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in full])
    # Logits at position t predict token t+1: response token j of row i is predicted at
    # len(prompt_i) - 1 + j. Keep enough trailing positions to cover the earliest of them.
    keep = width - min(len(p) for p in prompts) + 1
    offset = width - keep
    length = max(len(r) for r in responses)
    index = torch.zeros(len(rows), length, dtype=torch.long)  # where each response token's logits sit
    tokens = torch.zeros(len(rows), length, dtype=torch.long)
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        first = len(prompt) - 1 - offset
        index[i, :len(response)] = torch.arange(first, first + len(response))
        tokens[i, :len(response)] = torch.tensor(response)
    return ids, attention, keep, index, tokens


def response_logprobs(forward: ForwardFn, head: OutputHead | None, rollouts: Rollouts, rows: list[int],
                      options: SamplingOptions, pad_id: int,
                      with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[b, T] float32 log π of each response token of `rows` (T = their longest response) on the model's
    device, and optionally the per-token entropy of the same (processed) distribution. Differentiable
    when grad is enabled. A value model (no LM head, `head` None: the critic) gives V(s_t) instead: its
    scalar output where the policy's logits for token t sit (the state before token t)."""
    ids, attention, keep, index, tokens = packed(rollouts, rows, pad_id)
    if head is None:
        values = forward(ids, attention, keep)  # [b, keep]
        return values.float().gather(1, index.to(values.device)), None
    with head.aimed_at(index, tokens, options, entropy=with_entropy):
        scored = forward(ids, attention, keep)  # [b, T, 2]
    return scored[..., 0], scored[..., 1] if with_entropy else None


@torch.no_grad()
def score_rollouts(forward: ForwardFn, head: OutputHead | None, rollouts: Rollouts, options: SamplingOptions,
                   micro_batch_size: int, pad_id: int, rows: list[int] | None = None) -> torch.Tensor:
    """[len(rows), T] float32 log π_train (a value model: V) of each response token of `rows` (default: all)
    on the CPU, laid out like `rollouts.padded_sampler_logprobs()`."""
    chunks = micro_batches(list(range(len(rollouts))) if rows is None else rows, micro_batch_size)
    return padded_rows(rollouts, chunks, [response_logprobs(forward, head, rollouts, chunk, options, pad_id)[0]
                                          for chunk in chunks])


def padded_rows(rollouts: Rollouts, chunks: list[list[int]], logprobs: list[torch.Tensor]) -> torch.Tensor:
    """The micro-batches' [b, T_chunk] log-probs as one detached float32 [rows, T] tensor on the CPU,
    each row cut to its response and right-padded, in the order of `chunks`."""
    return pad_right([lp[:len(rollouts.response_ids[i])].detach().float().cpu()
                      for rows, chunk_logprobs in zip(chunks, logprobs) for i, lp in zip(rows, chunk_logprobs)])[0]


class MinibatchUpdate:
    """One optimizer step over the minibatch `rows` of some rollouts, as the RL loop drives it:

        update = trainer.begin_update(rollouts, rows)       # gradients zeroed, checkpointing chosen
        for micro in update.micro_batches:
            logprobs, entropy = update.forward(micro)        # [b, T] each, with grad
            update.backward(loss_of(micro, logprobs, entropy))
        metrics = update.step()                              # clip, step (or skip a non-finite one)

    The loss of each micro-batch must be normalised by the whole minibatch (e.g. its kept tokens), so the
    accumulated gradient is the gradient of the minibatch's loss. `holds_graphs`: whether every micro-batch
    may be forwarded before the first backward (their graphs held at once), which lets the loop take the
    old policy's log-probs from these forwards (one epoch of one minibatch). An update that is never
    stepped (the step found a fault) changes nothing but the gradients it zeroed.

    A backend subclasses it with its `backward` and `step`; the forward is the same for all.
    """

    def __init__(self, forward: ForwardFn, head: OutputHead | None, rollouts: Rollouts, rows: list[int],
                 options: SamplingOptions, pad_id: int, micro_batch_size: int, budget: ActivationBudget,
                 model: torch.nn.Module):
        self.rollouts, self.rows = rollouts, rows
        self.micro_batches = micro_batches(rows, micro_batch_size)
        self._forward, self._head, self._options, self._pad_id = forward, head, options, pad_id
        self._budget = budget
        self._tokens = micro_batch_tokens(rollouts, rows, micro_batch_size)
        self._graphs_fit = budget.for_update(model, self._tokens)

    @property
    def holds_graphs(self) -> bool:
        return self._graphs_fit(sum(self._tokens))

    def forward(self, micro_batch: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[b, T] log π and entropy of the micro-batch's response tokens, differentiable (a value model:
        V and None)."""
        return response_logprobs(self._forward, self._head, self.rollouts, micro_batch, self._options, self._pad_id,
                                 with_entropy=True)

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self) -> dict[str, float]:
        """Step the optimizer once (or skip a non-finite step); metrics: grad_norm, lr, skipped (1.0 when
        the step was skipped), loss_scale (fp16)."""
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
