"""Trainer-side log-probs of sampled responses, recomputed in micro-batches.

Each micro-batch packs `prompt + response` rows right-padded to the micro-batch's own longest row,
so position ids are the plain 0..L-1 that the sampler used, and padding only follows real tokens
(causal attention never looks at it). Only the logits that predict response tokens are computed
(`logits_to_keep`): prompt positions would cost a full-vocabulary projection each for nothing.
"""
from __future__ import annotations

from typing import Callable

import torch

from rlmm.logprobs import token_logprobs
from rlmm.samplers.base import Rollouts, SamplingOptions, pad_right

# forward(input_ids [B, L], attention_mask [B, L], logits_to_keep) -> logits [B, K, V]
ForwardFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


@torch.no_grad()
def score_rollouts(forward: ForwardFn, rollouts: Rollouts, options: SamplingOptions, micro_batch_size: int,
                   pad_id: int) -> torch.Tensor:
    """[B, T] float32 log π_train of each response token, laid out like `rollouts.padded_sampler_logprobs()`."""
    if micro_batch_size < 1:
        raise ValueError(f"trainer.micro_batch_size: must be >= 1, got {micro_batch_size}")
    rows: list[torch.Tensor] = []
    for start in range(0, len(rollouts), micro_batch_size):
        prompts = rollouts.prompt_ids[start:start + micro_batch_size]
        responses = rollouts.response_ids[start:start + micro_batch_size]
        rows.extend(_score_micro_batch(forward, prompts, responses, options, pad_id))
    return pad_right(rows)[0]


def _score_micro_batch(forward, prompts, responses, options, pad_id) -> list[torch.Tensor]:
    full = [p + r for p, r in zip(prompts, responses)]
    width = max(map(len, full))
    ids = torch.tensor([row + [pad_id] * (width - len(row)) for row in full])
    attention = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in full])
    # Logits at position t predict token t+1: response token j of row i is predicted at
    # len(prompt_i) - 1 + j. Keep enough trailing positions to cover the earliest of them.
    keep = width - min(len(p) for p in prompts) + 1
    logits = forward(ids, attention, keep)  # [B, keep, V]
    offset = width - keep
    out = []
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        first = len(prompt) - 1 - offset
        row_logits = logits[i, first:first + len(response)]
        out.append(token_logprobs(row_logits, torch.tensor(response, dtype=torch.long), options))
    return out
