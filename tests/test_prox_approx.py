"""`correction=prox_loglinear`, AReaL's log-linear approximation of the proximal policy (issue 53): the formula by hand
on a micro-batch of mixed staleness, the cap, the error counts, stacks, and the loss and gradient the RL step's
`update_policy` builds with it against AReaL's own functions' figures."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rlmm.config.options import from_yaml
from rlmm.corrections.base import Correction, InUpdate, MicroBatchView
from rlmm.corrections.prox_loglinear import LogLinearProximal
from rlmm.corrections.stack import Stack
from rlmm.run.step import OldPolicy, update_policy

D = torch.float64
DOCS = "documented"  # AReaL's docs' alpha = s / (s + 1), which most figures below follow; the trainer's clock: the last test
# One micro-batch of two rows (row 1 has 3 response tokens), each token's staleness s: alpha = s / (s + 1).
MU = [[-1.0, -2.0, -0.5, -3.0, -2.8], [-0.2, -1.5, -2.5, 0.0, 0.0]]           # log mu, the sampler's
THETA = [[-1.3, -1.6, -0.9, -2.0, -0.3], [-0.1, -2.1, -1.0, 0.0, 0.0]]        # log pi_theta, the update's forward
OLD = [[-1.1, -1.7, -0.7, -2.2, -0.5], [-0.15, -1.9, -1.2, 0.0, 0.0]]         # log pi_old, the trainer's recomputation
STALENESS = [[0, 1, 3, 2, 7], [1, 0, 3, 0, 0]]
MASK = [[True] * 5, [True, True, True, False, False]]
ADVANTAGES = [1.0, -0.5]

# By hand: log pi_prox = log mu + alpha (log pi_theta - log mu)
#   row 0: s 0 -> mu -1; s 1 -> -2 + 0.4/2 = -1.8; s 3 -> -0.5 - 0.4 * 3/4 = -0.8; s 2 -> -3 + 1 * 2/3 = -7/3;
#          s 7 -> -2.8 + 2.5 * 7/8 = -0.6125 (weight e^2.1875 = 8.9 > 5: dropped)
#   row 1: s 1 -> -0.2 + 0.1/2 = -0.15; s 0 -> mu -1.5; s 3 -> -2.5 + 1.5 * 3/4 = -1.375
PROX = [[-1.0, -1.8, -0.8, -7 / 3, -0.6125], [-0.15, -1.5, -1.375]]

# AReaL's own functions on this micro-batch (inclusionAI/AReaL at 4aef98d8d818af55b43621aaadba047ae10f4e77, run outside
# rlmm from only their extracted source): `compute_prox_logp_approximations(old_logp=MU, logprobs=THETA,
# versions=9 - STALENESS (-1 on padding), current_version=10, method="loglinear")` (areal/trainer/ppo/actor.py), then
# `ppo_actor_loss_fn(logprobs=THETA, proximal_logprobs=<that>, old_logprobs=MU, advantages=ADVANTAGES per token,
# eps_clip=0.2, eps_clip_higher=0.28, loss_mask=MASK, rejection_sampling=(level token, action mask, metric ratio, upper
# 5.0))` (areal/utils/functional/functional.py), float64 inputs; its alpha is float32 (2/3 rounds), its weight float32.
AREAL_APPROX = [[-1.0, -1.8, -0.8, -2.3333333134651184, -0.6124999999999998],
                [-0.15000000000000002, -1.5, -1.375, 0.0, 0.0]]
AREAL_BEHAVE_IMP_WEIGHT = [[1.0, 1.2214027643203735, 0.740818202495575, 1.9477342367172241, 0.0],
                           [1.0512710809707642, 1.0, 3.080216884613037, 0.0, 0.0]]
AREAL_BEHAVE_MASK = [[True, True, True, True, False], [True, True, True, False, False]]
AREAL_LOSS = -0.2753290957934993
AREAL_GRAD = [[-0.09260227758521473, -0.18647808814567002, -0.08379000369751709, 0.0, 0.0],
              [0.06907318136753396, 0.0, 0.2801055701421245, 0.0, 0.0]]
# The same function with AReaL's trainer's clock, current_version = the engine's version during the update (pi_old's,
# set to global_step + 1 only after it in areal/trainer/rl_trainer.py), so alpha = (s - 1) / s: s <= 1 gives mu.
AREAL_APPROX_TRAINERS_CLOCK = [[-1.0, -2.0, -0.7666666746139527, -2.5, -0.6571428358554838],
                               [-0.2, -1.5, -1.4999999701976776, 0.0, 0.0]]


def tensors():
    mask = torch.tensor(MASK)
    advantages = torch.tensor(ADVANTAGES, dtype=D)[:, None] * mask
    return (torch.tensor(THETA, dtype=D), torch.tensor(MU, dtype=D), torch.tensor(OLD, dtype=D), mask, advantages,
            torch.tensor(STALENESS))


def micro_batch(correction: Correction = None, staleness=True) -> tuple[OldPolicy, MicroBatchView]:
    """The step's own path to the view: `OldPolicy.score` (the batch stage, on every rank's rows) and `micro_batch`."""
    theta, mu, old, mask, advantages, s = tensors()
    correction = correction or LogLinearProximal(cap=5.0, clock=DOCS)
    policy = OldPolicy.score(old, mu, mask, advantages, torch.ones(2), correction, ratio_cap=2.0, also_checked={},
                             token_staleness=s if staleness else None)
    return policy, policy.micro_batch([0, 1], theta)


def response(x: torch.Tensor) -> list[list[float]]:
    return [row[:n] for row, n in zip(x.tolist(), (5, 3))]


def test_the_approximation_by_hand_on_mixed_staleness():
    """s 0 -> alpha 0 -> pi_prox = mu; s 1 -> 1/2; s 3 -> 3/4 (and 2 -> 2/3, 7 -> 7/8); the weight pi_prox / mu."""
    _, view = micro_batch()
    fix = LogLinearProximal(cap=5.0, clock=DOCS).in_update(view)
    assert fix.old_logprobs.dtype == view.old_logprobs.dtype
    for got, expected in zip(response(fix.old_logprobs), PROX):
        assert got == pytest.approx(expected, abs=1e-15)
    assert fix.old_logprobs[1, 3:].tolist() == [0.0, 0.0]  # padding: the batch stage's 0
    mu = torch.tensor(MU, dtype=D)
    expected_weights = [[math.exp(p - m) if p - m <= math.log(5) else 0.0 for p, m in zip(row, mu_row)]
                        for row, mu_row in zip(PROX, MU)]
    assert expected_weights[0][0] == expected_weights[1][1] == 1.0 and expected_weights[0][4] == 0.0
    assert response(fix.weights.double()) == [pytest.approx(row, rel=1e-7) for row in expected_weights]
    assert fix.weights.dtype == view.weights.dtype == torch.float32
    assert fix.penalty is None and not fix.weights.requires_grad and not fix.old_logprobs.requires_grad


def test_the_cap_drops_the_tokens_whose_behaviour_weight_exceeds_it():
    """Row 0's s = 7 token: w = e^(7/8 * 2.5) = 8.9 > 5, dropped (weight 0, mask False, still in the divisor); a cap
    of 9 keeps it with its weight; a weight equal to the cap is kept (AReaL's mask is `ratio > upper`)."""
    _, view = micro_batch()
    fix = LogLinearProximal(cap=5.0, clock=DOCS).in_update(view)
    assert fix.mask.tolist() == AREAL_BEHAVE_MASK
    assert fix.counts["frac_tokens_dropped"] == (1.0, 8.0)
    wide = LogLinearProximal(cap=9.0, clock=DOCS).in_update(view)
    assert wide.mask.tolist() == MASK and wide.weights[0, 4].item() == pytest.approx(math.exp(2.1875), rel=1e-7)
    assert wide.counts["frac_tokens_dropped"] == (0.0, 8.0)
    # row 0's s = 1 token: w = e^0.2, exactly the cap
    at = LogLinearProximal(cap=math.exp(0.5 * 0.4), clock=DOCS).in_update(view)
    assert at.mask[0, 1] and not at.mask[0, 4]
    with pytest.raises(ValueError, match="correction.cap: must be a finite number >= 1, got 0.5"):
        LogLinearProximal(cap=0.5, clock=DOCS)


def test_the_error_counts_against_the_recomputed_pi_old():
    """mean |log pi_prox~ - log pi_old| and mean |pi_prox~ / mu - pi_old / mu| over the 8 tokens the batch stage
    gave (AReaL's loglinear/abs_error and behave_imp_weight_abs_error), the dropped one included."""
    _, view = micro_batch()
    counts = LogLinearProximal(cap=5.0, clock=DOCS).in_update(view).counts
    # |PROX - OLD|: 0.1, 0.1, 0.1, 2.2 - 7/3 -> 2/15, 0.6125 - 0.5 = 0.1125 | 0, 0.4, 0.175
    logp = 0.1 + 0.1 + 0.1 + 2 / 15 + 0.1125 + 0.0 + 0.4 + 0.175
    assert counts["logp_abs_error"] == (pytest.approx(logp, rel=1e-12), 8.0)
    old = [row[:n] for row, n in zip(OLD, (5, 3))]
    weight = sum(abs(math.exp(p - m) - math.exp(o - m)) for rows in zip(PROX, old, MU) for p, o, m in zip(*rows))
    assert counts["behave_imp_weight_abs_error"] == (pytest.approx(weight, rel=1e-12), 8.0)


def test_it_matches_areals_compute_prox_logp_approximations():
    _, view = micro_batch()
    fix = LogLinearProximal(cap=5.0, clock=DOCS).in_update(view)
    assert fix.old_logprobs.tolist() == [pytest.approx(row, abs=1e-7) for row in AREAL_APPROX]  # AReaL's alpha: fp32
    assert fix.weights.tolist() == [pytest.approx(row, rel=1e-6) for row in AREAL_BEHAVE_IMP_WEIGHT]
    assert fix.mask.tolist() == AREAL_BEHAVE_MASK
    # AReaL's trainer's clock is one update behind its docs' (the class docstring): what it gives on these tokens,
    # by hand and from AReaL's function, is what the shipped option (clock: trainer) computes
    clock = [[-1.0, -2.0, -0.5 - 0.4 * 2 / 3, -3.0 + 1 / 2, -2.8 + 2.5 * 6 / 7], [-0.2, -1.5, -2.5 + 1.5 * 2 / 3, 0, 0]]
    assert AREAL_APPROX_TRAINERS_CLOCK == [pytest.approx(row, abs=1e-7) for row in clock]
    running = LogLinearProximal(cap=5.0, clock="trainer").in_update(view)
    assert running.old_logprobs.tolist() == [pytest.approx(row, abs=1e-7) for row in AREAL_APPROX_TRAINERS_CLOCK]
    with pytest.raises(ValueError, match="correction.clock: must be one of trainer, documented, got 'areal'"):
        LogLinearProximal(cap=5.0, clock="areal")


class OneUpdate:
    """A trainer's minibatch update over a leaf tensor of log pi_theta: what `update_policy` calls on it."""

    holds_graphs = False

    def __init__(self, theta: torch.Tensor, micro_batches: list[list[int]]):
        self.theta, self.micro_batches = theta, micro_batches

    def scale_lr(self, scale: float) -> None:
        assert scale == 1.0

    def forward(self, rows):
        return self.theta[rows], None

    def backward(self, loss):
        loss.backward()

    def step(self) -> dict[str, float]:
        return {"skipped": 0.0}


@pytest.mark.parametrize("micro_batches", [[[0, 1]], [[1], [0]]], ids=["one", "two"])
def test_the_step_trains_against_the_approximation_as_areals_decoupled_loss(micro_batches):
    """`update_policy` (rlmm/run/step.py) with GRPO's clip (0.2, 0.28) and token mean: PPO's ratio against the
    approximation, the weight pi_prox / mu, the dropped token in the divisor. Loss and gradient are AReaL's
    `ppo_actor_loss_fn` on its own approximation, whatever the micro-batching; pi_old (the recomputation) gives
    another loss. The counts reach `PolicyUpdate.in_update` summed over the micro-batches."""
    theta, *_ = tensors()
    correction, algo = LogLinearProximal(cap=5.0, clock=DOCS), from_yaml("algo", "grpo")
    policy, _ = micro_batch(correction)
    leaf = theta.clone().requires_grad_()
    update = OneUpdate(leaf, micro_batches)
    c = SimpleNamespace(algo=algo, episodes=SimpleNamespace(max_response_tokens=5), correction=correction,
                        routing=SimpleNamespace(trained=lambda rollouts, own: rollouts),
                        trainer=SimpleNamespace(begin_update=lambda rollouts, rows: update))
    scores = SimpleNamespace(first_update=None, held=[], own_routing=None)
    done = update_policy(c, policy, SimpleNamespace(train=lambda rows: None), scores, [None, None],
                         torch.tensor(MASK), train_policy=True)
    assert sum(m["loss"] for m in done.losses) == pytest.approx(AREAL_LOSS, rel=1e-6)
    assert leaf.grad.tolist() == [pytest.approx(row, rel=1e-6, abs=1e-12) for row in AREAL_GRAD]
    logged = done.in_update.over_ranks()
    assert logged["frac_tokens_dropped"] == 1 / 8
    assert logged["logp_abs_error"] == pytest.approx((0.3 + 2 / 15 + 0.1125 + 0.575) / 8, rel=1e-12)
    # the same weights and mask against the recomputed pi_old: not AReaL's loss
    fix = correction.in_update(policy.micro_batch([0, 1], theta))
    other, _ = algo.policy_loss(theta, policy.logprobs, policy.advantages, policy.mask & fix.mask,
                                policy.weights * fix.weights, max_length=5, normalizer=8.0)
    assert abs(other.item() - AREAL_LOSS) > 1e-3


def test_it_refuses_a_view_without_staleness():
    _, view = micro_batch(staleness=False)
    with pytest.raises(ValueError, match="correction=prox_loglinear: needs each token's staleness"):
        LogLinearProximal(cap=5.0, clock=DOCS).in_update(view)
    shipped = from_yaml("correction", "prox_loglinear")
    assert LogLinearProximal.needs_versions and shipped.cap == 5.0 and shipped.clock.name == "trainer"


def test_before_the_update_it_is_the_identity_on_the_recomputed_pi_old():
    theta, mu, old, mask, advantages, s = tensors()
    out = LogLinearProximal(cap=5.0, clock=DOCS)(old, mu, mask, advantages)
    none = from_yaml("correction", "none")(old, mu, mask, advantages)
    assert torch.equal(out.old_logprobs, none.old_logprobs) and torch.equal(out.weights, none.weights)
    assert torch.equal(out.mask, none.mask) and out.metrics == none.metrics


class SeesOldLogprobs(Correction):
    """An in-update stage that records the pi_old it is shown (and replaces nothing)."""

    def in_update(self, micro: MicroBatchView) -> InUpdate:
        self.seen = micro.old_logprobs
        return super().in_update(micro)


def test_a_stack_hands_the_approximation_on_and_refuses_two():
    prox = LogLinearProximal(cap=5.0, clock=DOCS)
    _, view = micro_batch()
    alone = prox.in_update(view)
    before, after = SeesOldLogprobs(), SeesOldLogprobs()
    stacked = Stack({"before": before, "prox_loglinear": prox, "after": after}).in_update(view)
    assert torch.equal(before.seen, view.old_logprobs)  # the batch stage's pi_old, before the replacement
    assert torch.equal(after.seen, alone.old_logprobs) and torch.equal(stacked.old_logprobs, alone.old_logprobs)
    assert torch.equal(stacked.weights, alone.weights) and torch.equal(stacked.mask, alone.mask)
    assert stacked.counts["prox_loglinear/frac_tokens_dropped"] == (1.0, 8.0)
    assert Stack({"m2po": from_yaml("correction", "m2po"), "prox_loglinear": prox}).replaces_old_logprobs
    assert Stack({"before": before}).in_update(view).old_logprobs is None
    with pytest.raises(ValueError, match=r"^correction=a\+b: a and b both replace PPO's pi_old inside the update "
                                         r"\(the ratio has one denominator\); keep one$"):
        Stack({"a": prox, "b": LogLinearProximal(cap=3.0, clock=DOCS)})
    with pytest.raises(ValueError, match=r"prox_loglinear and tis both weight tokens by the importance ratio"):
        Stack({"prox_loglinear": prox, "tis": from_yaml("correction", "tis")})
    with pytest.raises(ValueError, match=r"the stages want different log-probs as PPO's pi_old"):
        Stack({"bypass": from_yaml("correction", "bypass"), "prox_loglinear": prox})
