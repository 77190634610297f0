"""Per-token entropy of the policy, for the entropy metric and the optional entropy bonus."""
from __future__ import annotations

import torch

__all__ = ["per_token_entropy"]


def per_token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy H = -sum_v p_v log p_v of softmax(logits) over the last dim, in float32 (or float64).

    ``logits`` is ``[..., V]`` in any float dtype; the result is ``[...]`` in float32 (float64 stays
    float64), so a bf16 trainer still gets an entropy accurate to fp32. Pass the logits of the
    distribution the policy actually samples from (divided by the temperature, with top-k/top-p
    filtered entries set to -inf, if that is what the sampler does).

    Entries at -inf (masked vocabulary) have p = 0 and contribute exactly 0 to the value and to the
    gradient: ``p * log p`` is evaluated on a copy of log p with those entries replaced by 0, since
    ``0 * -inf`` would be NaN in the forward pass and ``0 * inf`` in the backward one. The float32
    copy of ``[B, T, V]`` logits is large; call this on chunks of positions if memory is tight.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logp = torch.log_softmax(logits.to(dtype), dim=-1)
    p = logp.exp()
    logp_safe = torch.where(p > 0, logp, torch.zeros((), dtype=dtype, device=logp.device))
    return -(p * logp_safe).sum(dim=-1)
