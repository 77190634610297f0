"""The policy loss every algorithm of rlmm/algos/ calls (a component, not a base class), and its objectives.

The per-token term is an `Objective`, a strategy the algorithm's YAML names in its `objective:` node
(`_target_` and the objective's own settings): `ClippedSurrogate` (PPO's, with its dual clip) or `CISPO`. Each
owns its formula, the checks of its clip range and which tokens its clip fractions count. `SurrogateLoss` adds
the mismatch correction's weights, the KL penalty and the entropy bonus, aggregates over the kept tokens and
returns the metrics. An algorithm holds one (`self.loss`), built with its importance ratio, as its
`policy_loss`: per token (`token_ratio`: GRPO, DAPO, PPO) or per sequence (GSPO's `sequence_ratio`). The
equations are in rlmm/algos/grpo.py's docstring and docs/algorithms.md.
"""
from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from rlmm.mismatch.kl import ESTIMATORS, k3, kl_estimate

__all__ = ["AGGREGATIONS", "CISPO", "METRIC_KEYS", "ClippedSurrogate", "Objective", "SurrogateLoss", "token_ratio"]



def _token_rows(per_token: Tensor, m: Tensor) -> Tensor:
    return per_token


def _sequence_rows(per_token: Tensor, m: Tensor) -> Tensor:
    return per_token.sum(dim=1) / m.sum(dim=1).clamp_min(1)  # each sequence's token mean; empty ones give 0


def _kept_tokens(m: Tensor, max_length: int | None) -> Tensor | int:
    return m.sum().clamp_min(1)


def _sequences(m: Tensor, max_length: int | None) -> Tensor | int:
    return m.any(dim=1).sum().clamp_min(1)


def _rows_times_length(m: Tensor, max_length: int | None) -> Tensor | int:
    batch, width = m.shape
    return max(batch * (max_length if max_length is not None else width), 1)


class Aggregation(Enum):
    """`algo.loss_aggregation`: how a micro-batch's masked per-token terms become the loss, sum(rows(x)) / divisor
    (rlmm/algos/grpo.py's docstring): token (sum over the kept tokens / their number: DAPO), sequence (each
    sequence's token mean, summed / the non-empty sequences: GRPO's paper) or constant (sum over the kept tokens /
    B * L: Dr.GRPO)."""

    # (what is summed of a [B, T] term, the divisor of a [B, T] mask and L)
    token = (_token_rows, _kept_tokens)
    sequence = (_sequence_rows, _sequences)
    constant = (_token_rows, _rows_times_length)

    def __init__(self, rows, divisor):
        self.rows, self.divisor = rows, divisor


AGGREGATIONS = tuple(Aggregation.__members__)

# Always returned by the loss; "kl" is added when ref_logprobs is given, "entropy" when entropy is.
METRIC_KEYS = (
    "loss",
    "pg_loss",
    "approx_kl",
    "ppo_kl",
    "clipfrac",
    "clipfrac_low",
    "clipfrac_high",
    "ratio_mean",
    "ratio_min",
    "ratio_max",
    "num_tokens",
)

RatioFn = Callable[[Tensor, Tensor], Tensor]  # masked [B, T] log-ratios and mask -> [B, T] ratio


def token_ratio(logratio: Tensor, mask: Tensor) -> Tensor:
    """Each token's own ratio pi_theta / pi_old = exp(logratio) (PPO's)."""
    return logratio.exp()


@runtime_checkable
class Objective(Protocol):
    """The per-token policy-gradient term that `SurrogateLoss` weights, aggregates and reports (`algo.objective`, a
    node whose `_target_` names the class): its formula, the checks of its own settings, and the tokens its clip
    acts on. `ratio` is the importance ratio the algorithm's loss gives (per token, or GSPO's per sequence),
    `advantages` broadcasts against it ([B, 1] or [B, T]), `logprobs` is the differentiable log pi_theta; padding
    is 0 in all three."""

    clip_low: float
    clip_high: float

    def per_token(self, logprobs: Tensor, ratio: Tensor, advantages: Tensor) -> Tensor:
        """[B, T] loss term pg_t (before the correction's weights and the aggregation)."""

    def clipped(self, ratio: Tensor, advantages: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """[B, T] bool: the kept tokens the clip's lower and upper bound act on (logged as clipfrac_low and
        clipfrac_high, their union as clipfrac), and any further such set under its metric's name."""


class ClippedSurrogate:
    """PPO's clipped surrogate with a decoupled clip range, and PPO's dual clip for A < 0 when asked:

        pg_t = -min(ratio_t * A_t, clip(ratio_t, 1 - clip_low, 1 + clip_high) * A_t)
             =  max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - clip_low, 1 + clip_high))
        dual clip c:  pg_t = min(pg_t, -c * A_t)  where A_t < 0

    Sources: Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (eq. 7, one epsilon); Yu et al.
    2025, "DAPO" (clip-higher: epsilon_low and epsilon_high apart); Ye et al. 2020, "Mastering Complex Control in
    MOBA Games with Deep Reinforcement Learning" (the dual clip; verl's `clip_ratio_c`, 3 by default there): a token
    whose ratio grew far above 1 under a negative advantage stops pushing its probability down without bound;
    tokens with A >= 0 are unchanged. Without the dual clip (null, the default) nothing clamps the ratio: for A < 0
    the term is unbounded in ratio, as in PPO.

    Args:
        clip_low: epsilon_low; ratios below 1 - clip_low stop pushing down tokens with A < 0; in (0, 1] (1: no
            lower bound).
        clip_high: epsilon_high; ratios above 1 + clip_high stop pushing up tokens with A > 0; > 0 (inf: none).
        dual_clip: c > 1, or None (off).

    Its clip fractions count the tokens whose gradient the clip removes; clipfrac_dual (only with the dual clip)
    those the dual clip bounds.
    """

    def __init__(self, clip_low: float, clip_high: float, dual_clip: float | None):
        if not 0 < clip_low <= 1:
            raise ValueError(f"algo.objective.clip_low: must be in (0, 1] (1: no lower bound), got {clip_low}")
        if not clip_high > 0:
            raise ValueError(f"algo.objective.clip_high: must be > 0, got {clip_high}")
        if dual_clip is not None and not dual_clip > 1:
            raise ValueError(f"algo.objective.dual_clip: must be > 1 or null (off), got {dual_clip}")
        self.clip_low, self.clip_high, self.dual_clip = float(clip_low), float(clip_high), dual_clip

    def per_token(self, logprobs: Tensor, ratio: Tensor, advantages: Tensor) -> Tensor:
        pg = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - self.clip_low, 1 + self.clip_high))
        if self.dual_clip is None:
            return pg
        return torch.where(advantages < 0, torch.minimum(pg, -self.dual_clip * advantages), pg)

    def clipped(self, ratio: Tensor, advantages: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        low = mask & (advantages < 0) & (ratio < 1 - self.clip_low)
        high = mask & (advantages > 0) & (ratio > 1 + self.clip_high)
        if self.dual_clip is None:
            return low, high, {}
        return low, high, {"clipfrac_dual": mask & (advantages < 0) & (ratio > self.dual_clip)}

    def __repr__(self) -> str:
        return f"ClippedSurrogate(clip=[{1 - self.clip_low:g}, {1 + self.clip_high:g}], dual_clip={self.dual_clip})"


class CISPO:
    """CISPO's per-token loss (MiniMax 2025, "MiniMax-M1", eq. 4): the importance-sampling weight clipped and
    detached, times the REINFORCE term,

        pg_t = -sg(clip(ratio_t, 1 - clip_low, 1 + clip_high)) * A_t * log pi_theta(y_t),

    so the clip bounds a token's weight but never removes its gradient (PPO's clip zeroes it). Its gradient is
    -sg(clip(r)) * A * grad log pi, which at r inside the range is PPO's. No dual clip: there is no clip to bound.

    Args:
        clip_low: the weight's floor is 1 - clip_low; in [0, 1] (1: no lower bound; 0 with clip_high 0 holds the
            weight at 1: REINFORCE).
        clip_high: the weight's cap is 1 + clip_high, > 0 and at least the floor. A cap on a weight, not a clip
            range around 1, so it may be below 1 (clip_high in (-1, 0]): TRL's CISPO caps at an absolute
            epsilon_high, 0.2 by default (`GRPOTrainer._compute_loss`: ``clamp(coef_1, max=epsilon_high)``), here
            ``clip_low 1, clip_high epsilon_high - 1``.

    Its clip fractions count the tokens whose weight the clip bounds (their gradient stays).
    """

    def __init__(self, clip_low: float, clip_high: float):
        if not 0 <= clip_low <= 1:
            raise ValueError(f"algo.objective.clip_low: must be in [0, 1] (1: no lower bound), got {clip_low}")
        if not 1 + clip_high > 0:
            raise ValueError(f"algo.objective.clip_high: CISPO's cap 1 + clip_high must be > 0, got clip_high "
                             f"{clip_high}")
        if not 1 - clip_low <= 1 + clip_high:
            raise ValueError(f"algo.objective.clip_high: CISPO's range [1 - clip_low, 1 + clip_high] is empty: "
                             f"[{1 - clip_low:g}, {1 + clip_high:g}]")
        self.clip_low, self.clip_high = float(clip_low), float(clip_high)

    def per_token(self, logprobs: Tensor, ratio: Tensor, advantages: Tensor) -> Tensor:
        return -ratio.detach().clamp(1 - self.clip_low, 1 + self.clip_high) * advantages * logprobs

    def clipped(self, ratio: Tensor, advantages: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        return mask & (ratio < 1 - self.clip_low), mask & (ratio > 1 + self.clip_high), {}

    def __repr__(self) -> str:
        return f"CISPO(weight in [{1 - self.clip_low:g}, {1 + self.clip_high:g}])"


class SurrogateLoss:
    """The policy loss of one micro-batch: the objective's per-token term with the correction's weights, the
    penalties, the aggregation and the metrics.

    Args:
        objective: the per-token term (`ClippedSurrogate`: PPO's clipped surrogate, with its dual clip; `CISPO`: the
            clipped ratio as a detached weight on A * log pi_theta), built from ``algo.objective``'s node.
        loss_aggregation: "token", "sequence" or "constant" (rlmm/algos/grpo.py's docstring).
        kl_coef: weight of the KL penalty to the reference policy; 0 turns it off.
        kl_estimator: "k1", "k2" or "k3" (rlmm/mismatch/kl.py), per token, of KL(pi_theta || pi_ref).
        entropy_coef: weight of the entropy bonus (subtracted from the loss); 0 turns it off.
        count_rejected: whether the tokens a correction rejected still count in the loss's divisor (AReaL's
            rejection sampling, slime, TRL, prime-rl, SkyRL, NeMo-RL: a rejected token loses its gradient, the
            others keep their per-token step) or not (False: verl's decoupled mode, ROLL; rlmm's default since it
            began). Either way the tokens a correction drops inside the update (OPSM, tv_trust) stay in it: the
            divisor is fixed before the update's forwards.
        ratio: the importance ratio the objective acts on, from the masked ``[B, T]`` log-ratios and the mask
            (``token_ratio``; GSPO's ``sequence_ratio``).

    An algorithm's `policy_loss` and `loss_normalizer` are this object's `__call__` and `normalizer`.
    """

    def __init__(self, objective: Objective, loss_aggregation: str, kl_coef: float, kl_estimator: str,
                 entropy_coef: float, count_rejected: bool, ratio: RatioFn = token_ratio):
        if not isinstance(objective, Objective):  # `algo.objective=cispo`, the spelling before issue 51, gives a str
            raise ValueError(f"algo.objective: {objective!r} is not a loss objective: it is a node naming its class "
                             f"(CISPO: algo=cispo; the clip range: algo.objective.clip_low=..., "
                             f"algo.objective.clip_high=...)")
        if loss_aggregation not in AGGREGATIONS:
            raise ValueError(
                f"algo.loss_aggregation: unknown mode '{loss_aggregation}' (allowed: {', '.join(AGGREGATIONS)})")
        if not kl_coef >= 0:
            raise ValueError(f"algo.kl_coef: must be >= 0, got {kl_coef}")
        if kl_estimator not in ESTIMATORS:
            raise ValueError(
                f"algo.kl_estimator: unknown estimator '{kl_estimator}' (allowed: {', '.join(ESTIMATORS)})")
        if not entropy_coef >= 0:
            raise ValueError(f"algo.entropy_coef: must be >= 0, got {entropy_coef}")
        self.objective = objective
        self.loss_aggregation = loss_aggregation
        self.aggregation = Aggregation[loss_aggregation]
        self.kl_coef = float(kl_coef)
        self.kl_estimator = kl_estimator
        self.entropy_coef = float(entropy_coef)
        self.count_rejected = bool(count_rejected)
        self.ratio = ratio

    def normalizer(self, mask: Tensor, max_length: int | None = None, response_mask: Tensor | None = None) -> float:
        """The divisor the loss uses for this mask: kept tokens (token), non-empty sequences (sequence) or
        B * L (constant); with `count_rejected`, of `response_mask` (the sampled tokens, before any correction
        rejected some) instead.

        When the RL loop splits one minibatch into micro-batches for gradient accumulation, compute
        this once on the whole minibatch's mask and pass it as ``normalizer`` to every micro-batch's
        loss: the summed micro-batch losses then equal the whole minibatch's loss in every mode (do not
        also divide by the number of micro-batches).
        """
        counted = response_mask if self.count_rejected and response_mask is not None else mask
        return float(self.denominator(counted != 0, max_length))

    def denominator(self, m: Tensor, max_length: int | None) -> Tensor | int:
        width = m.shape[1]
        if max_length is not None and not max_length >= max(width, 1):
            raise ValueError(f"policy_loss: max_length {max_length} is less than the padded width {width}")
        return self.aggregation.divisor(m, max_length)

    def __call__(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, weights: Tensor,
                 ref_logprobs: Tensor | None = None, entropy: Tensor | None = None, *,
                 max_length: int | None = None, normalizer: float | None = None,
                 penalty: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, dict[str, float]]:
        """Scalar loss to minimise, and its metrics as plain Python numbers.

        Args:
            logprobs: ``[B, T]`` log pi_theta of each response token (requires grad).
            old_logprobs: ``[B, T]`` log pi_old of the same tokens (detached here).
            advantages: ``[B]`` one advantage per sequence, broadcast over its tokens, or ``[B, T]`` one
                per token (PPO with a critic).
            mask: ``[B, T]`` bool or 0/1, true on the response tokens that count.
            weights: ``[B, T]`` per-token importance weights from the correction (1 = none; detached).
            ref_logprobs: ``[B, T]`` log pi_ref, required when kl_coef > 0; if given with kl_coef 0
                only the ``kl`` metric is computed.
            entropy: ``[B, T]`` per-token entropy (see ``per_token_entropy``), required when
                entropy_coef > 0; if given with entropy_coef 0 only the ``entropy`` metric is computed.
            max_length: L for "constant" aggregation, normally ``sampling.max_new_tokens``, so that the
                divisor does not depend on the longest response of the batch (defaults to T).
            normalizer: divisor replacing the one of this batch (see ``normalizer``).
            penalty: a correction's per-token loss term of the differentiable log pi_theta (rlmm/corrections/base.py's
                `InUpdate.penalty`: zero where it does not apply), summed over tokens and divided by the loss's
                divisor (token-level, whatever the aggregation); logged as ``penalty``. Not masked with `mask`: the
                penalty reaches the tokens its correction dropped (tv_trust's, over the loss mask as prime-rl's
                `kl_tau` term in `trainer/rl/loss.py`), so the penalty itself is 0 where it does not apply.

        Loss = agg(w_t * pg_t + kl_coef * k_t - entropy_coef * H_t) + sum_t penalty_t / divisor, with pg_t the
        objective's `per_token` (`ClippedSurrogate`, `CISPO`) and agg the configured aggregation. Padding positions are replaced by 0 with ``torch.where``
        before any arithmetic, so inf/NaN there reach neither the loss nor the gradient. The loss is float32 (float64
        for float64 inputs). Metrics (docs/algorithms.md): ``loss``, ``pg_loss`` (the aggregated pg
        term, including weights), token means over kept tokens of ``kl``, ``entropy``,
        ``approx_kl`` = mean(ratio - 1 - logratio), ``ppo_kl`` = mean(-logratio) (verl's ``actor/ppo_kl``, k1 of
        KL(pi_old || pi_theta), unclamped where verl clamps logratio to [-20, 20]), ``clipfrac{,_low,_high}`` = share of tokens the objective's
        clip acts on (`Objective.clipped`; ``clipfrac_dual`` too with the dual clip), ``ratio_{mean,min,max}`` and ``num_tokens``. With no kept token
        the loss is 0 (with a zero gradient) and the token metrics are NaN.
        """
        shape = tuple(logprobs.shape)
        if logprobs.dim() != 2:
            raise ValueError(f"policy_loss: expected logprobs of shape [B, T], got {shape}")
        for name, t in (("old_logprobs", old_logprobs), ("mask", mask), ("weights", weights),
                        ("ref_logprobs", ref_logprobs), ("entropy", entropy)):
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"policy_loss: {name} has shape {tuple(t.shape)}, expected {shape} as logprobs")
        if tuple(advantages.shape) not in (shape[:1], shape):
            raise ValueError(f"policy_loss: advantages has shape {tuple(advantages.shape)}, expected {shape[:1]} "
                             f"or {shape}")
        if self.kl_coef > 0 and ref_logprobs is None:
            raise ValueError(f"policy_loss: algo.kl_coef is {self.kl_coef:g} but no ref_logprobs were given")
        if self.entropy_coef > 0 and entropy is None:
            raise ValueError(f"policy_loss: algo.entropy_coef is {self.entropy_coef:g} but no entropy was given")
        if normalizer is not None and not normalizer > 0:
            raise ValueError(f"policy_loss: normalizer must be > 0, got {normalizer}")

        device = logprobs.device
        dtype = torch.promote_types(logprobs.dtype, torch.float32)
        m = mask.to(device) != 0
        zero = torch.zeros((), dtype=dtype, device=device)
        denominator = self.denominator(m, max_length) if normalizer is None else normalizer

        def masked(x: Tensor) -> Tensor:
            # where, not multiplication: the unselected branch gets neither value nor gradient.
            return torch.where(m, x.to(device, dtype), zero)

        def aggregate(per_token: Tensor) -> Tensor:
            return self.aggregation.rows(masked(per_token), m).sum() / denominator

        logratio = masked(logprobs) - masked(old_logprobs.detach())
        r_theta = self.ratio(logratio, m)
        adv = advantages.detach().to(device, dtype)
        adv = adv[:, None] if adv.dim() == 1 else masked(adv)
        per_token = self.objective.per_token(masked(logprobs), r_theta, adv)
        pg_loss = aggregate(masked(weights.detach()) * per_token)
        loss = pg_loss

        stats: dict[str, Tensor] = {}
        if ref_logprobs is not None:
            # of log(pi_ref / pi_theta) on the sampled tokens; k3 = pi_ref/pi_theta - 1 - log(pi_ref/pi_theta), GRPO's
            kl = kl_estimate(masked(ref_logprobs.detach()) - masked(logprobs), self.kl_estimator)
            if self.kl_coef > 0:
                loss = loss + self.kl_coef * aggregate(kl)
            stats["kl"] = kl.detach()
        if entropy is not None:
            ent = masked(entropy)
            if self.entropy_coef > 0:
                loss = loss - self.entropy_coef * aggregate(ent)
            stats["entropy"] = ent.detach()
        penalty_loss = None
        if penalty is not None:
            penalty_loss = penalty(logprobs).to(dtype).sum() / denominator  # its own mask, not the kept tokens
            loss = loss + penalty_loss

        with torch.no_grad():
            n = m.sum()
            nan = torch.full((), float("nan"), dtype=dtype, device=device)

            def mean(x: Tensor) -> Tensor:
                return torch.where(m, x, zero).sum() / n  # 0 / 0 = NaN on an empty mask

            lr, r = logratio.detach(), r_theta.detach()
            clipped_low, clipped_high, more_clipped = self.objective.clipped(r, adv, m)
            extra = {name: tokens.sum().to(dtype) / n for name, tokens in more_clipped.items()}
            if penalty_loss is not None:
                extra["penalty"] = penalty_loss.detach()
            values = {
                "loss": loss.detach(),
                "pg_loss": pg_loss.detach(),
                **{k: mean(v) for k, v in stats.items()},
                "approx_kl": mean(k3(lr)),  # k3 of log(pi_theta / pi_old) on pi_old's tokens: KL(pi_old || pi_theta)
                "ppo_kl": mean(-lr),  # k1 of the same KL, as verl's and slime's ppo_kl
                "clipfrac": (clipped_high | clipped_low).sum().to(dtype) / n,  # in the loss's dtype, not float32
                "clipfrac_low": clipped_low.sum().to(dtype) / n,
                "clipfrac_high": clipped_high.sum().to(dtype) / n,
                "ratio_mean": mean(r),
                "ratio_min": torch.where(n > 0, torch.where(m, r, torch.inf).min(), nan),
                "ratio_max": torch.where(n > 0, torch.where(m, r, -torch.inf).max(), nan),
                "num_tokens": n,
                **extra,
            }
            # One device->host copy instead of one sync per metric.
            metrics = dict(zip(values, torch.stack([v.to(torch.float64) for v in values.values()]).tolist()))
            metrics["num_tokens"] = int(metrics["num_tokens"])
        return loss, metrics
