"""Trainer-side log-probs of sampled responses, recomputed in micro-batches.

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

from typing import Callable

import torch

from rlmm.mismatch.layer_attribution import layer_states_of
from rlmm.mismatch.routing import routed_forward
from rlmm.models.head import OutputHead
from rlmm.policy.rollouts import KeptTokens, Rollouts, SamplingOptions, pad_right
from rlmm.trainers.packing import Batch, MicroBatching

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
    if value_model:  # the critic routes every token itself (docs/routing.md)
        return model(**inputs).logits[:, -batch.keep:, 0]  # -0: every position
    with routed_forward(model, batch, device) as replay, layer_states_of(model, batch):
        return model(**inputs, **replay, logits_to_keep=batch.keep).logits


def batch_of(rollouts: Rollouts, rows: list[int], batching: MicroBatching, pad_id: int) -> Batch:
    """The rollout rows `rows` laid out for one forward (`MicroBatching.batch`), with the experts to replay
    when the rollouts carry them (`Rollouts.replayed_experts`: the routing replay of rlmm/mismatch/routing.py)."""
    routing = None if rollouts.replayed_experts is None else [rollouts.replayed_experts[i] for i in rows]
    batch = batching.batch([rollouts.prompt_ids[i] for i in rows], [rollouts.response_ids[i] for i in rows], pad_id,
                           routing)
    kept = None if rollouts.kept_tokens is None else \
        KeptTokens.laid_out([rollouts.kept_tokens[i] for i in rows], batch.index.size(1))
    return batch._replace(rows=tuple(rows), kept=kept)


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
    with head.aimed_at(index, tokens, options, entropy=with_entropy, kept=batch.kept, rows=batch.rows):
        scored = forward(batch).view(rows, length, 2)
    return scored[..., 0], scored[..., 1] if with_entropy else None


@torch.no_grad()
def score_rollouts(forward: ForwardFn, head: OutputHead | None, rollouts: Rollouts, options: SamplingOptions,
                   batching: MicroBatching, pad_id: int, rows: list[int] | None = None) -> torch.Tensor:
    """[len(rows), T] float32 log π_train (a value model: V) of each response token of `rows` (default: all,
    in their order) on the CPU, laid out like `rollouts.padded_sampler_logprobs()`. Under a token budget a
    collective (every rank scores together)."""
    return _scored(forward, head, rollouts, options, batching, pad_id, rows, with_entropy=False)[0]


@torch.no_grad()
def score_with_entropy(forward: ForwardFn, head: OutputHead, rollouts: Rollouts, options: SamplingOptions,
                       batching: MicroBatching, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`score_rollouts` of every row, and the [B, T] float32 entropy H_t of the same forward's distribution at each
    response position (the one the log-probs are of: processed or raw, over the trainer's support; 0 past each
    response). The log-probs are those `score_rollouts` gives, to the bit: the head computes H_t beside them."""
    if head is None:
        raise ValueError("score_with_entropy: a value model (no LM head) has no entropy")
    logprobs, entropy = _scored(forward, head, rollouts, options, batching, pad_id, None, with_entropy=True)
    return logprobs, entropy


def _scored(forward: ForwardFn, head: OutputHead | None, rollouts: Rollouts, options: SamplingOptions,
            batching: MicroBatching, pad_id: int, rows: list[int] | None, with_entropy: bool) -> list[torch.Tensor]:
    """[log π] or [log π, H] of `rows` (default: all), each [len(rows), T] on the CPU (`padded_rows`)."""
    rows = list(range(len(rollouts))) if rows is None else rows
    chunks = batching.split(row_tokens(rollouts, rows), rows)
    scored = [response_logprobs(forward, head, batch_of(rollouts, chunk, batching, pad_id), options, with_entropy)
              for chunk in chunks]
    return [padded_rows(rollouts, chunks, [pair[k] for pair in scored], order=rows) for k in range(1 + with_entropy)]


def padded_rows(rollouts: Rollouts, chunks: list[list[int]], logprobs: list[torch.Tensor],
                order: list[int] | None = None) -> torch.Tensor:
    """The micro-batches' [b, T_chunk] log-probs as one detached float32 [rows, T] tensor on the CPU, each
    row cut to its response and right-padded, in the order of `order` (default: ascending row index;
    micro-batches under a token budget hold the rows longest first)."""
    by_row = {i: lp[:len(rollouts.response_ids[i])].detach().float().cpu()
              for rows, chunk_logprobs in zip(chunks, logprobs) for i, lp in zip(rows, chunk_logprobs)}
    return pad_right([by_row[i] for i in (sorted(by_row) if order is None else order)])[0]
