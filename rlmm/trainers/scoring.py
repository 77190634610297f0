"""Trainer-side log-probs of sampled responses, recomputed in micro-batches, and the update loop.

Each micro-batch packs `prompt + response` rows right-padded to the micro-batch's own longest row,
so position ids are the plain 0..L-1 that the sampler used, and padding only follows real tokens
(causal attention never looks at it). Only the logits that predict response tokens are computed
(`logits_to_keep`): prompt positions would cost a full-vocabulary projection each for nothing.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from rlmm.logprobs import mask_logits, token_logprobs
from rlmm.samplers.base import Rollouts, SamplingOptions, pad_right

# forward(input_ids [B, L], attention_mask [B, L], logits_to_keep) -> logits [B, K, V]
ForwardFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
# loss_fn(rows, logprobs [b, T], entropy [b, T]) -> (loss, metrics); rows index the rollouts
LossFn = Callable[[list[int], torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, float]]]
# score(logprobs [len(rows), T]): sees the training forward's detached log-probs before any loss is taken
ScoreFn = Callable[[torch.Tensor], None]


def micro_batches(rows: list[int], size: int) -> list[list[int]]:
    if size < 1:
        raise ValueError(f"trainer.micro_batch_size: must be >= 1, got {size}")
    return [rows[i:i + size] for i in range(0, len(rows), size)]


def response_logprobs(forward: ForwardFn, rollouts: Rollouts, rows: list[int], options: SamplingOptions, pad_id: int,
                      with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[b, T] log π of each response token of `rows` (T = their longest response), and optionally the
    per-token entropy of the same (processed) distribution. Differentiable when grad is enabled."""
    prompts = [rollouts.prompt_ids[i] for i in rows]
    responses = [rollouts.response_ids[i] for i in rows]
    full = [p + r for p, r in zip(prompts, responses)]
    width = max(map(len, full))
    ids = torch.tensor([row + [pad_id] * (width - len(row)) for row in full])
    attention = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in full])
    # Logits at position t predict token t+1: response token j of row i is predicted at
    # len(prompt_i) - 1 + j. Keep enough trailing positions to cover the earliest of them.
    keep = width - min(len(p) for p in prompts) + 1
    logits = forward(ids, attention, keep)  # [b, keep, V]
    offset = width - keep
    length = max(len(r) for r in responses)
    index = torch.zeros(len(rows), length, dtype=torch.long)  # where each response token's logits sit
    tokens = torch.zeros(len(rows), length, dtype=torch.long)
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        first = len(prompt) - 1 - offset
        index[i, :len(response)] = torch.arange(first, first + len(response))
        tokens[i, :len(response)] = torch.tensor(response)
    gathered = logits.gather(1, index.to(logits.device)[..., None].expand(-1, -1, logits.size(-1)))
    logprobs = token_logprobs(gathered, tokens.to(logits.device), options)
    entropy = None
    if with_entropy:
        processed = mask_logits(gathered, options) if options.logprobs == "processed" else gathered.float()
        entropy = torch.special.entr(processed.softmax(-1)).sum(-1)
    return logprobs, entropy


@torch.no_grad()
def score_rollouts(forward: ForwardFn, rollouts: Rollouts, options: SamplingOptions, micro_batch_size: int,
                   pad_id: int) -> torch.Tensor:
    """[B, T] float32 log π_train of each response token, laid out like `rollouts.padded_sampler_logprobs()`."""
    chunks = micro_batches(list(range(len(rollouts))), micro_batch_size)
    return padded_rows(rollouts, chunks, [response_logprobs(forward, rollouts, rows, options, pad_id)[0]
                                          for rows in chunks])


def padded_rows(rollouts: Rollouts, chunks: list[list[int]], logprobs: list[torch.Tensor]) -> torch.Tensor:
    """The micro-batches' [b, T_chunk] log-probs as one detached float32 [rows, T] tensor on the CPU,
    each row cut to its response and right-padded, in the order of `chunks`."""
    return pad_right([lp[:len(rollouts.response_ids[i])].detach().float().cpu()
                      for rows, chunk_logprobs in zip(chunks, logprobs) for i, lp in zip(rows, chunk_logprobs)])[0]


def accumulate_gradients(forward: ForwardFn, backward: Callable[[torch.Tensor], None], rollouts: Rollouts,
                         rows: list[int], options: SamplingOptions, pad_id: int, micro_batch_size: int,
                         loss_fn: LossFn, score: ScoreFn | None = None) -> dict[str, float]:
    """Forward and backward every micro-batch of `rows`; the caller steps the optimizer once after.

    `loss_fn` must normalise each micro-batch's loss by the whole minibatch (e.g. a fixed token
    count), so the accumulated gradient equals the gradient of the minibatch loss.

    `score`: when given, every micro-batch is forwarded first, keeping its graph; `score` gets the
    [len(rows), T] float32 detached log-probs of `rows` (laid out like `score_rollouts`); only then are
    the losses taken and backpropagated. With one PPO epoch over one minibatch the policy being
    updated is the one that scored the rollouts, so this forward doubles as the no-grad scoring pass
    (what it costs: every micro-batch's activations are held at once).
    """
    chunks = micro_batches(rows, micro_batch_size)
    passes = (response_logprobs(forward, rollouts, chunk, options, pad_id, with_entropy=True) for chunk in chunks)
    if score is not None:  # every forward first (backward frees each graph's activations as it goes)
        passes = list(passes)
        score(padded_rows(rollouts, chunks, [logprobs for logprobs, _ in passes]))
    parts = []
    for chunk, (logprobs, entropy) in zip(chunks, passes):
        loss, metrics = loss_fn(chunk, logprobs, entropy)
        backward(loss)
        parts.append(metrics)
    return combine_micro_batches(parts)


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
