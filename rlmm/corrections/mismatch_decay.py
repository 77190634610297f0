"""A learning-rate decay that the mismatch triggers: halve the rate on a schedule once the mismatch surges."""
from __future__ import annotations

import math

from rlmm.corrections.base import BatchView, Correction, StepSize, log_ratios, masked_mean
from rlmm.mismatch.kl import k3


class MismatchTriggeredDecay(Correction):
    """Halve the learning rate on a schedule once the batch's mismatch surges (``correction=mismatch_decay``).

    Step t = 1, 2, ... (counted from this correction's first step) observes the batch's mismatch, the k3 estimate of
    KL(mu || pi_old) over the response tokens (``mismatch/kl_k3``, every rank's rows):

        k3_t = mean_tokens (r - 1 - delta),   r = exp(delta),
        baseline = the mean of k3 over the first `baseline_steps` steps,
        s = the first later step with k3_s > surge * baseline    (the trigger; it never re-arms),
        P = max(1, floor(period_factor * s)),
        lr_t = lr * max(min_scale, factor ** floor(t / P))       from step s on, lr before it,

    so the first cut falls at step P, about (period_factor - 1) * s steps after the surge, and the rate then halves
    every P steps down to min_scale of the schedule's. A step whose k3 is NaN or infinite (a faulty batch, skipped
    anyway) counts as a step but neither feeds the baseline nor triggers. Weights 1, nothing dropped, pi_old the
    trainer's: stack it with the loss's weight (``correction=tis+mismatch_decay``). The count, the baseline and the
    trigger are its state (`state_dict`), which ``checkpoint.save(..., correction=)`` saves and ``checkpoint.load``
    restores (rlmm/run/train.py passes its correction to both), so a resumed decay continues as the uninterrupted one.

    Source: Zhang, Li et al. 2026, "Beyond Precision: Training-Inference Mismatch is an Optimization Problem and
    Simple LR Scheduling Fixes It" (arXiv 2602.01826): the mismatch and the gradient noise rise together, shrinking
    the update suppresses the mismatch, so the rate decays once an early-warning signal surges. Its pseudo-code
    (Figure 1(c)) was not readable here; the schedule is the reading of a public re-implementation of the paper
    ("Adaptive Step-Decay": a surge is the signal above 3x its mean over the first 50 steps, the decay period 1.8x
    the surge step, the rate halved each period down to 0.1 of the initial one; its Qwen3-4B figures, surge near
    step 110 and period 204, fit the 1.8). Assumed, and departures: the paper's signal is the mean response
    length, which it finds rises before the mismatch; rlmm measures the mismatch itself every step, and triggers on
    it (what issue 49 asks for: the rate lowered when the mismatch rises); the baseline window is 5 steps in this
    YAML, sized to rlmm's runs of tens of steps (the re-implementation's 50: ``correction.baseline_steps=50``);
    steps count from this correction's first (a correction switched to by the monitor starts afresh); the factor
    multiplies the trainer's own schedule (its warm-up included) instead of replacing it. Logs ``lr_scale``,
    ``kl_baseline`` (NaN until formed), ``surge_step`` (0 until triggered) and ``decay_period`` (0 until then).

    Args:
        baseline_steps: W >= 1, the steps whose mean k3 is the baseline.
        surge: > 1, how many times the baseline a step's k3 must exceed to trigger.
        period_factor: > 0, the decay period over the trigger step.
        factor: in (0, 1), what each period multiplies the rate by (the paper's halving: 0.5).
        min_scale: in (0, 1], the smallest fraction of the schedule's rate.
    """

    def __init__(self, baseline_steps: int, surge: float, period_factor: float, factor: float, min_scale: float):
        if not (isinstance(baseline_steps, int) and baseline_steps >= 1):
            raise ValueError(f"correction.baseline_steps: must be an integer >= 1, got {baseline_steps}")
        if not (math.isfinite(surge) and surge > 1.0):
            raise ValueError(f"correction.surge: must be a finite number > 1, got {surge}")
        if not (math.isfinite(period_factor) and period_factor > 0.0):
            raise ValueError(f"correction.period_factor: must be a finite number > 0, got {period_factor}")
        if not 0.0 < factor < 1.0:
            raise ValueError(f"correction.factor: must be in (0, 1), got {factor}")
        if not 0.0 < min_scale <= 1.0:
            raise ValueError(f"correction.min_scale: must be in (0, 1], got {min_scale}")
        self.baseline_steps, self.surge, self.period_factor = baseline_steps, float(surge), float(period_factor)
        self.factor, self.min_scale = float(factor), float(min_scale)
        self.steps = 0  # steps observed
        self.baseline_sum, self.baseline_count = 0.0, 0  # k3 summed over the baseline's steps so far
        self.surge_step = 0  # s, 0 until the trigger

    def step_size(self, batch: BatchView) -> StepSize:
        self.steps += 1
        kl = batch_kl_k3(batch)
        if math.isfinite(kl):
            if self.baseline_count < self.baseline_steps:
                self.baseline_sum += kl
                self.baseline_count += 1
            elif not self.surge_step and kl > self.surge * self.baseline():
                self.surge_step = self.steps
        period = self.period()
        scale = max(self.min_scale, self.factor ** (self.steps // period)) if period else 1.0
        return StepSize(scale=scale, metrics={"lr_scale": scale, "kl_baseline": self.baseline(),
                                              "surge_step": float(self.surge_step), "decay_period": float(period)})

    def baseline(self) -> float:
        """The mean k3 of the baseline's steps; NaN until all `baseline_steps` are in."""
        return self.baseline_sum / self.baseline_count if self.baseline_count == self.baseline_steps else math.nan

    def period(self) -> int:
        """P, the decay period; 0 before the trigger."""
        return max(1, math.floor(self.period_factor * self.surge_step)) if self.surge_step else 0

    def state_dict(self) -> dict:
        return {"steps": self.steps, "baseline_sum": self.baseline_sum, "baseline_count": self.baseline_count,
                "surge_step": self.surge_step}

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.surge_step = int(state["steps"]), int(state["surge_step"])
        self.baseline_sum, self.baseline_count = float(state["baseline_sum"]), int(state["baseline_count"])


def batch_kl_k3(batch: BatchView) -> float:
    """mean (r - 1 - delta) over the batch's response tokens (`response_mask`), in float64; NaN with no token."""
    delta, m = log_ratios(batch.trainer_logprobs, batch.sampler_logprobs, batch.response_mask)
    return masked_mean(k3(delta), m).item()
