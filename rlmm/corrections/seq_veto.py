"""Sequence veto: one catastrophic token rejects its whole sequence."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch

from rlmm.corrections.base import (BatchView, Correction, CorrectionOutput, choice, finish, log_ratios, masked_max,
                                   masked_min)
from rlmm.mismatch import kl


@dataclass(frozen=True)
class _LargestEstimate:
    """Test a sequence's largest per-token KL estimate: kept while it is at most tau (> 0)."""

    estimate: Callable[[torch.Tensor], torch.Tensor]  # rlmm/mismatch/kl.py's k2 or k3 of delta
    allowed = "must be > 0"

    def accepts(self, threshold: float) -> bool:
        return threshold > 0.0

    def scores(self, delta: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
        # padding is -inf: never the maximum; NaN propagates through amax, and fails <=
        return torch.where(response, self.estimate(delta), -torch.inf).amax(dim=1)

    def keeps(self, score: torch.Tensor, threshold: float) -> torch.Tensor:
        return score <= threshold

    def worst(self, score: torch.Tensor, nonempty: torch.Tensor) -> torch.Tensor:
        return masked_max(score, nonempty)


@dataclass(frozen=True)
class _SmallestRatio:
    """Test a sequence's smallest token ratio exp(delta_t): kept while it is at least tau (in (0, 1])."""

    allowed = "a smallest ratio must be in (0, 1]"

    def accepts(self, threshold: float) -> bool:
        return 0.0 < threshold <= 1.0

    def scores(self, delta: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
        # padding is +inf: never the minimum; NaN propagates through amin, and fails >=
        return torch.where(response, delta, torch.inf).amin(dim=1).exp()

    def keeps(self, score: torch.Tensor, threshold: float) -> torch.Tensor:
        return score >= threshold

    def worst(self, score: torch.Tensor, nonempty: torch.Tensor) -> torch.Tensor:
        return masked_min(score, nonempty)


class VetoScore(Enum):
    """seq_veto's ``estimator:``, each member the test it stands for (its value): the sequence's ``scores`` ([B]),
    the sequences it ``keeps``, the ``worst`` score of the batch (logged) and the thresholds it ``accepts``."""

    k2 = _LargestEstimate(kl.k2)
    k3 = _LargestEstimate(kl.k3)
    min_ratio = _SmallestRatio()


class SequenceVeto(Correction):
    """Drop sequence i when its worst token is too far off-policy (``correction=seq_veto``).

    old = log pi_train (unchanged),  w = 1,  and with delta_t = log pi_train(y_t) - log pi_sampler(y_t):

        k2, k3:     keep_i = [max_t k(delta_t) <= tau]      (k2 = delta^2 / 2, k3 = e^delta - 1 - delta)
        min_ratio:  keep_i = [min_t exp(delta_t) >= tau]

    Sources: verl's rollout rejection options ``seq_max_k2`` / ``seq_max_k3`` ("veto for max criterion",
    `trainer/ppo/rollout_corr_helper.py`; its docs' example threshold 2.5 for seq_max_k2, the default here:
    |delta| > 2.24, a ratio beyond [0.107, 9.4]); slime's ``rs_veto_threshold`` (its
    `examples/train_infer_mismatch_helper/mis.py`, `calculate_veto_mask`: a token with pi_old / mu < 1e-4 vetoes its
    sequence, lower side only; ``estimator: min_ratio, threshold: 1e-4``); SkyRL's outlier veto (two-sided, on the
    ratio). A mask only (`old_policy` None). It tests every token of the batch's response mask
    (``BatchView.response_mask``), the ones earlier stages of a stack dropped included: slime vetoes after its
    rejection (``tis+token_rs+seq_veto``) on the loss mask, verl and SkyRL veto first (``seq_veto+token_rs+tis``),
    and both orders give the same mask. An empty sequence is kept (verl: seq_max = 0); a NaN log-ratio on a token
    vetoes its sequence.

    Args:
        estimator: a `VetoScore`: k2 or k3 (the sequence's largest estimate is tested) or min_ratio (its smallest ratio).
        threshold: tau; the largest accepted k2/k3 (> 0), or the smallest accepted ratio (in (0, 1]).
    """

    def __init__(self, estimator: VetoScore, threshold: float):
        self.estimator = choice(VetoScore, estimator, "estimator")
        test = self.estimator.value
        if not test.accepts(threshold):  # NaN is accepted by neither
            raise ValueError(f"correction.threshold: {test.allowed}, got {threshold}")
        self.threshold = float(threshold)

    def before_update(self, batch: BatchView) -> CorrectionOutput:
        # the score is over every response token (slime's calculate_veto_mask on the loss mask); the tokens still in
        # (`batch.mask`) are what this stage keeps or drops
        delta, response = log_ratios(batch.trainer_logprobs, batch.sampler_logprobs, batch.response_mask)
        m = response & (batch.mask.to(response.device) != 0)
        nonempty = response.any(dim=1)
        test = self.estimator.value
        score = test.scores(delta, response)
        keep = test.keeps(score, self.threshold) | ~nonempty  # an empty sequence is kept
        worst = test.worst(score, nonempty)
        return finish(old_logprobs=batch.trainer_logprobs, weights=torch.ones_like(delta), keep=keep[:, None],
                      delta=torch.where(m, delta, 0.0), mask=m, extra={"seq_score_worst": worst})
