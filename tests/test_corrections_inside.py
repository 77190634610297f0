"""The corrections of 2026 (issue 34) and the two places a correction acts: OPSM and DPPO's TV trust region inside
the update, M2PO, the sequence veto and self-normalisation once per batch, stacks of several, each against values
worked out by hand; and for every option (by glob) what the in-update stage and a stack of one must give. The loss
side (CISPO, PPO's dual clip, the rejected tokens' divisor) is at the end."""
from __future__ import annotations

import math

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from rlmm.algos.surrogate import CISPO, ClippedSurrogate
from rlmm.config.options import CONF_DIR, from_yaml
from rlmm.corrections.base import METRIC_KEYS, Anchor, Correction, MicroBatchView
from rlmm.corrections.m2po import SecondMomentMask
from rlmm.corrections.normalize import SelfNormalize
from rlmm.corrections.opsm import OffPolicySequenceMask
from rlmm.corrections.seq_veto import SequenceVeto, VetoScore
from rlmm.corrections.stack import Stack
from rlmm.corrections.tis import TokenTIS
from rlmm.corrections.token_mask import TokenMask
from rlmm.corrections.tv_trust import TVTrustRegion
from tests.test_corrections import mixed_staleness, random_batch, with_padding

NAMES = sorted(p.stem for p in CONF_DIR.glob("correction/*.yaml"))
LOG = math.log


def build(name: str) -> Correction:
    return instantiate(OmegaConf.load(CONF_DIR / "correction" / f"{name}.yaml"))


def view(logprobs, sampler, advantages, mask, trainer=None, weights=None, staleness=False) -> MicroBatchView:
    """`staleness`: each token's staleness 0, 1, 2, 3, 0, ... along the row (0 on padding), for a method that reads
    it (`needs_versions`); False: untracked (None)."""
    logprobs = torch.as_tensor(logprobs, dtype=torch.float64)
    mask = torch.as_tensor(mask)
    trainer = logprobs if trainer is None else torch.as_tensor(trainer, dtype=torch.float64)
    return MicroBatchView(logprobs=logprobs, old_logprobs=trainer, trainer_logprobs=trainer,
                          sampler_logprobs=torch.as_tensor(sampler, dtype=torch.float64),
                          advantages=torch.as_tensor(advantages, dtype=torch.float32), mask=mask,
                          weights=torch.where(mask, 1.0, 0.0),
                          token_staleness=torch.where(mask, torch.arange(mask.size(1)) % 4, 0) if staleness else None)


# ---------------------------------------------------------------- OPSM

# Three sequences of two tokens, log mu - log pi_theta per token:
#   row 0: 0.6, 0.4 -> D = 0.5, A = +1 (kept: a non-negative advantage is always kept)
#   row 1: 0.3, 0.1 -> D = 0.2, A = -1 (dropped at delta 0.1)
#   row 2: 0.1, -0.1 -> D = 0.0, A = -1 (kept)
#   row 3: 0.5, pad -> D = 0.5, A = -1 (dropped: the mean is over its one token)
OPSM_THETA = [[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0], [-1.0, 0.0]]
OPSM_MU = [[-0.4, -0.6], [-0.7, -0.9], [-0.9, -1.1], [-0.5, 0.0]]
OPSM_MASK = [[True, True], [True, True], [True, True], [True, False]]
OPSM_A = [[1.0, 1.0], [-1.0, -1.0], [-1.0, -1.0], [-1.0, 0.0]]


def test_opsm_drops_negative_sequences_the_policy_moved_away_from():
    out = OffPolicySequenceMask(threshold=0.1, anchor="sampler").in_update(
        view(OPSM_THETA, OPSM_MU, OPSM_A, OPSM_MASK))
    assert out.mask.tolist() == [[True, True], [False, False], [True, True], [False, False]]
    assert (out.weights == 1).all() and out.penalty is None
    assert out.counts == {"frac_sequences_dropped": (2.0, 4.0), "frac_tokens_dropped": (3.0, 7.0),
                          "frac_negative_sequences": (3.0, 4.0)}


def test_opsm_with_every_advantage_positive_drops_nothing():
    out = OffPolicySequenceMask(threshold=0.1, anchor="sampler").in_update(
        view(OPSM_THETA, OPSM_MU, [[1.0, 1.0]] * 4, OPSM_MASK))
    assert out.mask.tolist() == OPSM_MASK and out.counts["frac_sequences_dropped"] == (0.0, 4.0)


def test_opsm_anchored_on_the_trainer_reads_pi_old_not_mu():
    # pi_old = pi_theta everywhere: D = 0 for every row, nothing dropped whatever mu says
    out = OffPolicySequenceMask(threshold=0.1, anchor="trainer").in_update(
        view(OPSM_THETA, OPSM_MU, OPSM_A, OPSM_MASK, trainer=OPSM_THETA))
    assert out.mask.tolist() == OPSM_MASK


def test_opsm_refuses_bad_settings():
    with pytest.raises(ValueError, match="correction.anchor: must be one of sampler, trainer, got 'mu'"):
        OffPolicySequenceMask(threshold=0.1, anchor="mu")
    with pytest.raises(ValueError, match="correction.threshold: must be finite, got nan"):
        OffPolicySequenceMask(threshold=math.nan, anchor="sampler")


# ---------------------------------------------------------------- DPPO's TV trust region

# Per token: pi_theta, mu (probabilities), A; the probability move d = pi_theta - mu and the verdict at eps 0.2:
#   0.9  vs 0.6   A > 0  d = +0.3 -> dropped (high)        0.9 vs 0.6, A < 0: kept (its advantage pulls it back)
#   0.1  vs 0.4   A < 0  d = -0.3 -> dropped (low)         0.1 vs 0.4, A > 0: kept
#   0.02 vs 0.01  A > 0  d = +0.01 -> kept, though the ratio is 2: a ratio test would drop it
#   0.5  vs 0.5   A = 0  d = 0 -> kept (A = 0 takes the low branch, as prime-rl's where(A > 0, ...))
TV_THETA = [[0.9, 0.9, 0.1, 0.1, 0.02, 0.5]]
TV_MU = [[0.6, 0.6, 0.4, 0.4, 0.01, 0.5]]
TV_A = [[1.0, -1.0, -1.0, 1.0, 1.0, 0.0]]


def test_tv_trust_drops_tokens_moved_beyond_eps_in_their_advantages_direction():
    fix = TVTrustRegion(eps=0.2, kl_coef=1e-3)
    mask = torch.ones(1, 6, dtype=torch.bool)
    out = fix.in_update(view(torch.tensor(TV_THETA).log(), torch.tensor(TV_MU).log(), TV_A, mask))
    assert out.mask.tolist() == [[False, True, False, True, True, True]]
    assert out.counts == {"frac_tokens_dropped": (2.0, 6.0), "frac_dropped_high": (1.0, 6.0),
                          "frac_dropped_low": (1.0, 6.0)}


def test_tv_trust_penalty_is_the_squared_log_ratio_to_mu_on_every_token_the_batch_stage_kept():
    fix = TVTrustRegion(eps=0.2, kl_coef=1e-3)
    mask = torch.tensor([[True, True, False]])
    theta, mu = torch.tensor([[0.9, 0.1, 0.5]]).log(), torch.tensor([[0.6, 0.4, 0.1]]).log()
    out = fix.in_update(view(theta, mu, [[1.0, -1.0, 1.0]], mask))
    logprobs = theta.clone().requires_grad_()
    penalty = out.penalty(logprobs)
    expected = [1e-3 * LOG(0.9 / 0.6) ** 2, 1e-3 * LOG(0.1 / 0.4) ** 2, 0.0]  # the masked-out token: none
    assert penalty[0].tolist() == pytest.approx(expected)
    (grad,) = torch.autograd.grad(penalty.sum(), logprobs)  # 2 kl_coef (log pi_theta - log mu)
    assert grad[0].tolist() == pytest.approx([2e-3 * LOG(0.9 / 0.6), 2e-3 * LOG(0.1 / 0.4), 0.0])


def test_tv_trust_penalty_reaches_the_tokens_it_drops_in_the_loss_the_step_builds():
    """Issue 49's case, through the step's own path (`OldPolicy.score`, `in_update`, the step's divisor, then
    `algo.policy_loss` with the arguments `rl_update` gives it): mu = [0.1, 0.5], pi_theta = [0.9, 0.5]
    (probabilities), A = +1, eps 0.2, kl_coef 1e-3. Token 0 moved 0.8 > eps, so it leaves the surrogate, but its
    (log pi_theta - log mu)^2 term stays: prime-rl's `kl_loss` is over the loss mask, not the kept one.

    The figures are prime-rl's own `compute_loss` with `default_loss_fn` (src/prime_rl/trainer/rl/loss.py at commit
    559b44772e471d1538537b8805cc77f3824a5e64; run outside rlmm, its beartype/jaxtyping/config imports stubbed,
    `DefaultLossConfig(dppo_mask_low=0.2, dppo_mask_high=0.2, kl_tau=1e-3)`, rl_scale 2): loss -0.49758610207837484,
    d loss / d log pi_theta = [0.002197224577336219, -0.5] (= (-1 + 1e-3 ln(9)^2) / 2 and [2e-3 ln 9 / 2, -1 / 2]).
    Masking the penalty with the kept tokens gives -0.5 and [0, -0.5]. The ratio clip plays no part here (the
    kept token's ratio is 1)."""
    from rlmm.run.step import OldPolicy, loss_normalizer_over_ranks

    theta, mu = torch.tensor([[0.9, 0.5]]).log(), torch.tensor([[0.1, 0.5]]).log()
    mask, advantages = torch.ones(1, 2, dtype=torch.bool), torch.ones(1, 2)
    correction, algo = TVTrustRegion(eps=0.2, kl_coef=1e-3), grpo()
    old = OldPolicy.score(theta, mu, mask, advantages, torch.ones(1), correction, ratio_cap=2.0, also_checked={})
    normalizer = loss_normalizer_over_ranks(algo, old.mask[[0]], mask[[0]], max_length=2)
    logprobs = theta.clone().requires_grad_()
    view = old.micro_batch([0], logprobs)
    fix = correction.in_update(view)
    assert fix.mask.tolist() == [[False, True]]
    loss, metrics = algo.policy_loss(logprobs, view.old_logprobs, view.advantages, view.mask & fix.mask,
                                     view.weights * fix.weights, max_length=2, normalizer=normalizer,
                                     penalty=fix.penalty)
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert loss.item() == pytest.approx(-0.49758610207837484, rel=1e-6)
    assert grad[0].tolist() == pytest.approx([0.002197224577336219, -0.5], rel=1e-6)
    assert metrics["penalty"] == pytest.approx(1e-3 * LOG(9) ** 2 / 2, rel=1e-6)


def test_tv_trust_with_pi_theta_equal_to_mu_drops_nothing_and_anchors_on_mu():
    train, sampler, mask = random_batch(seed=3)
    fix = TVTrustRegion(eps=0.2, kl_coef=1e-3)
    out = fix.in_update(view(sampler, sampler, torch.randn(mask.shape), mask, trainer=train))
    assert torch.equal(out.mask, mask) and out.counts["frac_tokens_dropped"][0] == 0
    batch = fix(train, sampler, mask)
    assert torch.equal(batch.old_logprobs[mask], sampler[mask])  # pi_old := mu


# ---------------------------------------------------------------- M2PO

# Log-ratios on 5 tokens of two rows: delta = 0.5, 0.1 | 0.1, 0.05, 0 -> m2 = 0.25, 0.01 | 0.01, 0.0025, 0.
# Mean of all: 0.2725 / 5 = 0.0545. Without the largest: 0.0225 / 4 = 0.005625.
M2_DELTA = [[0.5, 0.1, 0.0], [0.1, 0.05, 0.0]]
M2_MASK = torch.tensor([[True, True, False], [True, True, True]])


def m2po(threshold):
    sampler = torch.full((2, 3), -1.0, dtype=torch.float64)
    return SecondMomentMask(threshold)(sampler + torch.tensor(M2_DELTA, dtype=torch.float64), sampler, M2_MASK)


def test_m2po_masks_the_fewest_largest_second_moments_until_the_rest_is_below_tau():
    out = m2po(0.04)  # 0.0545 >= 0.04; without the 0.25 token 0.005625 < 0.04: one token goes
    assert out.mask.tolist() == [[False, True, False], [True, True, True]]
    assert out.metrics["second_moment"] == pytest.approx(0.0545)
    assert out.metrics["second_moment_kept"] == pytest.approx(0.005625)
    out = m2po(0.005)  # 0.005625 >= 0.005; without one 0.01 too: 0.0125 / 3 < 0.005, and its tie goes with it
    assert out.mask.tolist() == [[False, False, False], [False, True, True]]
    assert m2po(0.06).mask.tolist() == M2_MASK.tolist()  # already below: nothing masked


def test_m2po_keeps_only_the_smallest_when_no_cut_is_enough():
    sampler = torch.full((1, 3), -1.0, dtype=torch.float64)
    out = SecondMomentMask(1e-6)(sampler + torch.tensor([[0.5, 0.2, 0.3]], dtype=torch.float64), sampler,
                                 torch.ones(1, 3, dtype=torch.bool))
    assert out.mask.tolist() == [[False, True, False]]  # AReaL: every token but the smallest-m2 one


# ---------------------------------------------------------------- the sequence veto

def test_seq_veto_rejects_a_sequence_by_its_worst_token():
    sampler = torch.full((3, 3), -1.0, dtype=torch.float64)
    delta = torch.tensor([[0.1, -2.5, 0.0], [0.5, 0.5, 0.5], [LOG(1e-5), 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, True, True], [True, True, False]])
    out = SequenceVeto("k2", 2.5)(sampler + delta, sampler, mask)  # k2 = delta^2 / 2: 3.125 > 2.5 in row 0
    assert out.mask.any(dim=1).tolist() == [False, True, False]  # row 2: (log 1e-5)^2 / 2 = 66
    assert out.metrics["seq_score_worst"] == pytest.approx(LOG(1e-5) ** 2 / 2)
    out = SequenceVeto("min_ratio", 1e-4)(sampler + delta, sampler, mask)  # slime's: a ratio below 1e-4
    assert out.mask.any(dim=1).tolist() == [True, True, False]
    assert out.metrics["seq_score_worst"] == pytest.approx(1e-5)


def test_seq_veto_keeps_a_sequence_whose_score_is_the_threshold():
    sampler = torch.zeros((2, 1), dtype=torch.float64)
    delta = torch.tensor([[2.0], [LOG(0.5)]], dtype=torch.float64)  # k2: 2 and 0.24; ratio: e^2 and 0.5
    mask = torch.ones(2, 1, dtype=torch.bool)
    assert SequenceVeto("k2", 2.0)(sampler + delta, sampler, mask).mask.tolist() == [[True], [True]]
    assert SequenceVeto("k2", 1.99)(sampler + delta, sampler, mask).mask.tolist() == [[False], [True]]
    smallest = delta[1].exp().item()  # the ratio as the veto computes it
    assert SequenceVeto(VetoScore.min_ratio, smallest)(sampler + delta, sampler, mask).mask.tolist() == [[True], [True]]
    assert SequenceVeto("min_ratio", 0.51)(sampler + delta, sampler, mask).mask.tolist() == [[True], [False]]


@pytest.mark.parametrize("estimator,threshold,message", [
    ("k2", 0.0, "correction.threshold: must be > 0, got 0.0"),
    ("k3", math.nan, "correction.threshold: must be > 0, got nan"),
    ("min_ratio", 1.5, "correction.threshold: a smallest ratio must be in (0, 1], got 1.5"),
    ("min_ratio", 0.0, "correction.threshold: a smallest ratio must be in (0, 1], got 0.0"),
    ("k1", 1.0, "correction.estimator: must be one of k2, k3, min_ratio, got 'k1'"),
])
def test_seq_veto_refuses_a_threshold_outside_its_estimators_range(estimator, threshold, message):
    with pytest.raises(ValueError) as err:
        SequenceVeto(estimator, threshold)
    assert str(err.value) == message


# ---------------------------------------------------------------- stacks and self-normalisation

def test_normalize_after_truncation_rescales_the_truncated_weights_to_mean_one():
    train, sampler, mask = random_batch(seed=4)
    tis = TokenTIS(cap=1.2)(train, sampler, mask)
    stacked = Stack({"tis": TokenTIS(cap=1.2), "normalize": SelfNormalize()})(train, sampler, mask)
    mean = tis.weights[mask].double().mean()
    assert torch.allclose(stacked.weights[mask].double(), tis.weights[mask].double() / mean, rtol=1e-6)
    assert stacked.metrics["weight_mean"] == pytest.approx(1.0)
    assert stacked.metrics["normalize/norm_factor"] == pytest.approx(1 / mean.item())
    assert stacked.metrics["tis/frac_tokens_truncated"] == tis.metrics["frac_tokens_truncated"] > 0
    # the other order: normalize sees no weight yet (all 1) and does nothing, the truncation comes after
    reversed_ = Stack({"normalize": SelfNormalize(), "tis": TokenTIS(cap=1.2)})(train, sampler, mask)
    assert torch.equal(reversed_.weights, tis.weights) and not torch.allclose(reversed_.weights, stacked.weights)


def test_a_stack_ands_masks_and_multiplies_weights_each_stage_seeing_what_the_last_left():
    train, sampler, mask = random_batch(seed=5, noise=0.5)
    veto, band = SequenceVeto("k2", 0.3), TokenMask(low=0.6, high=1.6, reweight=False)
    out = Stack({"seq_veto": veto, "token_rs": band, "tis": TokenTIS(cap=1.5)})(train, sampler, mask)
    kept = veto(train, sampler, mask).mask & band(train, sampler, mask).mask
    assert 0 < kept.sum() < mask.sum() and torch.equal(out.mask, kept)
    tis = TokenTIS(cap=1.5)(train, sampler, mask)
    assert torch.equal(out.weights, torch.where(kept, tis.weights, 0.0))
    # each stage's fraction is of what reached it: token_rs sees only the sequences the veto kept
    reached = veto(train, sampler, mask).mask
    assert out.metrics["token_rs/frac_tokens_masked"] == pytest.approx(
        1 - (kept.sum() / reached.sum()).item())
    assert out.metrics["frac_tokens_masked"] == pytest.approx(1 - (kept.sum() / mask.sum()).item())


@pytest.mark.parametrize("veto", [SequenceVeto("min_ratio", 1e-4), build("seq_veto")], ids=["slime", "yaml"])
def test_slimes_stack_vetoes_on_every_response_token_whatever_ran_before(veto):
    """Issue 49's case: in slime's order `tis+token_rs+seq_veto+normalize` token_rs (r >= 0.5) drops the token whose
    ratio e^-9.5 < 1e-4 would trigger the veto before the veto runs; the veto still sees it, as slime's
    `calculate_veto_mask` tests the raw ratio on the loss mask, not on what its rejection kept. Row 1 is clean.

    The masks are slime's own `compute_mis_weights` (examples/train_infer_mismatch_helper/mis.py at commit
    624b824a898ab0ec1fcb4d373004c7f3852bf515, run outside rlmm with its mis.yaml: token truncate at 2, token rs at
    [0.5, 2], rs_veto_threshold 1e-4, tis_batch_normalize) on these log-probs: [[0, 0], [1, 1]]. Before the fix rlmm
    gave [[0, 1], [1, 1]] with `seq_veto/frac_sequences_masked` 0; with the veto first, [[0, 0], [1, 1]]."""
    train = torch.tensor([[-10.0, -1.0], [-1.0, -1.2]], dtype=torch.float64)
    sampler = torch.tensor([[-0.5, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.bool)
    slime = [[False, False], [True, True]]
    stages = {"tis": build("tis"), "token_rs": build("token_rs"), "seq_veto": veto, "normalize": build("normalize")}
    out = Stack(stages)(train, sampler, mask)
    assert out.mask.tolist() == slime
    assert out.metrics["seq_veto/frac_sequences_masked"] == 0.5
    first = Stack({"seq_veto": veto} | {k: v for k, v in stages.items() if k != "seq_veto"})(train, sampler, mask)
    assert first.mask.tolist() == slime and torch.equal(first.weights, out.weights)


@pytest.mark.parametrize("name", NAMES)
def test_a_stack_of_one_is_that_correction(name):
    train, sampler, mask = random_batch(seed=6)
    advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))
    alone, stacked = build(name), Stack({name: build(name)})
    staleness = mixed_staleness(mask)
    one, many = alone(train, sampler, mask, advantages, staleness), stacked(train, sampler, mask, advantages, staleness)
    assert torch.equal(one.old_logprobs, many.old_logprobs) and torch.equal(one.weights, many.weights)
    assert torch.equal(one.mask, many.mask)
    assert {k: many.metrics[k] for k in METRIC_KEYS} == pytest.approx({k: one.metrics[k] for k in METRIC_KEYS},
                                                                         nan_ok=True)
    own = {k: v for k, v in one.metrics.items() if k not in ("ratio_mean", "ratio_min", "ratio_max", "seq_ratio_max")}
    assert {k.removeprefix(f"{name}/"): v for k, v in many.metrics.items() if k.startswith(f"{name}/")} == \
        pytest.approx(own, nan_ok=True)
    theta = train + 0.2 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    micro = view(theta, sampler, advantages, one.mask, trainer=train, staleness=True)
    inside_one, inside_many = alone.in_update(micro), stacked.in_update(micro)
    assert torch.equal(inside_one.mask, inside_many.mask) and torch.equal(inside_one.weights, inside_many.weights)
    assert {f"{name}/{k}": v for k, v in inside_one.counts.items()} == inside_many.counts
    assert (inside_one.old_logprobs is None and inside_many.old_logprobs is None) or \
        torch.equal(inside_one.old_logprobs, inside_many.old_logprobs)


@pytest.mark.parametrize("name", NAMES)
def test_each_option_declares_the_pi_old_it_returns(name):
    """`old_policy` is what a stack reads to refuse two stages that disagree: it must be the side the batch stage
    really returns (the trainer's when it declares none)."""
    train, sampler, mask = random_batch(seed=7)
    fix = build(name)
    out = fix(train, sampler, mask, token_staleness=mixed_staleness(mask))
    assert fix.old_policy in (Anchor.sampler, Anchor.trainer, None), fix.old_policy
    side = sampler if fix.old_policy is Anchor.sampler else train
    assert torch.equal(out.old_logprobs[mask], side[mask]), fix.old_policy


@pytest.mark.parametrize("name", NAMES)
def test_in_update_contract(name):
    """Every option's in-update stage: detached weights >= 0 of the micro-batch's shape, a mask inside the one it
    was given, counts whose numerators do not exceed their denominators; a penalty, if any, differentiable and 0
    on tokens outside the mask; a replaced pi_old, if any, detached, finite on the mask and declared
    (`replaces_old_logprobs`); and where pi_theta, pi_old and mu are one policy, nothing dropped (and pi_old kept)."""
    train, sampler, mask = random_batch(seed=8)
    train, sampler = with_padding(train, mask, math.nan), with_padding(sampler, mask, math.inf)
    advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2))
    fix = build(name)
    theta = (train + 0.3).requires_grad_()
    out = fix.in_update(view(theta, sampler, advantages, mask, trainer=train, staleness=True))
    assert out.weights.shape == mask.shape and not out.weights.requires_grad and (out.weights >= 0).all()
    assert out.mask.dtype == torch.bool and not (out.mask & ~mask).any()
    assert all(0 <= n <= d for n, d in out.counts.values()), out.counts
    if out.penalty is not None:
        penalty = out.penalty(theta)
        assert penalty.requires_grad and (penalty[~mask] == 0).all() and torch.isfinite(penalty).all()
    assert fix.replaces_old_logprobs == (out.old_logprobs is not None)
    if out.old_logprobs is not None:
        assert out.old_logprobs.shape == mask.shape and not out.old_logprobs.requires_grad
        assert torch.isfinite(out.old_logprobs[mask]).all()
    same = fix.in_update(view(train, train, advantages, mask, trainer=train, staleness=True))
    assert torch.equal(same.mask, mask) and (same.weights[mask] == 1).all()
    assert same.old_logprobs is None or torch.equal(same.old_logprobs[mask], train[mask])


def test_a_stack_refuses_stages_that_disagree():
    with pytest.raises(ValueError, match=r"correction=bypass\+tis: the stages want different log-probs as PPO's "
                                         r"pi_old \(bypass the sampler's, tis the trainer's\)"):
        Stack({"bypass": build("bypass"), "tis": build("tis")})
    with pytest.raises(ValueError, match=r"icepop and tis both weight tokens by the importance ratio"):
        Stack({"icepop": build("icepop"), "tis": build("tis")})
    with pytest.raises(ValueError, match="a stack needs at least one stage"):
        Stack({})
    Stack({"token_rs": build("token_rs"), "tis": build("tis")})  # icepop's band as a mask: fine
    Stack({"tv_trust": build("tv_trust"), "m2po": build("m2po")})  # the sampler's pi_old and a mask: fine


def test_stacked_spelling_composes_every_stage_with_its_own_parameters():
    from hydra import compose, initialize_config_dir

    import rlmm.config.schema  # noqa: F401

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["correction=seq_veto+token_rs+tis", "correction.stages.tis.cap=3"],
                      return_hydra_config=True)
    assert cfg.hydra.runtime.choices.correction == "seq_veto+token_rs+tis"
    built = instantiate(cfg.correction)
    assert list(built.stages) == ["seq_veto", "token_rs", "tis"] and built.stages["tis"].cap == 3.0
    assert built.stages["seq_veto"].threshold == from_yaml("correction", "seq_veto").threshold


# ---------------------------------------------------------------- the loss: CISPO, dual clip, divisor

def grpo(**values):
    return from_yaml("algo", "grpo", **values)


def test_cispo_loss_and_gradient_by_hand():
    """loss = -Σ sg(clip(r, 1 - low, 1 + high)) A log π / n: the clipped weight never removes a gradient."""
    cispo = from_yaml("algo", "cispo", objective=CISPO(clip_low=0.2, clip_high=0.2))
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    logprobs = (old + torch.tensor([[LOG(1.5), LOG(0.5), 0.0]])).requires_grad_()  # r = 1.5, 0.5, 1
    advantages = torch.tensor([1.0])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, metrics = cispo.policy_loss(logprobs, old, advantages, mask, torch.ones(1, 3))
    weights = [1.2, 0.8, 1.0]  # clipped to [0.8, 1.2]
    expected = -sum(w * lp for w, lp in zip(weights, logprobs[0].tolist())) / 3
    assert loss.item() == pytest.approx(expected)
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert grad[0].tolist() == pytest.approx([-w / 3 for w in weights])  # PPO's clip would zero token 0's
    assert metrics["clipfrac_high"] == pytest.approx(1 / 3) and metrics["clipfrac_low"] == pytest.approx(1 / 3)
    clipped, _ = grpo(objective=ClippedSurrogate(0.2, 0.2, None)).policy_loss(logprobs, old, advantages, mask, torch.ones(1, 3))
    (ppo_grad,) = torch.autograd.grad(clipped, logprobs)
    assert ppo_grad[0, 0] == 0  # the ratio 1.5 > 1.2 with A > 0: PPO's clip removes it


def test_dual_clip_bounds_a_negative_advantages_loss_by_c_times_its_size():
    """A < 0 and r = 5: PPO's term is -A r = 5 |A|, unbounded in r; the dual clip bounds it by c |A| = 3 |A|, and
    that token's gradient is gone; A > 0 is untouched."""
    old = torch.tensor([[-2.0, -2.0]])
    logprobs = (old + torch.tensor([[LOG(5.0), LOG(5.0)]])).requires_grad_()
    advantages = torch.tensor([[-1.0, 1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    plain, _ = grpo().policy_loss(logprobs, old, advantages, mask, torch.ones(1, 2))
    dual, metrics = grpo(objective=ClippedSurrogate(0.2, 0.28, dual_clip=3.0)).policy_loss(logprobs, old, advantages, mask, torch.ones(1, 2))
    assert plain.item() == pytest.approx((5.0 - 1.28) / 2)  # -A r for A < 0; -clip(r) A for A > 0
    assert dual.item() == pytest.approx((3.0 - 1.28) / 2)
    (grad,) = torch.autograd.grad(dual, logprobs)
    assert grad.tolist() == [[0.0, 0.0]]  # both clipped
    assert metrics["clipfrac_dual"] == pytest.approx(0.5)


def test_clipfrac_is_in_the_losss_dtype():
    """A share of 1/3 in float64 inputs is float64's 1/3, not float32's 0.3333333432674408."""
    logprobs = torch.tensor([[0.0, -5.0, -5.0]], dtype=torch.float64)  # against -5: r = e^5, 1, 1
    _, metrics = grpo().policy_loss(logprobs, torch.full((1, 3), -5.0, dtype=torch.float64), torch.tensor([1.0]),
                                    torch.ones(1, 3, dtype=torch.bool), torch.ones(1, 3))
    assert metrics["clipfrac"] == metrics["clipfrac_high"] == 1 / 3


def test_count_rejected_keeps_rejected_tokens_in_the_divisor():
    kept = torch.tensor([[True, False, True], [False, False, True]])
    response = torch.tensor([[True, True, True], [True, False, True]])
    assert grpo().loss_normalizer(kept, max_length=3, response_mask=response) == 3.0
    assert grpo(count_rejected=True).loss_normalizer(kept, max_length=3, response_mask=response) == 5.0


# prime-rl's default_loss_fn on a seeded batch (tv_trust's anchor: DefaultLossConfig(dppo_mask_low=0.2,
# dppo_mask_high=0.2, kl_tau=1e-3), src/prime_rl/trainer/rl/loss.py at 559b44772e471d1538537b8805cc77f3824a5e64, run
# outside rlmm through its `compute_loss` with its beartype/jaxtyping/config imports stubbed): log pi_theta and log mu
# of 4 rows of lengths 6, 4, 5, 3 with A = +1, -1, 0, +0.5 (torch.Generator seed 0: mu = -1.5 U, pi_theta = mu + N(0, 1)
# clamped at 0, float64), and the per-sample metrics it logs.
PRIME_THETA = [[-1.2163614445416588, -0.3282014280723978, -2.0109562438333137, -0.06631016098581699, -2.455031815834881, -1.9002971779173135], [0.0, -1.479547076294177, -4.0173076528344955, -0.5460851157801978, 0.0, -0.9304027698437377], [-1.1201227358688386, 0.0, 0.0, 0.0, -1.9918590134054297, -2.362908907630404], [-0.9499807097749838, -1.5628796482760468, -0.5905846315697384, -0.12851905128527263, 0.0, -0.7934837065039131]]
PRIME_MU = [[-1.4550795027098296, -1.061729796599682, -0.6890744146911763, -1.3811215261829404, -0.9675361801841471, -1.1867218382704556], [-0.2679092628011264, -0.5266614365908926, -0.8720113797113618, -0.4323538382042253, -0.6793032733216713, -0.26519928930557113], [-0.5329001375089597, -0.9328578730192916, -0.7227726011725628, -0.6612007485665392, -0.6109223615466624, -0.30815789019238066], [-0.9975572636252241, -1.1773108506826766, -0.31554971237757684, -1.0151086813765187, -0.1646028903561691, -0.7856280891033651]]
PRIME_LENGTHS, PRIME_ADVANTAGES = [6, 4, 5, 3], [1.0, -1.0, 0.0, 0.5]
PRIME_SPLIT = {  # rlmm's key: prime-rl's per-sample values (its metric name in DROP_SPLIT_KEYS' comments)
    "kl_k3_dropped": [0.8790619444244427, 1.263431358012942, 0.3876856431679554, 0.0],
    "kl_k3_kept": [0.38407891603370703, 0.022774146487918534, 0.4073952625443303, 0.03378765088319402],
    "dropped_advantage_positive": [1.0, 0.0, 0.0, 0.0],
    "dropped_advantage_negative": [0.0, 1.0, 0.0, 0.0],
}
PRIME_IS_MASKED = [1 / 3, 0.5, 0.4, 0.0]


@pytest.mark.parametrize("micro_batches", [[[0, 1, 2, 3]], [[0, 3], [1], [2]]])
def test_the_kept_and_dropped_split_is_prime_rls_whatever_the_micro_batching(micro_batches):
    """tv_trust at prime-rl's defaults through the step's path (`OldPolicy.score`, `in_update`, `drop_split`, the
    step's `InUpdateCounts`), pi_old = pi_theta as in the update's first forward: the mismatch KL over the dropped and
    the kept tokens and the advantage sign of the dropped ones are prime-rl's (the mean over samples of each sample's
    mean, 0 where a sample has none: row 2's dropped tokens have A = 0, neither sign), however the rows are cut."""
    from rlmm.corrections.base import drop_split
    from rlmm.run.step import InUpdateCounts, OldPolicy

    theta = torch.tensor(PRIME_THETA, dtype=torch.float64)
    mu = torch.tensor(PRIME_MU, dtype=torch.float64)
    mask = torch.arange(6)[None] < torch.tensor(PRIME_LENGTHS)[:, None]
    advantages = torch.tensor(PRIME_ADVANTAGES, dtype=torch.float64)[:, None].expand(4, 6) * mask
    old = OldPolicy.score(theta, mu, mask, advantages, torch.ones(4), TVTrustRegion(eps=0.2, kl_coef=1e-3),
                          ratio_cap=2.0, also_checked={})
    counts = InUpdateCounts()
    dropped_shares = {}
    for rows in micro_batches:
        view = old.micro_batch(rows, theta[rows])
        fix = TVTrustRegion(eps=0.2, kl_coef=1e-3).in_update(view)
        counts.add(drop_split(view, mask[rows], fix.mask))
        for row, share in zip(rows, (mask[rows] & ~fix.mask).sum(1) / mask[rows].sum(1)):
            dropped_shares[row] = share.item()
    assert [dropped_shares[row] for row in range(4)] == pytest.approx(PRIME_IS_MASKED)
    logged = counts.over_ranks()
    for key, per_sample in PRIME_SPLIT.items():
        assert logged[key] == pytest.approx(sum(per_sample) / 4, rel=1e-12), key


def test_the_split_of_a_correction_that_drops_nothing_is_zero_dropped_and_the_whole_kl_kept():
    from rlmm.corrections.base import drop_split

    train, sampler, mask = random_batch(seed=5)
    split = drop_split(view(train, sampler, torch.randn(mask.shape), mask), mask, mask)
    assert split["kl_k3_dropped"] == (0.0, mask.size(0)) and split["dropped_advantage_positive"][0] == 0.0
    delta = torch.where(mask, train.double() - sampler.double(), 0.0)
    per_row = (torch.where(mask, delta.exp() - 1 - delta, 0.0).sum(1) / mask.sum(1).clamp_min(1)).sum().item()  # an empty row: 0
    assert split["kl_k3_kept"][0] == pytest.approx(per_row)
