"""The correction interface (the `correction=` config group) and the masked float64 helpers its methods share.

A correction turns the two views of one batch of sampled responses, ``log pi_train`` (recomputed by the trainer)
and ``log pi_sampler`` (reported by the sampler), into what PPO's loss needs to absorb the mismatch between them:

* ``old_logprobs``: the log-probs of the old policy in PPO's ratio pi_theta / pi_old,
* ``weights``: a detached per-token factor on the policy-gradient loss (an importance weight),
* ``mask``: the tokens that still count (the response mask minus rejected tokens or sequences),
* ``metrics``: what the correction did, logged under ``correction/<key>``.

Everything is a function of delta = log pi_train - log pi_sampler (see rlmm/metrics.py): the token ratio
r_t = exp(delta_t), the sequence log-ratio S_i = sum_t delta_t and the geometric-mean log-ratio S_i / |y_i|.
Ratios are computed in float64 (bf16 and fp16 log-probs convert exactly) and the weights cast to float32 at the
end. Padding may hold garbage (inf, nan): it is replaced with ``torch.where`` before any arithmetic, never
multiplied by 0 (``0 * nan`` is nan), so it cannot leak into a sum, a weight or a metric.

Each method is one class in its own module with a ``__call__`` of the signature below, and one YAML in
conf/correction/; nothing else needs to change to add one (docs/corrections.md shows how).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

__all__ = ["Correction", "CorrectionOutput", "METRIC_KEYS", "log_ratios", "finish", "masked_mean", "masked_max",
           "masked_min"]

# Logged by every method (methods may add their own keys on top).
METRIC_KEYS = (
    "ratio_mean",             # mean of r_t over response tokens, before any truncation or masking
    "ratio_min",
    "ratio_max",
    "seq_ratio_max",          # max_i exp(S_i); inf once some S_i > ~709.8 (float64 overflow), not clamped
    "weight_mean",            # mean weight over the tokens that are kept
    "frac_tokens_masked",     # response tokens rejected / response tokens
    "frac_sequences_masked",  # non-empty sequences left with no kept token / non-empty sequences
)


@dataclass
class CorrectionOutput:
    """What a correction hands to the PPO loss; every tensor is ``[B, T]`` and detached.

    Padding positions hold 0 in ``old_logprobs`` and ``weights`` and False in ``mask``.
    """

    old_logprobs: torch.Tensor  # log pi_old in PPO's ratio; the dtype of the input it was taken from
    weights: torch.Tensor  # float32, >= 0: multiplies each token's policy-gradient loss; 0 where ``mask`` is False
    mask: torch.Tensor  # bool: response tokens that still count (input mask AND not rejected)
    metrics: dict[str, float]  # logged under correction/<key>


@runtime_checkable
class Correction(Protocol):
    def __call__(self, train_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                 mask: torch.Tensor) -> CorrectionOutput:
        """Map ``[B, T]`` right-padded trainer and sampler log-probs of the sampled tokens and the bool response
        mask to old log-probs, weights, a mask and metrics."""
        ...


def check_cap(cap: float) -> float:
    """A truncation or rejection cap C: finite and >= 1 (1 turns every up-weight off)."""
    if not (math.isfinite(cap) and cap >= 1.0):
        raise ValueError(f"correction.cap: must be a finite number >= 1, got {cap}")
    return float(cap)


def log_ratios(train_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
               mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(delta, mask)``: float64 delta = log pi_train - log pi_sampler with 0 on padding, and a bool mask.

    Both on ``train_logprobs``' device; raises ValueError unless all three are ``[B, T]`` of one shape.
    """
    if train_logprobs.dim() != 2 or not (train_logprobs.shape == sampler_logprobs.shape == mask.shape):
        raise ValueError(
            "correction: expected train_logprobs, sampler_logprobs and mask of equal shape [B, T], got "
            f"{tuple(train_logprobs.shape)}, {tuple(sampler_logprobs.shape)}, {tuple(mask.shape)}"
        )
    device = train_logprobs.device
    m = mask.to(device) != 0
    lt = train_logprobs.detach().to(torch.float64)
    ls = sampler_logprobs.detach().to(device, torch.float64)
    delta = torch.where(m, lt - ls, torch.zeros((), dtype=torch.float64, device=device))
    return delta, m


def masked_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` where ``m`` (0 / 0 = NaN when ``m`` selects nothing). ``x`` may hold garbage outside ``m``."""
    return torch.where(m, x, 0.0).sum() / m.sum()


def masked_max(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Max of ``x`` where ``m``; NaN when ``m`` selects nothing."""
    if x.numel() == 0:
        return x.new_tensor(math.nan)
    return torch.where(m.any(), torch.where(m, x, -math.inf).amax(), math.nan)


def masked_min(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Min of ``x`` where ``m``; NaN when ``m`` selects nothing."""
    if x.numel() == 0:
        return x.new_tensor(math.nan)
    return torch.where(m.any(), torch.where(m, x, math.inf).amin(), math.nan)


def finish(
    *,
    old_logprobs: torch.Tensor,
    weights: torch.Tensor,
    keep: torch.Tensor,
    delta: torch.Tensor,
    mask: torch.Tensor,
    extra: dict[str, torch.Tensor] | None = None,
) -> CorrectionOutput:
    """Assemble a :class:`CorrectionOutput` and the shared metrics (:data:`METRIC_KEYS`) plus ``extra``.

    Args:
        old_logprobs: the log-probs PPO's ratio should use (trainer's or sampler's), any dtype.
        weights: float64 ``[B, T]`` weights; only their values on kept tokens are used.
        keep: bool ``[B, T]`` (or broadcastable), False for rejected tokens; ANDed with ``mask``.
        delta, mask: as returned by :func:`log_ratios`.
        extra: method-specific 0-dim float64 tensors, logged beside the shared metrics.
    """
    kept = mask & keep
    nonempty = mask.any(dim=1)
    seq = delta.sum(dim=1)  # padding is 0, so this sums response tokens only
    r = delta.exp()
    stats = {
        "ratio_mean": masked_mean(r, mask),
        "ratio_min": masked_min(r, mask),
        "ratio_max": masked_max(r, mask),
        "seq_ratio_max": masked_max(seq, nonempty).exp(),
        "weight_mean": masked_mean(weights, kept),
        "frac_tokens_masked": masked_mean((~kept).double(), mask),
        "frac_sequences_masked": masked_mean((~kept.any(dim=1)).double(), nonempty),
    } | (extra or {})
    # One device->host copy instead of one sync per metric.
    values = torch.stack([v.to(torch.float64) for v in stats.values()]).tolist()
    return CorrectionOutput(
        old_logprobs=torch.where(mask, old_logprobs.detach().to(delta.device), 0.0),
        weights=torch.where(kept, weights.detach().to(torch.float64), 0.0).to(torch.float32),
        mask=kept,
        metrics=dict(zip(stats, values)),
    )
