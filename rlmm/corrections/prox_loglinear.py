"""AReaL's proximal log-prob approximation: PPO's pi_old, inside the update, interpolated in log space between the
sampler's log-probs and the current policy's by each token's staleness."""
from __future__ import annotations

from enum import Enum

import torch

from rlmm.corrections.base import Anchor, Correction, InUpdate, MicroBatchView, check_cap, choice


class VersionClock(Enum):
    """Which versions AReaL's alpha = (v_prox - v_behave) / (v_theta - v_behave) reads, by a token's staleness s
    (updates between the weights that sampled it and pi_old's): ``trainer``, as AReaL's trainer runs it (its
    current_version during an update is pi_old's own, so v_theta = pi_old's, v_prox one before: alpha = (s - 1) / s,
    0 at s <= 1); ``documented``, as its docs and unit tests define it (v_prox = pi_old's, v_theta one ahead: alpha =
    s / (s + 1))."""

    trainer = "trainer"
    documented = "documented"

    def alpha(self, staleness: torch.Tensor) -> torch.Tensor:
        """alpha per token from its float64 staleness (>= 0), clamped to [0, 1] with 0 where v_theta = v_behave."""
        if self is VersionClock.documented:
            return staleness / (staleness + 1)
        return torch.where(staleness > 0, (staleness - 1) / staleness.clamp_min(1), 0.0)


class LogLinearProximal(Correction):
    """AReaL's approximated proximal policy as PPO's pi_old inside the update (``correction=prox_loglinear``).

    With s_t the token's staleness (`MicroBatchView.token_staleness`: updates between the weights v_{u-1-s_t} that
    sampled y_t and pi_old's v_{u-1}), AReaL's alpha = (v_prox - v_behave) / (v_theta - v_behave) with v_prox =
    v_{u-1}, v_theta = v_u (the update under way), clamped to [0, 1], and in each micro-batch

        alpha_t = (s_t - 1) / s_t,  0 at s_t <= 1      (clock: trainer, the default: 0, 0, 2/3 at s = 0, 1, 3)
        alpha_t = s_t / (s_t + 1)                      (clock: documented: 0, 1/2, 3/4 at s = 0, 1, 3)
        log pi_prox(y_t) ~= log mu(y_t) + alpha_t (sg log pi_theta(y_t) - log mu(y_t))
        w_t = pi_prox / mu = exp(alpha_t (sg log pi_theta - log mu)),    token dropped where w_t > C

    PPO's ratio is pi_theta / pi_prox (the algorithm's clip: `InUpdate.old_logprobs` replaces the batch stage's
    pi_old for the micro-batch), each kept token's term weighted by w_t; a dropped token stays in the loss's divisor
    (fixed before the update's forwards), as AReaL counts its loss mask before the rejection. Before the update it is
    the identity (pi_old the trainer's recomputation, weight 1), so every batch metric is `none`'s.

    Source: AReaL (inclusionAI/AReaL at 4aef98d8d818af55b43621aaadba047ae10f4e77, `actor.prox_logp_method:
    loglinear` with `actor.use_decoupled_loss: true`): areal/trainer/ppo/actor.py `compute_prox_logp_approximations`
    (alpha and the loglinear formula, from the training forward's detached log-probs, `_resolve_proximal_logp`) and
    areal/utils/functional/functional.py `ppo_actor_loss_fn` with `apply_rejection_sampling` (the ratio
    exp(logprobs - proximal_logprobs) clipped, pg_loss * behave_imp_weight = exp(proximal - old), tokens whose ratio
    exceeds `upper` masked out at `level: token, action: mask, metric: ratio`); docs/en/algorithms/prox_approx.md.
    C = 5: its example examples/experimental/prox_approx/gsm8k_grpo_prox_approx.yaml (`rejection_sampling: {metric:
    ratio, upper: 5.0}`) and the removed `behave_imp_weight_cap` 5.0 with `token_mask` (AReaL bc9f009), which masked
    alike. AReaL without `rejection_sampling` (its default now) applies no behaviour weight at all; here w_t always
    applies (a large C leaves it untruncated). tests/test_prox_approx.py holds AReaL's own figures on a micro-batch.

    Departures and what to know:
    - AReaL's point is to skip the recomputation of pi_prox (a forward pass a step). rlmm still computes pi_old every
      step (a scoring pass, or with one epoch of one minibatch the update's first forward, which costs nothing extra),
      so this option measures the approximation's effect on learning, not AReaL's time saving; and it measures the
      approximation's error every step against that recomputation.
    - At the first micro-batch forward of the first epoch pi_theta == pi_old (the same weights), so the approximation
      there is mu + alpha (pi_old - mu), not pi_old, as in AReaL.
    - At s = 0 alpha = 0: pi_prox := mu, PPO's ratio is pi_theta / mu and the weight 1 (`bypass`): the sampler's
      numerical mismatch is not corrected, as in AReaL. A run whose every token is fresh trains as `bypass`.
    - AReaL's clock (`clock`): its trainer passes `current_version = engine.get_version()`, which
      areal/trainer/rl_trainer.py sets to global_step + 1 only after the update and the weight sync, so during an
      update it is the version of the weights the update starts from (pi_old's), the one its rollouts tag fresh
      tokens with; its v_prox = current_version - 1 is then one behind pi_old, and the alpha it computes is
      (s - 1) / s (0 at s <= 1: a token one update stale gets pi_prox := mu). That is the default (``trainer``):
      what `prox_logp_method: loglinear` computes when AReaL runs. ``documented`` is its docs' and unit tests'
      definition (v_prox = pi_old's version, v_theta one ahead), which interpolates further towards pi_theta.
    - float64 (AReaL's weight float32); a NaN weight (a non-finite log-prob) is dropped, where AReaL sets a
      non-finite log-ratio's weight to 1; a negative staleness gives alpha 0 (AReaL clamps alpha at 0).
    - The errors are over every token the batch stage gave (AReaL's metrics mode averages over the tokens its cap
      kept, and trains on the recomputed pi_prox).

    Logs, summed over the step's micro-batches and ranks: ``logp_abs_error`` = mean_t |log pi_prox~ - log pi_old|
    against the trainer's recomputation (AReaL's ``loglinear/abs_error``), ``behave_imp_weight_abs_error`` = mean_t
    |pi_prox~ / mu - pi_old / mu| (its ``loglinear/behave_imp_weight_abs_error``), ``frac_tokens_dropped`` (w_t > C;
    its ``rs_filtered_fraction``).

    Needs each token's staleness (`needs_versions`): a run that tracks no versions cannot use it.

    Args:
        cap: C, the largest behaviour weight pi_prox / mu a kept token may have; finite and >= 1.
        clock: ``trainer`` (AReaL's running trainer) or ``documented`` (its docs), a `VersionClock` name.
    """

    old_policy = Anchor.trainer  # its weights assume the proximal policy, which it approximates
    importance_weighted = True
    needs_versions = True
    replaces_old_logprobs = True

    def __init__(self, cap: float, clock: VersionClock | str):
        self.cap = check_cap(cap)
        self.clock = choice(VersionClock, clock, "clock")

    def in_update(self, micro: MicroBatchView) -> InUpdate:
        if micro.token_staleness is None:
            raise ValueError("correction=prox_loglinear: needs each token's staleness (token_staleness), and this "
                             "run tracks no versions")
        m = micro.mask
        zero = torch.zeros((), dtype=torch.float64, device=m.device)
        staleness = torch.where(m, micro.token_staleness.to(m.device), 0).clamp_min(0).to(torch.float64)
        alpha = self.clock.alpha(staleness)
        mu = torch.where(m, micro.sampler_logprobs.to(m.device, torch.float64), zero)
        theta = torch.where(m, micro.logprobs.detach().to(torch.float64), zero)
        recomputed = torch.where(m, micro.trainer_logprobs.to(m.device, torch.float64), zero)
        prox = mu + alpha * (theta - mu)
        weight = (prox - mu).exp()
        keep = m & (weight <= self.cap)  # NaN fails <=: dropped
        errors = torch.stack([torch.where(m, (prox - recomputed).abs(), zero).sum(),
                              torch.where(m, (weight - (recomputed - mu).exp()).abs(), zero).sum(),
                              (m & ~keep).sum().to(torch.float64)]).tolist()  # one host copy
        given = float(m.sum())
        old = torch.where(m, prox.to(micro.old_logprobs.dtype), micro.old_logprobs)
        return InUpdate(weights=torch.where(keep, weight, zero).to(micro.weights.dtype), mask=keep, old_logprobs=old,
                        counts={"logp_abs_error": (errors[0], given), "behave_imp_weight_abs_error": (errors[1], given),
                                "frac_tokens_dropped": (errors[2], given)})
