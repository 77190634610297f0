"""VCPO's step scaling: the learning rate times the square root of the batch's effective sample size."""
from __future__ import annotations

import math

import torch

from rlmm.corrections.base import BatchView, Correction, StepSize, log_ratios


class EffectiveSampleSizeStep(Correction):
    """The step's learning rate scaled by the sequence weights' effective sample size (``correction=vcpo``).

    With S_i = sum_t delta_{i,t} over each response's tokens, w_i = exp(S_i) = pi_old(y_i) / mu(y_i) (optionally
    min(w_i, cap)), over the B rows with a response token:

        rho = ESS / B = (sum_i w_i)^2 / (B sum_i w_i^2)      in (0, 1], 1 when every w_i is equal,
        lr_step = lr * min(1, rho / rho_target) ** power,

    so a batch that a few heavy-tailed sequences dominate (stale or mismatched rollouts) takes a smaller step;
    AdamW's update does not shrink with a smaller gradient, hence the rate (power 1/2: the square-root rule for
    AdamW-style optimizers). Weights 1, nothing dropped, pi_old the trainer's: stack it with the loss's weight
    (the anchor trains with sequence TIS at 8: ``correction=seq_tis+vcpo correction.stages.seq_tis.cap=8``).

    Source: Huang et al. 2026, "Stable Asynchrony: Variance-Controlled Off-Policy RL for LLMs" (arXiv 2602.17616),
    its ESS-guided step scaling; the anchor is mit-han-lab/vcpo `7a0d4ae` (`staleness_utils.compute_ess_info`:
    w_i the sequence ratio exp(sum_t (log pi_old - log mu)), ESS = (sum w)^2 / (sum w^2 + 1e-8), ratio over the
    minibatch's trajectories; `MegatronPPOActor._optimizer_step_with_buffer`: lr * min(1, ratio /
    base_ess_ratio) ** 0.5 for `scaling_rule: sqrt`, the base rate put back after the step; its defaults
    `base_ess_ratio` 1, `use_clipped` false). Departures: one factor per batch (the anchor's per minibatch: the
    same with one minibatch, rlmm's default); the ESS is computed from exp(S_i - max_j S_j) (the ratio is
    scale-free, so this is exact and never overflows, where the anchor's exp(S_i) is inf beyond ~88 in float32)
    and without the anchor's 1e-8 (its share of sum w^2 >= 1 here is below float64's resolution); rows with no
    response token are left out (the anchor counts every trajectory); the anchor's other half, the closed-form
    off-policy optimal baseline, is an advantage estimator and not here. Logs ``lr_scale`` (the factor) and
    ``ess_ratio`` (rho; 1 when there is no row).

    Args:
        rho_target: rho at and above which the step is the schedule's, in (0, 1] (the anchor's base_ess_ratio).
        power: the exponent of the rule, > 0 (0.5 the anchor's sqrt, 1 its linear).
        cap: null, the raw sequence ratios (the anchor's default); a number C >= 1, the ESS of min(w_i, C) (its
            ``use_clipped`` with the IS threshold C).
    """

    def __init__(self, rho_target: float, power: float, cap: float | None):
        if not 0.0 < rho_target <= 1.0:
            raise ValueError(f"correction.rho_target: must be in (0, 1], got {rho_target}")
        if not (math.isfinite(power) and power > 0.0):
            raise ValueError(f"correction.power: must be a finite number > 0, got {power}")
        if cap is not None and not (math.isfinite(cap) and cap >= 1.0):
            raise ValueError(f"correction.cap: null or a finite number >= 1, got {cap}")
        self.rho_target, self.power, self.cap = float(rho_target), float(power), cap

    def step_size(self, batch: BatchView) -> StepSize:
        rho = ess_ratio(batch.trainer_logprobs, batch.sampler_logprobs, batch.response_mask, self.cap)
        scale = min(1.0, rho / self.rho_target) ** self.power
        return StepSize(scale=scale, metrics={"lr_scale": scale, "ess_ratio": rho})


def ess_ratio(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor,
              cap: float | None = None) -> float:
    """rho = (sum_i w_i)^2 / (B sum_i w_i^2) of the sequence ratios w_i = exp(S_i) (capped at `cap` if given) over
    the B rows of `mask` with a token, in float64 from exp(S_i - max S) (the ratio is unchanged by the shift); 1.0
    with no such row; NaN if some S_i is NaN or +inf."""
    delta, m = log_ratios(trainer_logprobs, sampler_logprobs, mask)
    seq = delta.sum(dim=1)[m.any(dim=1)]  # log w_i
    if seq.numel() == 0:
        return 1.0
    if cap is not None:
        seq = seq.clamp(max=math.log(cap))  # log min(w_i, C)
    w = (seq - seq.max()).exp()  # w_i / max_j w_j: the largest is 1, nothing overflows
    return (w.sum().square() / (seq.numel() * w.square().sum())).item()
