"""Log-probs of chosen tokens from logits, under the sampler's definition (processed or raw).

Processed log-probs follow the order vLLM and transformers both use: divide by the temperature, keep
the top-k logits, keep the smallest set of tokens whose probability mass reaches top-p (sorted
ascending, drop while the cumulative mass is <= 1 - p, always keep the most likely token), then
log_softmax over what is left. Raw log-probs are log_softmax of the logits as they are.
Logits are upcast to fp32 first, as both engines do before their softmax.
"""
from __future__ import annotations

import torch

from rlmm.policy.rollouts import SamplingOptions


def tempered(logits: torch.Tensor, options: SamplingOptions) -> torch.Tensor:
    """fp32 logits / T."""
    logits = logits.float()
    if options.temperature != 1.0:  # x / 1 == x: skip a full-vocabulary copy
        logits = logits / options.temperature
    return logits


def kept_by_truncation(z: torch.Tensor, options: SamplingOptions) -> torch.Tensor:
    """[..., V] bool: the tokens top-k, then top-p keep of tempered logits `z` (all of them with both off)."""
    keep = torch.ones_like(z, dtype=torch.bool)
    if options.top_k and options.top_k < z.size(-1):
        kth = torch.topk(z, options.top_k, dim=-1).values[..., -1:]
        keep = z >= kth
        z = z.masked_fill(~keep, float("-inf"))
    if options.top_p < 1.0:
        sorted_logits, order = torch.sort(z, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative <= 1 - options.top_p
        drop_sorted[..., -1] = False
        keep = keep & ~drop_sorted.scatter(-1, order, drop_sorted)
    return keep


def mask_logits(logits: torch.Tensor, options: SamplingOptions) -> torch.Tensor:
    """Temperature, top-k, top-p applied to fp32 logits [..., V] (masked entries become -inf)."""
    z = tempered(logits, options)
    return z.masked_fill(~kept_by_truncation(z, options), float("-inf")) if options.truncates else z


def sampled_logits(logits: torch.Tensor, options: SamplingOptions) -> torch.Tensor:
    """fp32 logits of the distribution `options.logprobs` refers to: processed (temperature, top-k,
    top-p) or raw."""
    return mask_logits(logits, options) if options.logprobs == "processed" else logits.float()


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, options: SamplingOptions) -> torch.Tensor:
    """log π(token) = z_token - logsumexp(z) for logits [..., V] and tokens [...], under `options.logprobs`
    semantics (gathered before the normalisation: no [..., V] log-softmax is built)."""
    z = sampled_logits(logits, options)
    return z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - z.logsumexp(-1)
