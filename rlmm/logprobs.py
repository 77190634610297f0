"""Log-probs of chosen tokens from logits, under the sampler's definition (processed or raw).

Processed log-probs follow the order vLLM and transformers both use: divide by the temperature, keep
the top-k logits, keep the smallest set of tokens whose probability mass reaches top-p (sorted
ascending, drop while the cumulative mass is <= 1 - p, always keep the most likely token), then
log_softmax over what is left. Raw log-probs are log_softmax of the logits as they are.
Logits are upcast to fp32 first, as both engines do before their softmax.
"""
from __future__ import annotations

import torch

from rlmm.samplers.base import SamplingOptions


def mask_logits(logits: torch.Tensor, options: SamplingOptions) -> torch.Tensor:
    """Temperature, top-k, top-p applied to fp32 logits [..., V] (masked entries become -inf)."""
    logits = logits.float() / options.temperature
    if options.top_k and options.top_k < logits.size(-1):
        kth = torch.topk(logits, options.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if options.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative <= 1 - options.top_p
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, options: SamplingOptions) -> torch.Tensor:
    """log π(token) for logits [..., V] and tokens [...], under `options.logprobs` semantics."""
    logits = mask_logits(logits, options) if options.logprobs == "processed" else logits.float()
    return logits.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
