"""Issue 49's variants against the anchors' own code: each figure below was computed by running the anchor's function
(read from the commit named in the test's docstring with git, loaded by name and run outside rlmm in a scratch folder
with the project's venv, its framework imports stubbed) on the batch below, and is stored here as a fixture; none of
the anchors' code is in the project. The batch goes through the step's own path: `OldPolicy.score` (the batch stage),
`in_update`, the step's divisor and `algo.policy_loss` with the arguments `rl_update` gives it."""
from __future__ import annotations

import pytest
import torch

from rlmm.algos.grpo import GRPO
from rlmm.algos.surrogate import CISPO, ClippedSurrogate
from rlmm.corrections.dppo_tv import ProximalTVTrustRegion
from rlmm.corrections.tv_trust import TVTrustRegion

# Probabilities; rows 2 and 3 are padded after two tokens (the padding's values are finite, as the anchors need).
OLD = [[0.05, 0.5, 0.3, 0.9], [0.6, 0.2, 0.4, 0.7], [0.5, 0.1, 0.5, 0.5], [0.5, 0.3, 0.5, 0.5]]  # pi_old (trainer)
MU = [[0.04, 0.55, 0.1, 0.88], [0.62, 0.25, 0.38, 0.7], [0.45, 0.12, 0.5, 0.5], [0.5, 0.28, 0.5, 0.5]]  # mu (sampler)
THETA = [[0.2, 0.8, 0.35, 0.95], [0.3, 0.1, 0.45, 0.75], [0.2, 0.12, 0.5, 0.5], [0.25, 0.3, 0.5, 0.5]]  # pi_theta
ADV = [1.0, -0.5, -1.0, 0.0]
MASK = [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]]


def batch():
    lp = lambda p: torch.tensor(p, dtype=torch.float64).log()  # noqa: E731
    return (lp(OLD), lp(MU), lp(THETA), torch.tensor(ADV, dtype=torch.float64)[:, None].expand(4, 4).clone(),
            torch.tensor(MASK, dtype=torch.bool))


def algo(objective="clip", clip_low=0.2, clip_high=0.2, dual_clip=None, aggregation="token", count_rejected=False):
    """GRPO with PPO's clipped surrogate ("clip") or CISPO's ("cispo") objective."""
    built = ClippedSurrogate(clip_low, clip_high, dual_clip) if objective == "clip" else CISPO(clip_low, clip_high)
    return GRPO(group_size=2, normalize_std=True, objective=built, loss_aggregation=aggregation, kl_coef=0.0,
                kl_estimator="k3", entropy_coef=0.0, count_rejected=count_rejected, epochs=1, minibatches=1)


def step_loss(correction, algorithm, old=None, mu=None, theta=None, advantages=None, mask=None):
    """The loss, d loss / d log pi_theta on the response tokens, the loss's metrics and the correction's (both
    places) of one micro-batch holding the whole batch, as `rl_update` builds them."""
    from rlmm.run.step import InUpdateCounts, OldPolicy, loss_normalizer_over_ranks

    b_old, b_mu, b_theta, b_adv, b_mask = batch()
    old = b_old if old is None else old
    mu, theta = (b_mu if mu is None else mu), (b_theta if theta is None else theta)
    advantages, mask = (b_adv if advantages is None else advantages), (b_mask if mask is None else mask)
    rows = list(range(mask.size(0)))
    scored = OldPolicy.score(old, mu, mask, advantages, torch.ones(mask.size(0)), correction, ratio_cap=2.0,
                             also_checked={})
    normalizer = loss_normalizer_over_ranks(algorithm, scored.mask[rows], mask[rows], max_length=mask.size(1))
    logprobs = theta.clone().requires_grad_()
    view = scored.micro_batch(rows, logprobs)
    fix = correction.in_update(view)
    counts = InUpdateCounts()
    counts.add(fix.counts)
    loss, metrics = algorithm.policy_loss(logprobs, view.old_logprobs, view.advantages, view.mask & fix.mask,
                                          view.weights * fix.weights, max_length=mask.size(1), normalizer=normalizer,
                                          penalty=fix.penalty)
    (grad,) = torch.autograd.grad(loss, logprobs)
    return loss.item(), grad[mask].tolist(), metrics, scored.correction_metrics | counts.over_ranks()


# ---------------------------------------------------------------- DPPO's TV trust region, both anchors

# verl's compute_policy_loss_dppo_tv (verl-project/verl 1dda039b9c6311889a9c9a26040677e1254814f9,
# verl/trainer/ppo/core_algos.py) with clip_ratio 0.2, clip_ratio_c 3.0, token-mean, on the batch above: loss,
# d loss / d log_prob on the response tokens (row-major), pg_clipfrac, pg_clipfrac_lower.
VERL_DPPO_TV = {
    "pi_old": (0.1986675538308491, [-0.25, 0.0, -0.09722222222222222, -0.08796296296296297, 0.0, 0.020833333333333336,
                                    0.046875, 0.04464285714285715, 0.0, 0.09999999999999998, 0.0, 0.0],
               0.3333333330555555, 0.08333333326388888),
    "mu": (0.1396658849791003, [-0.25, 0.0, 0.0, -0.08996212121212122, 0.0, 0.01666666666666667,
                                0.04934210526315789, 0.04464285714285715, 0.0, 0.08333333333333333, 0.0, 0.0],
           0.41666666631944443, 0.08333333326388888),
}


@pytest.mark.parametrize("anchor", ["pi_old", "mu"])
def test_dppo_tv_is_verls_loss_with_either_anchor(anchor):
    """verl's DPPO-Binary-TV with old = pi_old (decoupled mode) is ``correction=dppo_tv``, with old = mu (bypass mode)
    ``correction=tv_trust correction.kl_coef=0`` (prime-rl's sampler anchor, without its penalty); both with
    ``algo=cispo algo.objective.clip_low=1 algo.objective.clip_high=2``: verl's truncated weight sg(min(r, c)) at c = 3 is CISPO's over
    [0, c]. Figures: verl-project/verl at 1dda039b9c6311889a9c9a26040677e1254814f9 (VERL_DPPO_TV). Token 0 of row 0
    has r = 4 > c (weight 3, kept: it moved 0.15 <= eps); four tokens leave the region (one high, three low, one of
    them with A = 0). Token 2 of row 0 moved 0.05 from pi_old and 0.25 from mu: the sampler's region drops it,
    the trainer's keeps it."""
    correction = ProximalTVTrustRegion(eps=0.2) if anchor == "pi_old" else TVTrustRegion(eps=0.2, kl_coef=0.0)
    loss, grad, metrics, fixes = step_loss(correction, algo("cispo", clip_low=1.0, clip_high=2.0))
    want_loss, want_grad, clipfrac, clipfrac_lower = VERL_DPPO_TV[anchor]
    assert loss == pytest.approx(want_loss, rel=1e-9)
    assert grad == pytest.approx(want_grad, rel=1e-9, abs=1e-15)
    assert fixes["frac_tokens_dropped"] == pytest.approx(clipfrac, rel=1e-7)  # verl's pg_clipfrac
    # verl's pg_clipfrac_lower, the truncated share of the response tokens; rlmm's clipfrac_high is of the kept ones
    assert metrics["clipfrac_high"] * metrics["num_tokens"] / 12 == pytest.approx(clipfrac_lower, rel=1e-7)


# ---------------------------------------------------------------- CISPO's absolute cap, as TRL writes it

# TRL's GRPOTrainer._compute_loss with loss_type "cispo" (huggingface/trl f2cd57710ae345ea6428ae95363267fcf38a3dc8,
# trl/trainer/grpo_trainer.py; its model forward stubbed to return pi_theta, old_per_token_logps pi_old,
# num_items_in_batch the 12 response tokens) at epsilon_high 0.2 (TRL's default: epsilon_high = epsilon) and 0.9:
# loss, d loss / d log pi_theta on the response tokens, cispo_clip_ratio.
TRL_CISPO = {
    0.2: (-0.05153963998324033, [-1 / 60] * 4 + [1 / 120] * 4 + [1 / 60, 1 / 60, 0.0, 0.0], 1 / 3),
    0.9: (-0.1064258352844943, [-0.075] * 4 + [0.02083333333333333, 0.020833333333333336, 0.0375, 0.0375,
                                                0.03333333333333333, 0.075, 0.0, 0.0], 1 / 3),
}


@pytest.mark.parametrize("epsilon_high", sorted(TRL_CISPO))
def test_cispo_with_trls_absolute_cap_below_one(epsilon_high):
    """TRL's CISPO weights a token by sg(min(r, epsilon_high)), an absolute cap that may be below 1 (TRL's default
    0.2): rlmm's CISPO weight is sg(clip(r, 1 - clip_low, 1 + clip_high)), so TRL's cap is ``algo=cispo
    algo.objective.clip_low=1 algo.objective.clip_high=<epsilon_high - 1>`` (-0.8 for TRL's default), which rlmm refused before issue 49.
    Figures: TRL at f2cd57710ae345ea6428ae95363267fcf38a3dc8 (TRL_CISPO). TRL's ``cispo_clip_ratio`` counts the
    capped tokens with A > 0 only (rlmm's clipfrac_high counts every capped token)."""
    from rlmm.corrections.none import NoCorrection

    old, _, theta, advantages, mask = batch()
    loss, grad, metrics, _ = step_loss(NoCorrection(), algo("cispo", clip_low=1.0, clip_high=epsilon_high - 1.0))
    want_loss, want_grad, clip_ratio = TRL_CISPO[epsilon_high]
    assert loss == pytest.approx(want_loss, rel=1e-9)
    assert grad == pytest.approx(want_grad, rel=1e-9, abs=1e-15)
    r = (theta - old).exp()
    assert ((r > epsilon_high) & mask & (advantages > 0)).sum().item() / 12 == pytest.approx(clip_ratio)
    assert metrics["clipfrac_high"] == pytest.approx(((r > epsilon_high) & mask).sum().item() / 12)


@pytest.mark.parametrize(("clip_low", "clip_high", "message"), [
    (1.0, -1.0, "algo.objective.clip_high: CISPO's cap 1 + clip_high must be > 0, got clip_high -1.0"),
    (0.2, -0.5, "algo.objective.clip_high: CISPO's range [1 - clip_low, 1 + clip_high] is empty: [0.8, 0.5]"),
])
def test_cispo_refuses_a_cap_that_is_no_range(clip_low, clip_high, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("+", r"\+")):
        algo("cispo", clip_low=clip_low, clip_high=clip_high)


def test_the_clipped_surrogate_still_refuses_clip_high_at_or_below_zero():
    with pytest.raises(ValueError, match="algo.objective.clip_high: must be > 0, got -0.8"):
        algo("clip", clip_high=-0.8)


# ---------------------------------------------------------------- verl's bypass mode

# verl's compute_policy_loss_bypass_mode with loss_type "reinforce" (verl-project/verl
# 1dda039b9c6311889a9c9a26040677e1254814f9, verl/trainer/ppo/core_algos.py and rollout_corr_helper.py; old_log_prob =
# rollout_log_prob = mu, batch_num_tokens 12 as its engine counts the loss mask) on the batch above, for two of its
# presets: loss, d loss / d log_prob on the response tokens, rollout_rs_masked_fraction.
VERL_BYPASS = {
    "bypass_pg_is": (0.3038183217986717, [-1 / 6] * 4 + [0.010232233810332282] * 4 + [1 / 27, 1 / 27, 0.0, 0.0], 0.0),
    "bypass_pg_geo_rs_token_tis": (-0.35119050351662673, [0.0] * 4 + [
        0.02016129032258064, 0.01666666666666667, 0.04934210526315789, 0.04464285714285715, 0.037037037037037035,
        0.08333333333333333, 0.0, 0.0], 1 / 3),
}


def REINFORCE():  # noqa: N802
    """-w A log pi_theta: CISPO's weight held in [1 - 0, 1 + 0] (algo=cispo algo.objective.clip_low=0 algo.objective.clip_high=0)."""
    return algo("cispo", clip_low=0.0, clip_high=0.0)


BYPASS_STAGES = {"bypass_pg_is": {"seq_tis": {}},  # rollout_is sequence, threshold 2 (seq_tis.yaml's cap)
                 # rollout_is token at 2, rollout_rs seq_mean_k1 "0.5_2.0"
                 "bypass_pg_geo_rs_token_tis": {"tis": {}, "geo_rs": {"low": 0.5, "high": 2.0}}}


@pytest.mark.parametrize("preset", sorted(VERL_BYPASS))
def test_bypass_is_with_reinforce_is_verls_bypass_mode(preset):
    """verl's bypass mode with loss_type reinforce: old = mu, the IS weights and rejection computed under no_grad from
    pi_theta against mu (not pi_old), and -A * log pi_theta * w over the kept tokens, the rejected ones in the divisor.
    ``correction=bypass_is algo=cispo algo.objective.clip_low=0 algo.objective.clip_high=0`` (CISPO's weight held at 1: REINFORCE)
    is verl's ``bypass_pg_is``; with ``correction.stages`` {tis, geo_rs} its ``bypass_pg_geo_rs_token_tis``. Figures: verl-project/verl at 1dda039b9c6311889a9c9a26040677e1254814f9
    (VERL_BYPASS). Row 0's geometric-mean ratio pi_theta / mu is 2.29 (rejected at 2); on pi_old / mu it is 1.37, so a
    rejection on the trainer's recomputation would keep it: the stages must read pi_theta."""
    from rlmm.corrections.on_current_policy import OnCurrentPolicy

    loss, grad, metrics, fixes = step_loss(OnCurrentPolicy(BYPASS_STAGES[preset]), REINFORCE())
    want_loss, want_grad, masked = VERL_BYPASS[preset]  # rlmm's weights are float32 (the corrections' contract)
    assert loss == pytest.approx(want_loss, rel=1e-6)
    assert grad == pytest.approx(want_grad, rel=1e-6, abs=1e-15)
    assert fixes["frac_tokens_dropped"] == pytest.approx(masked, rel=1e-7)


def test_bypass_is_yaml_is_verls_bypass_pg_is_preset():
    from rlmm.config.options import from_yaml

    loss, grad, _, _ = step_loss(from_yaml("correction", "bypass_is"), REINFORCE())
    assert loss == pytest.approx(VERL_BYPASS["bypass_pg_is"][0], rel=1e-6)
    assert grad == pytest.approx(VERL_BYPASS["bypass_pg_is"][1], rel=1e-6, abs=1e-15)


def test_reinforce_is_minus_a_log_pi_whatever_the_ratio():
    from rlmm.corrections.none import NoCorrection

    old, _, theta, advantages, mask = batch()
    loss, grad, _, _ = step_loss(NoCorrection(), REINFORCE())
    assert loss == pytest.approx(-(advantages * theta)[mask].sum().item() / 12, rel=1e-12)
    assert grad == pytest.approx((-advantages[mask] / 12).tolist(), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize(("stages", "message"), [
    ({"foo": {}}, "correction.stages.foo: unknown correction (allowed: bypass, "),
    ({"tis": {"cpa": 3}}, "correction.stages.tis: unknown key 'cpa' (allowed: cap)"),
    ({"tv_trust": {}}, "correction.stages.tv_trust: acts inside the update (TVTrustRegion.in_update)"),
])
def test_bypass_is_refuses_stages_it_cannot_run(stages, message):
    from rlmm.corrections.on_current_policy import OnCurrentPolicy

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        OnCurrentPolicy(stages)


# ---------------------------------------------------------------- sequence-level self-normalisation

# The batch's pi_old and mu with a fifth sample whose response is empty, sequence TIS at 2, then normalised to mean 1
# over sequences: verl's compute_rollout_correction_weights (verl-project/verl 1dda039b9c6311889a9c9a26040677e1254814f9,
# rollout_is "sequence", rollout_is_batch_normalize) and slime's compute_mis_weights (THUDM/slime
# 624b824a898ab0ec1fcb4d373004c7f3852bf515, examples/train_infer_mismatch_helper/mis.py: tis_level sequence,
# tis_mode truncate at 2, tis_batch_normalize): each sequence's weight and the mean the weights were divided by.
SEQ_NORMALIZE = {
    "verl": ([1.6624084567298154, 0.6773820536759859, 0.769633544782322, 0.8905759589624008, 0.0],
             1.2030737643949871),
    "slime": ([2.0780105635610346, 0.8467275640995727, 0.9620419275745533, 1.1132199447648397, 0.0],
              0.9624590149208145),
}


def with_empty_sample():
    old, mu, _, _, mask = batch()
    half = torch.full((1, 4), 0.5, dtype=torch.float64).log()
    return torch.cat([old, half]), torch.cat([mu, half]), torch.cat([mask, torch.zeros(1, 4, dtype=torch.bool)])


@pytest.mark.parametrize("anchor", sorted(SEQ_NORMALIZE))
def test_seq_normalize_is_verls_and_slimes_sequence_batch_normalisation(anchor):
    """``correction=seq_tis+seq_normalize`` is verl's sequence-level batch normalisation (the mean over the rows with
    a response token); with ``correction.stages.seq_normalize.count_empty=true`` slime's (over every sample, the
    empty one counting 0): 5/4 of verl's factor here. Figures: verl at 1dda039b9c6311889a9c9a26040677e1254814f9,
    slime at 624b824a898ab0ec1fcb4d373004c7f3852bf515 (SEQ_NORMALIZE)."""
    from rlmm.corrections.seq_normalize import SequenceSelfNormalize
    from rlmm.corrections.seq_tis import SequenceTIS
    from rlmm.corrections.stack import Stack

    old, mu, mask = with_empty_sample()
    stack = Stack({"seq_tis": SequenceTIS(cap=2.0),
                   "seq_normalize": SequenceSelfNormalize(count_empty=anchor == "slime")})
    out = stack(old, mu, mask)
    weights, mean = SEQ_NORMALIZE[anchor]
    assert out.weights[:, 0].tolist() == pytest.approx(weights, rel=1e-6)  # float32 weights
    assert (out.weights == out.weights[:, :1]).where(mask, True).all()  # one weight per sequence
    assert out.metrics["seq_normalize/norm_factor"] == pytest.approx(1 / mean, rel=1e-6)


def test_seq_normalize_differs_from_the_token_mean_where_lengths_differ():
    """`normalize` divides by the token mean (long rows weigh more), `seq_normalize` by the sequence mean."""
    from rlmm.corrections.normalize import SelfNormalize
    from rlmm.corrections.seq_normalize import SequenceSelfNormalize
    from rlmm.corrections.seq_tis import SequenceTIS
    from rlmm.corrections.stack import Stack

    old, mu, mask = with_empty_sample()
    by_token = Stack({"seq_tis": SequenceTIS(cap=2.0), "normalize": SelfNormalize()})(old, mu, mask)
    by_sequence = Stack({"seq_tis": SequenceTIS(cap=2.0), "seq_normalize": SequenceSelfNormalize(False)})(old, mu, mask)
    assert by_token.weights[mask].double().mean().item() == pytest.approx(1.0, rel=1e-6)
    assert by_sequence.weights[:4, 0].double().mean().item() == pytest.approx(1.0, rel=1e-6)
    assert by_sequence.weights[mask].double().mean().item() != pytest.approx(1.0, rel=1e-3)


# ---------------------------------------------------------------- slime's per-sample mean over every sample

# slime's default loss (THUDM/slime 624b824a898ab0ec1fcb4d373004c7f3852bf515: compute_policy_loss of
# slime/utils/ppo_utils.py at eps_clip 0.2 / 0.28, times examples/train_infer_mismatch_helper/mis.py's weights (token
# truncate at 2, geometric rejection [0.9, 1.1]: row 0, at 1.37, rejected), reduced by
# slime/backends/megatron_utils/cp_utils.py's get_sum_of_sample_mean with each row's original length as its
# denominator and divided by the step's 4 samples as loss_function does): loss and d loss / d log pi_theta.
SLIME_SAMPLE_MEAN = (0.3507933813027192, [0.0] * 6 + [0.037006578947368425, 0.03348214285714286, 0.0, 0.125, 0.0,
                                                       0.0])


@pytest.mark.parametrize("count_rejected", [True, False])
def test_sequence_aggregation_is_slimes_per_sample_mean_with_count_rejected(count_rejected):
    """slime divides the sum of per-sample means by every sample of the step, a rejected one included: rlmm's
    ``algo.loss_aggregation=sequence algo.count_rejected=true`` (the rows with a response token); with
    count_rejected false the rejected row leaves the divisor, 4/3 of slime's here. Figures: slime at
    624b824a898ab0ec1fcb4d373004c7f3852bf515 (SLIME_SAMPLE_MEAN)."""
    from rlmm.corrections.geo_rs import GeometricRejection
    from rlmm.corrections.stack import Stack
    from rlmm.corrections.tis import TokenTIS

    correction = Stack({"tis": TokenTIS(cap=2.0), "geo_rs": GeometricRejection(low=0.9, high=1.1)})
    loss, grad, _, fixes = step_loss(correction, algo(clip_low=0.2, clip_high=0.28, aggregation="sequence",
                                                      count_rejected=count_rejected))
    assert fixes["frac_sequences_masked"] == 0.25
    scale = 1.0 if count_rejected else 4 / 3
    assert loss == pytest.approx(SLIME_SAMPLE_MEAN[0] * scale, rel=1e-6)  # float32 weights
    assert grad == pytest.approx([g * scale for g in SLIME_SAMPLE_MEAN[1]], rel=1e-6, abs=1e-15)


# ---------------------------------------------------------------- verl's geometric rejection bounds

def test_verls_seq_mean_k1_bounds_are_geo_rs_with_the_bounds_inverted():
    """verl's ``rollout_rs: seq_mean_k1`` with ``rollout_rs_threshold: "lo_hi"`` bounds the mean of k1 = -log r by
    [log lo, log hi], so it keeps g in [1/hi, 1/lo]: its "0.999_1.001" preset is ``correction=geo_rs
    correction.low=0.999000999 correction.high=1.001001001`` (geo_rs's own 0.999 / 1.001 differ at the edges).
    Keep masks of compute_rollout_rejection_mask (verl-project/verl 1dda039b9c6311889a9c9a26040677e1254814f9) on
    sequences of three tokens with these geometric-mean ratios: [1, 1, 0, 1, 0, 0]."""
    from rlmm.corrections.geo_rs import GeometricRejection

    g = torch.tensor([1.0009, 1.00100095, 1.0011, 0.9991, 0.99899905, 0.9989], dtype=torch.float64)
    sampler = torch.full((6, 3), -1.0, dtype=torch.float64)
    mask = torch.ones(6, 3, dtype=torch.bool)
    verl = GeometricRejection(low=1 / 1.001, high=1 / 0.999)(sampler + g.log()[:, None], sampler, mask)
    assert verl.mask[:, 0].tolist() == [True, True, False, True, False, False]
    shipped = GeometricRejection(low=0.999, high=1.001)(sampler + g.log()[:, None], sampler, mask)
    assert shipped.mask[:, 0].tolist() == [True, False, False, True, False, False]  # 1.00100095 > 1.001


# ---------------------------------------------------------------- the loss's metrics as the anchors log them

# verl's compute_policy_loss_vanilla (verl-project/verl 1dda039b9c6311889a9c9a26040677e1254814f9) with clip_ratio_low
# 0.2, clip_ratio_high 0.28, clip_ratio_c 3 (always on in verl), token-mean, on the batch with row 1's second token at
# pi_theta 0.7 (r = 3.5 > c under A = -0.5): loss, d loss / d log_prob, pg_clipfrac, ppo_kl, pg_clipfrac_lower.
VERL_VANILLA = (0.017999338624338612, [0.0, 0.0, -0.09722222222222222, -0.08796296296296297, 0.0, 0.0, 0.046875,
                                       0.04464285714285715, 0.0, 0.09999999999999998, 0.0, 0.0],
                0.3333333330555555, -0.11531593581238433, 0.08333333326388888)


def test_ppo_kl_clipfrac_and_clipfrac_dual_are_verls_ppo_kl_pg_clipfrac_and_pg_clipfrac_lower():
    """verl's PPO logs ``actor/ppo_kl`` = mean(log pi_old - log pi_theta) (k1 of KL(pi_old || pi_theta)),
    ``pg_clipfrac`` and ``pg_clipfrac_lower`` (the dual clip's share: A < 0 and r > c); rlmm's loss/ppo_kl,
    loss/clipfrac and loss/clipfrac_dual with ``algo.objective.dual_clip=3``. Figures: verl at
    1dda039b9c6311889a9c9a26040677e1254814f9 (VERL_VANILLA)."""
    import math

    from rlmm.corrections.none import NoCorrection

    _, _, theta, _, _ = batch()
    theta[1, 1] = math.log(0.7)
    loss, grad, metrics, _ = step_loss(NoCorrection(), algo(clip_low=0.2, clip_high=0.28, dual_clip=3.0), theta=theta)
    want_loss, want_grad, clipfrac, ppo_kl, clipfrac_lower = VERL_VANILLA
    assert loss == pytest.approx(want_loss, rel=1e-9)
    assert grad == pytest.approx(want_grad, rel=1e-9, abs=1e-15)
    assert metrics["clipfrac"] == pytest.approx(clipfrac, rel=1e-7)
    assert metrics["ppo_kl"] == pytest.approx(ppo_kl, rel=1e-7)
    assert metrics["clipfrac_dual"] == pytest.approx(clipfrac_lower, rel=1e-7)


# ---------------------------------------------------------------- the correction's weights as verl logs them

# verl's compute_rollout_correction_weights (verl-project/verl 1dda039b9c6311889a9c9a26040677e1254814f9, its
# compute_is_metrics) with rollout_is "token" at 2, no batch normalisation, on the batch's pi_old and mu with the empty
# fifth sample: rollout_is_mean, rollout_is_std, rollout_is_eff_sample_size.
VERL_IS_METRICS = (1.0848387251061709, 0.29915796452601595, 0.9293291633808287)


def test_weight_std_and_ess_are_verls_rollout_is_std_and_eff_sample_size():
    """verl logs the applied weights' mean, population std and effective sample size (sum w)^2 / (n sum w^2) (Kong
    1992); rlmm's correction/weight_mean, weight_std and weight_ess, over the kept tokens (verl's over its response
    mask: the same with no rejection). Figures: verl at 1dda039b9c6311889a9c9a26040677e1254814f9 (VERL_IS_METRICS)."""
    from rlmm.corrections.tis import TokenTIS

    old, mu, mask = with_empty_sample()
    out = TokenTIS(cap=2.0)(old, mu, mask)
    mean, std, ess = VERL_IS_METRICS
    assert out.metrics["weight_mean"] == pytest.approx(mean, rel=1e-7)
    assert out.metrics["weight_std"] == pytest.approx(std, rel=1e-6)
    assert out.metrics["weight_ess"] == pytest.approx(ess, rel=1e-7)


# ---------------------------------------------------------------- the mismatch as NeMo-RL and verl log it

# NeMo-RL's ClippedPGLossFn.__call__ (NVIDIA-NeMo/RL 7ea279abfbeb698b092856d0dab61e7cf39bc909,
# nemo_rl/algorithms/loss/loss_functions.py: its lines from "# token_mult_prob_error" to the JS divergence, run as they
# are with its own calculate_kl and masked_mean, reference_policy_kl_type "k3") with prev_logprobs pi_old and
# generation_logprobs mu of the batch; and verl's pearson_correlation_coefficient (verl-project/verl
# 1dda039b9c6311889a9c9a26040677e1254814f9, verl/utils/debug/metrics.py: rollout_actor_probs_pearson_corr) of exp(pi_old)
# and exp(mu).
NEMO_MISMATCH = {"token_mult_prob_error": 1.257602654580969, "kl_k3": 0.08181287038942346,  # NeMo's gen_kl_error
                 "policy_kl_error": 0.04284067033171642, "js_divergence_error": 0.013671353029051082}
VERL_PEARSON = 0.9677884215911451


def test_mismatch_metrics_hold_nemo_rls_errors_and_verls_probability_correlation():
    """NeMo-RL logs gen_kl_error = mean k3(delta) (rlmm's kl_k3), policy_kl_error = mean k3(-delta),
    js_divergence_error = mean (k3(log p_train - log m) + k3(log p_sampler - log m)) / 2 with m the two probabilities'
    mean, and token_mult_prob_error = mean exp|delta|; verl rollout_actor_probs_pearson_corr (rlmm's prob_pearson).
    Figures: NeMo-RL at 7ea279abfbeb698b092856d0dab61e7cf39bc909, verl at 1dda039b9c6311889a9c9a26040677e1254814f9."""
    from rlmm.mismatch.metrics import mismatch_metrics

    old, mu, _, _, mask = batch()
    metrics = mismatch_metrics(old, mu, mask)
    assert {k: metrics[k] for k in NEMO_MISMATCH} == pytest.approx(NEMO_MISMATCH, rel=1e-7)
    assert metrics["prob_pearson"] == pytest.approx(VERL_PEARSON, rel=1e-12)
