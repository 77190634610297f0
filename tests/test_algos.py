"""Tests for rlmm.algos against values and gradients worked out by hand."""
import math

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from rlmm.algos import GRPO, per_token_entropy
from rlmm.algos.surrogate import METRIC_KEYS, ClippedSurrogate
from rlmm.config.options import CONF_DIR, ConfigError, validate_node
from rlmm.run.interfaces import Algorithm

LN2 = math.log(2.0)
INF, NAN = math.inf, math.nan
ALGO_YAMLS = sorted((CONF_DIR / "algo").glob("*.yaml"))


def assert_close(actual, expected, rtol=1.3e-6, atol=1e-5):
    # torch.testing.assert_close would do, but its first call costs ~1.3 s of imports.
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    assert actual.shape == expected.shape and torch.allclose(actual, expected, rtol=rtol, atol=atol), (actual, expected)


def make(clip_low=0.2, clip_high=0.5, dual_clip=None, **overrides) -> GRPO:
    args = dict(group_size=4, normalize_std=True, objective=ClippedSurrogate(clip_low, clip_high, dual_clip),
                loss_aggregation="token", kl_coef=0.0, kl_estimator="k3", entropy_coef=0.0, count_rejected=False,
                epochs=1, minibatches=1)
    return GRPO(**(args | overrides))


# ---------------------------------------------------------------------------------------------
# Config files
# ---------------------------------------------------------------------------------------------

def test_there_are_algo_configs():
    assert {"grpo", "dr_grpo"} <= {p.stem for p in ALGO_YAMLS}


@pytest.mark.parametrize("path", ALGO_YAMLS, ids=[p.stem for p in ALGO_YAMLS])
def test_every_algo_yaml_validates_and_builds(path):
    node = OmegaConf.load(path)
    validate_node(node, f"algo={path.stem}")
    assert isinstance(instantiate(node), Algorithm)


def test_dr_grpo_yaml_is_dr_grpo():
    algo = instantiate(OmegaConf.load(CONF_DIR / "algo" / "dr_grpo.yaml"))
    objective = algo.loss.objective
    assert (algo.normalize_std, algo.loss.loss_aggregation, objective.clip_low, objective.clip_high) == (
        False, "constant", 0.2, 0.2)


def test_unknown_algo_key_is_rejected():
    node = OmegaConf.load(CONF_DIR / "algo" / "grpo.yaml")
    node.clip_ratio = 0.2
    with pytest.raises(ConfigError, match=r"algo=grpo: unknown key 'clip_ratio' \(allowed: group_size, "):
        validate_node(node, "algo=grpo")


# ---------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------

# Two groups of 4: group 0 = [0, 0, 0, 1], group 1 = [2, 4, 6, 8].
REWARDS = torch.tensor([0.0, 0.0, 0.0, 1.0, 2.0, 4.0, 6.0, 8.0])


def test_advantages_without_std_are_centred_rewards():
    # means 1/4 and 5: [-1/4, -1/4, -1/4, 3/4] and [-3, -1, 1, 3]
    adv = make(normalize_std=False).advantages(REWARDS)
    assert adv.dtype == torch.float32 and adv.shape == (8,)
    assert_close(adv, torch.tensor([-0.25, -0.25, -0.25, 0.75, -3.0, -1.0, 1.0, 3.0]))


def test_advantages_with_std_use_the_bessel_corrected_group_std():
    # group 0: squared deviations 3 * 1/16 + 9/16 = 3/4, / (4 - 1) = 1/4 -> std 1/2
    # group 1: 9 + 1 + 1 + 9 = 20, / 3 -> std sqrt(20/3)
    s0, s1 = 0.5 + 1e-6, math.sqrt(20 / 3) + 1e-6
    expected = torch.tensor([-0.25 / s0] * 3 + [0.75 / s0] + [-3 / s1, -1 / s1, 1 / s1, 3 / s1])
    assert_close(make().advantages(REWARDS), expected)


@pytest.mark.parametrize("normalize_std", [True, False])
def test_a_group_of_equal_rewards_has_exactly_zero_advantage(normalize_std):
    # 0.1 is not exact in binary; the float64 mean of three float32 0.1s still is, so 0/(0 + eps) = 0.
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 1.0], dtype=torch.float32)
    adv = make(group_size=3, normalize_std=normalize_std).advantages(rewards)
    assert torch.isfinite(adv).all()
    assert torch.equal(adv[:3], torch.zeros(3))
    assert adv[3:].abs().min() > 0


def test_advantages_reject_ungrouped_rewards():
    with pytest.raises(ValueError, match=r"advantages: expected rewards of shape \[num_prompts \* 4\], got \(6,\)"):
        make().advantages(torch.zeros(6))


# ---------------------------------------------------------------------------------------------
# Policy loss: one hand-worked batch, clip range [0.8, 1.5]
# ---------------------------------------------------------------------------------------------
#
# B = 2, T = 4; sequence 0 has A = +1 and 2 tokens, sequence 1 has A = -2 and 3 tokens.
#
#   token   ratio  A   w    clip?                       min(rA, clip(r)A)        pg = -w * min   d pg / d logprob
#   s0 t0   2      +1  2    r > 1.5, A > 0: clipped     min(2, 1.5) = 1.5        -3              0
#   s0 t1   1      +1  0.5  no                          1                        -0.5            -w A r = -0.5
#   s1 t0   1/2    -2  1    r < 0.8, A < 0: clipped     min(-1, -1.6) = -1.6     1.6             0
#   s1 t1   2      -2  0.5  r > 1.5 but A < 0: not      min(-4, -3) = -4         2               -w A r = 2
#   s1 t2   5/4    -2  2    inside [0.8, 1.5]           -2.5                     5               -w A r = 5
#
# sum pg = -3 - 0.5 + 1.6 + 2 + 5 = 5.1. Padding holds inf / NaN in every input.
OLD_P = [[0.25, 0.5, 1.0, 1.0], [0.5, 0.25, 0.4, 1.0]]
NEW_P = [[0.5, 0.5, 1.0, 1.0], [0.25, 0.5, 0.5, 1.0]]
MASK = torch.tensor([[True, True, False, False], [True, True, True, False]])
ADV = torch.tensor([1.0, -2.0])
WEIGHTS = torch.tensor([[2.0, 0.5, NAN, INF], [1.0, 0.5, 2.0, NAN]])
RATIO = torch.tensor([[2.0, 1.0, 0.0, 0.0], [0.5, 2.0, 1.25, 0.0]], dtype=torch.float64)
# -w * A * ratio on unclipped kept tokens, 0 elsewhere: the gradient of sum(pg) w.r.t. logprobs
GRAD_SUM = torch.tensor([[0.0, -0.5, 0.0, 0.0], [0.0, 2.0, 5.0, 0.0]], dtype=torch.float64)


def _batch(dtype=torch.float64):
    garbage = torch.tensor([[0.0, 0.0, NAN, INF], [0.0, 0.0, 0.0, -INF]], dtype=dtype)
    new = torch.where(MASK, torch.tensor(NEW_P, dtype=dtype).log(), garbage).requires_grad_()
    old = torch.where(MASK, torch.tensor(OLD_P, dtype=dtype).log(), garbage.flip(0))
    return new, old


@pytest.mark.parametrize("mode,expected_loss,grad_scale", [
    # token: 5.1 / 5 kept tokens; every token's gradient / 5
    ("token", 5.1 / 5, [[1 / 5] * 4, [1 / 5] * 4]),
    # sequence: (-3.5 / 2 + 8.6 / 3) / 2 = 0.558333; s0 tokens / (2 * 2), s1 tokens / (2 * 3)
    ("sequence", (-3.5 / 2 + 8.6 / 3) / 2, [[1 / 4] * 4, [1 / 6] * 4]),
    # constant: 5.1 / (B * T) = 5.1 / 8
    ("constant", 5.1 / 8, [[1 / 8] * 4, [1 / 8] * 4]),
])
def test_policy_loss_value_and_gradient_by_hand(mode, expected_loss, grad_scale):
    new, old = _batch()
    loss, metrics = make(loss_aggregation=mode).policy_loss(new, old, ADV, MASK, WEIGHTS)
    assert loss.dtype == torch.float64 and loss.dim() == 0
    assert loss.item() == pytest.approx(expected_loss, rel=1e-12)
    (grad,) = torch.autograd.grad(loss, new)
    # unclipped: -w * A * ratio / N; clipped and padding: exactly 0 (no NaN from the garbage)
    assert_close(grad, GRAD_SUM * torch.tensor(grad_scale, dtype=torch.float64), rtol=1e-12, atol=0)
    assert metrics["pg_loss"] == metrics["loss"] == pytest.approx(expected_loss, rel=1e-12)


def test_policy_loss_metrics_by_hand():
    new, old = _batch()
    _, metrics = make().policy_loss(new, old, ADV, MASK, WEIGHTS)
    assert set(metrics) == set(METRIC_KEYS)
    assert metrics["num_tokens"] == 5 and isinstance(metrics["num_tokens"], int)
    # clipped: s0 t0 (high side, A > 0) and s1 t0 (low side, A < 0); s1 t1 is outside but not clipped
    assert metrics["clipfrac"] == pytest.approx(2 / 5)
    assert metrics["clipfrac_high"] == pytest.approx(1 / 5)
    assert metrics["clipfrac_low"] == pytest.approx(1 / 5)
    # ratios 2, 1, 1/2, 2, 5/4
    assert metrics["ratio_mean"] == pytest.approx(6.75 / 5)
    assert metrics["ratio_min"] == pytest.approx(0.5)
    assert metrics["ratio_max"] == pytest.approx(2.0)
    # r - 1 - log r: (1 - ln2) + 0 + (-1/2 + ln2) + (1 - ln2) + (1/4 - ln(5/4)) = 1.75 - ln 2.5
    assert metrics["approx_kl"] == pytest.approx((1.75 - math.log(2.5)) / 5)
    assert all(math.isfinite(v) for v in metrics.values())


def test_constant_aggregation_divides_by_max_length():
    # Dr.GRPO: 5.1 / (B * max_new_tokens) = 5.1 / (2 * 10), whatever the padded width
    new, old = _batch()
    algo = make(loss_aggregation="constant")
    loss, _ = algo.policy_loss(new, old, ADV, MASK, WEIGHTS, max_length=10)
    assert loss.item() == pytest.approx(5.1 / 20)
    assert algo.loss_normalizer(MASK, max_length=10) == 20.0
    with pytest.raises(ValueError, match="policy_loss: max_length 3 is less than the padded width 4"):
        algo.policy_loss(new, old, ADV, MASK, WEIGHTS, max_length=3)


@pytest.mark.parametrize("mode", ["token", "sequence", "constant"])
def test_micro_batches_with_the_minibatch_normalizer_sum_to_the_whole_loss(mode):
    new, old = _batch()
    algo = make(loss_aggregation=mode)
    whole, _ = algo.policy_loss(new, old, ADV, MASK, WEIGHTS, max_length=10)
    norm = algo.loss_normalizer(MASK, max_length=10)  # 5 tokens / 2 sequences / 2 * 10
    assert norm == {"token": 5.0, "sequence": 2.0, "constant": 20.0}[mode]
    parts = [algo.policy_loss(new[i:i + 1], old[i:i + 1], ADV[i:i + 1], MASK[i:i + 1], WEIGHTS[i:i + 1],
                              max_length=10, normalizer=norm)[0] for i in range(2)]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), rel=1e-12)


def test_on_policy_without_correction_loss_is_minus_the_mean_advantage():
    # weights 1, old == new: ratio 1 everywhere, nothing clipped, and pg_t = -A_i.
    torch.manual_seed(0)
    new = torch.randn(3, 5, dtype=torch.float64).requires_grad_()
    adv = torch.tensor([0.5, -1.0, 2.0])
    full = torch.ones(3, 5, dtype=torch.bool)
    loss, m = make().policy_loss(new, new.detach(), adv, full, torch.ones(3, 5))
    assert loss.item() == pytest.approx(-adv.mean().item())  # equal lengths: -(0.5 - 1 + 2) / 3
    assert (m["ratio_mean"], m["ratio_min"], m["ratio_max"], m["clipfrac"], m["approx_kl"]) == (1, 1, 1, 0, 0)
    # unequal lengths 5, 2, 1: token mode weighs by length, sequence mode does not
    ragged = torch.arange(5) < torch.tensor([[5], [2], [1]])
    loss, _ = make().policy_loss(new, new.detach(), adv, ragged, torch.ones(3, 5))
    assert loss.item() == pytest.approx(-(0.5 * 5 - 1.0 * 2 + 2.0 * 1) / 8)
    loss, _ = make(loss_aggregation="sequence").policy_loss(new, new.detach(), adv, ragged, torch.ones(3, 5))
    assert loss.item() == pytest.approx(-adv.mean().item())


def test_low_precision_inputs_give_a_float32_loss_and_no_leak():
    new, old = _batch(torch.bfloat16)
    loss, metrics = make().policy_loss(new, old, ADV, MASK, WEIGHTS)
    assert loss.dtype == torch.float32
    (grad,) = torch.autograd.grad(loss, new)
    assert grad.dtype == torch.bfloat16 and torch.isfinite(grad).all() and (grad[~MASK] == 0).all()
    assert loss.item() == pytest.approx(5.1 / 5, rel=1e-2)  # bf16 probabilities are rounded


def test_empty_mask_gives_zero_loss_and_nan_metrics():
    new, old = _batch()
    empty = torch.zeros_like(MASK)
    for mode in ("token", "sequence", "constant"):
        loss, metrics = make(loss_aggregation=mode).policy_loss(new, old, ADV, empty, WEIGHTS)
        assert loss.item() == 0.0
        (grad,) = torch.autograd.grad(loss, new)
        assert (grad == 0).all()
        assert metrics["num_tokens"] == 0 and math.isnan(metrics["ratio_max"]) and math.isnan(metrics["clipfrac"])


@pytest.mark.parametrize("mode", ["token", "sequence", "constant"])
def test_gradcheck_float64(mode):
    # Random log-ratios in +-[0, 0.1] (inside the clip range [0.8, 1.28]) or +-[0.5, 0.7] (clipped or
    # not depending on the sign of A), so no token sits near a clip boundary; KL and entropy on.
    g = torch.Generator().manual_seed(1)
    B, T = 3, 5
    size = torch.rand(B, T, generator=g, dtype=torch.float64)
    sign = torch.randint(0, 2, (B, T), generator=g) * 2 - 1
    logratio = torch.where(size < 0.5, 0.2 * size, 0.5 + 0.4 * (size - 0.5)) * sign
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.1
    new = (old + logratio).requires_grad_()
    ref = old - 0.3 * torch.rand(B, T, generator=g, dtype=torch.float64)
    entropy = torch.rand(B, T, generator=g, dtype=torch.float64).requires_grad_()
    adv = torch.tensor([1.0, -0.7, 0.3], dtype=torch.float64)
    weights = torch.rand(B, T, generator=g, dtype=torch.float64) + 0.5
    mask = torch.arange(T) < torch.tensor([[5], [3], [1]])
    algo = make(clip_high=0.28, loss_aggregation=mode, kl_coef=0.1, entropy_coef=0.01)
    assert 0 < algo.policy_loss(new, old, adv, mask, weights, ref, entropy)[1]["clipfrac"] < 0.5  # both kinds
    assert torch.autograd.gradcheck(
        lambda lp, h: algo.policy_loss(lp, old, adv, mask, weights, ref, h)[0], (new, entropy))


# ---------------------------------------------------------------------------------------------
# KL penalty and entropy bonus
# ---------------------------------------------------------------------------------------------
#
# Two tokens, A = 0 so only the penalty remains; d = log(pi_ref / pi_theta):
#   token 0: pi_theta 1/2, pi_ref 1/4 -> d = -ln2: k1 = ln2,  k2 = ln2^2/2, k3 = 1/2 - 1 + ln2
#   token 1: pi_theta 1/4, pi_ref 1/2 -> d = +ln2: k1 = -ln2, k2 = ln2^2/2, k3 = 2 - 1 - ln2
# Token means: k1 = 0, k2 = ln2^2/2, k3 = 1/4.
# Gradients w.r.t. log pi_theta, per token: k1: 1; k2: -d; k3: 1 - pi_ref/pi_theta = [1/2, -1].
@pytest.mark.parametrize("estimator,kl,grad", [
    ("k1", 0.0, [1.0, 1.0]),
    ("k2", LN2**2 / 2, [LN2, -LN2]),
    ("k3", 0.25, [0.5, -1.0]),
])
def test_kl_penalty_by_hand(estimator, kl, grad):
    new = torch.tensor([[0.5, 0.25]], dtype=torch.float64).log().requires_grad_()
    ref = torch.tensor([[0.25, 0.5]], dtype=torch.float64).log()
    mask = torch.ones(1, 2, dtype=torch.bool)
    algo = make(kl_coef=0.1, kl_estimator=estimator)
    loss, metrics = algo.policy_loss(new, new.detach(), torch.zeros(1), mask, torch.ones(1, 2), ref_logprobs=ref)
    assert metrics["kl"] == pytest.approx(kl, abs=1e-12)
    assert loss.item() == pytest.approx(0.1 * kl, abs=1e-12)  # pg term is 0 (A = 0)
    (g,) = torch.autograd.grad(loss, new)
    assert_close(g, 0.1 * torch.tensor([grad], dtype=torch.float64) / 2)  # coef * dk / N


def test_kl_metric_without_penalty_and_penalty_without_ref():
    new = torch.tensor([[0.5, 0.25]], dtype=torch.float64).log()
    ref = torch.tensor([[0.25, 0.5]], dtype=torch.float64).log()
    args = (new, new, torch.zeros(1), torch.ones(1, 2, dtype=torch.bool), torch.ones(1, 2))
    loss, metrics = make().policy_loss(*args, ref_logprobs=ref)  # kl_coef 0: logged, not added
    assert loss.item() == 0.0 and metrics["kl"] == pytest.approx(0.25)
    assert "kl" not in make().policy_loss(*args)[1]
    with pytest.raises(ValueError, match="policy_loss: algo.kl_coef is 0.1 but no ref_logprobs were given"):
        make(kl_coef=0.1).policy_loss(*args)


def test_entropy_bonus_lowers_the_loss_and_pushes_entropy_up():
    # A = 0; entropy [1, 3] (padding NaN): loss = -0.01 * mean(1, 3) = -0.02, d loss / d H = -0.01 / 2
    new = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    entropy = torch.tensor([[1.0, 3.0, NAN]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    loss, metrics = make(entropy_coef=0.01).policy_loss(new, new.detach(), torch.zeros(1), mask,
                                                        torch.ones(1, 3), entropy=entropy)
    assert loss.item() == pytest.approx(-0.02)
    assert metrics["entropy"] == pytest.approx(2.0)
    (g,) = torch.autograd.grad(loss, entropy)
    assert_close(g, torch.tensor([[-0.005, -0.005, 0.0]], dtype=torch.float64))
    with pytest.raises(ValueError, match="policy_loss: algo.entropy_coef is 0.01 but no entropy was given"):
        make(entropy_coef=0.01).policy_loss(new, new.detach(), torch.zeros(1), mask, torch.ones(1, 3))


# ---------------------------------------------------------------------------------------------
# per_token_entropy
# ---------------------------------------------------------------------------------------------

def test_per_token_entropy_by_hand():
    logits = torch.tensor([
        [0.0, 0.0, 0.0, 0.0],                 # uniform over 4: ln 4
        [math.log(3.0), 0.0, -INF, -INF],     # p = [3/4, 1/4, 0, 0]: -(3/4 ln 3/4 + 1/4 ln 1/4)
        [5.0, -INF, -INF, -INF],              # one token left: 0
    ]).requires_grad_()
    h = per_token_entropy(logits)
    expected = [math.log(4), -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)), 0.0]
    assert h.dtype == torch.float32 and h.shape == (3,)
    assert_close(h, torch.tensor(expected), rtol=1e-6, atol=1e-6)
    (g,) = torch.autograd.grad(h.sum(), logits)
    assert torch.isfinite(g).all() and (g[1:, 2:] == 0).all() and (g[0] == 0).all()  # uniform is a maximum


def test_per_token_entropy_upcasts_low_precision():
    logits = torch.randn(2, 3, 50).to(torch.bfloat16)
    h = per_token_entropy(logits)
    assert h.dtype == torch.float32 and h.shape == (2, 3)
    p = torch.softmax(logits.double(), dim=-1)
    assert_close(h.double(), -(p * p.log()).sum(-1), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Bad arguments: one-line ValueErrors naming the value and what is allowed
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,message", [
    ({"loss_aggregation": "tokens"}, "algo.loss_aggregation: unknown mode 'tokens' (allowed: token, sequence, constant)"),
    ({"kl_estimator": "k4"}, "algo.kl_estimator: unknown estimator 'k4' (allowed: k1, k2, k3)"),
    ({"group_size": 1}, "algo.group_size: must be >= 2, got 1 (a group of one has advantage 0)"),
    ({"clip_low": 1.5}, "algo.objective.clip_low: must be in (0, 1] (1: no lower bound), got 1.5"),
    ({"objective": "cispo"}, "algo.objective: 'cispo' is not a loss objective: it is a node naming its class (CISPO: "
                             "algo=cispo; the clip range: algo.objective.clip_low=..., algo.objective.clip_high=...)"),
    ({"dual_clip": 1.0}, "algo.objective.dual_clip: must be > 1 or null (off), got 1.0"),
    ({"clip_high": 0.0}, "algo.objective.clip_high: must be > 0, got 0.0"),
    ({"kl_coef": -0.1}, "algo.kl_coef: must be >= 0, got -0.1"),
    ({"entropy_coef": NAN}, "algo.entropy_coef: must be >= 0, got nan"),
    ({"epochs": 0}, "algo.epochs: must be >= 1, got 0"),
    ({"minibatches": 0}, "algo.minibatches: must be >= 1, got 0"),
])
def test_bad_constructor_args(overrides, message):
    with pytest.raises(ValueError) as err:
        make(**overrides)
    assert str(err.value) == message


def test_bad_policy_loss_shapes():
    new, old = _batch()
    algo = make()
    with pytest.raises(ValueError, match=r"policy_loss: weights has shape \(2, 3\), expected \(2, 4\) as logprobs"):
        algo.policy_loss(new, old, ADV, MASK, WEIGHTS[:, :3])
    with pytest.raises(ValueError, match=r"policy_loss: advantages has shape \(2, 1\), expected \(2,\)"):
        algo.policy_loss(new, old, ADV[:, None], MASK, WEIGHTS)
    with pytest.raises(ValueError, match=r"policy_loss: expected logprobs of shape \[B, T\], got \(8,\)"):
        algo.policy_loss(new.reshape(-1), old, ADV, MASK, WEIGHTS)
    with pytest.raises(ValueError, match="policy_loss: normalizer must be > 0, got 0"):
        algo.policy_loss(new, old, ADV, MASK, WEIGHTS, normalizer=0)


# ---------------------------------------------------------------------------------------------
# GSPO: the same hand-worked batch, clip on the sequence's geometric-mean ratio
# ---------------------------------------------------------------------------------------------
#
#   s0: ratios 2, 1      -> s0 = (2 * 1)^(1/2) = sqrt(2) = 1.41421, A = +1, in [0.8, 1.5]: not clipped
#   s1: ratios 1/2, 2, 5/4 -> s1 = (5/4)^(1/3) = 1.07722, A = -2, in [0.8, 1.5]: not clipped
#   pg_t = -w_t * s_i * A_i; sequence mean then mean over the 2 sequences:
#   loss = (-(2 + 0.5) * s0 / 2 + 2 * (1 + 0.5 + 2) * s1 / 3) / 2
#   d loss / d logprob_t = -w_t * A_i * s_i / (|y_i| * 2)   (GSPO-token: each token gets s_i * grad log pi)
S0, S1 = math.sqrt(2.0), 1.25 ** (1 / 3)
GSPO_LOSS = (-(2 + 0.5) * S0 / 2 + 2 * (1 + 0.5 + 2) * S1 / 3) / 2
GSPO_GRAD = torch.tensor([[-2 * S0 / 4, -0.5 * S0 / 4, 0, 0],
                          [2 * 1 * S1 / 6, 2 * 0.5 * S1 / 6, 2 * 2 * S1 / 6, 0]], dtype=torch.float64)


def make_gspo(clip_high=0.5, **overrides):
    from rlmm.algos import GSPO

    args = dict(group_size=4, normalize_std=True, objective=ClippedSurrogate(0.2, clip_high, None),
                loss_aggregation="sequence", kl_coef=0.0, kl_estimator="k3", entropy_coef=0.0, count_rejected=False,
                epochs=1, minibatches=1)
    return GSPO(**(args | overrides))


def test_gspo_loss_and_gradient_by_hand():
    new, old = _batch()
    loss, metrics = make_gspo().policy_loss(new, old, ADV, MASK, WEIGHTS)
    assert loss.item() == pytest.approx(GSPO_LOSS, rel=1e-12)
    (grad,) = torch.autograd.grad(loss, new)
    assert_close(grad, GSPO_GRAD, rtol=1e-12, atol=0)
    assert metrics["ratio_max"] == pytest.approx(S0, rel=1e-12) and metrics["clipfrac"] == 0


def test_gspo_token_form_has_the_sequence_objectives_gradient():
    """With unit weights the per-token form's gradient is that of GSPO's sequence objective
    J = mean_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t log-ratio), written here directly."""
    new, old = _batch()
    ones = torch.ones_like(WEIGHTS)
    loss, _ = make_gspo().policy_loss(new, old, ADV, MASK, ones)
    (grad,) = torch.autograd.grad(loss, new)
    logratio = torch.where(MASK, new - old, 0.0)
    s = (logratio.sum(1) / MASK.sum(1)).exp()
    objective = torch.minimum(s * ADV, s.clamp(0.8, 1.5) * ADV).mean()
    (expected,) = torch.autograd.grad(-objective, new)
    assert_close(grad, expected, rtol=1e-12, atol=1e-15)


def test_gspo_clips_whole_sequences_where_grpo_clips_tokens():
    """clip_high 0.1: s0 = 1.414 > 1.1 with A > 0, so every token of sequence 0 loses its gradient under
    GSPO, while GRPO keeps the gradient of s0's token whose own ratio (1) is inside the range."""
    new, old = _batch()
    (gspo,) = torch.autograd.grad(make_gspo(clip_high=0.1).policy_loss(new, old, ADV, MASK, WEIGHTS)[0], new)
    (grpo,) = torch.autograd.grad(make(clip_high=0.1, loss_aggregation="sequence").policy_loss(
        new, old, ADV, MASK, WEIGHTS)[0], new)
    assert torch.equal(gspo[0], torch.zeros(4, dtype=torch.float64)) and (gspo[1, :3] != 0).all()
    assert grpo[0, 1] != 0


def test_token_level_advantages_broadcast_like_sequence_ones():
    """[B, T] advantages equal to each sequence's A give the [B] advantages' loss and gradient."""
    new, old = _batch()
    per_token = ADV[:, None].expand(2, 4).clone()
    per_token[~MASK] = NAN  # padding of token advantages never leaks
    loss, _ = make().policy_loss(new, old, per_token, MASK, WEIGHTS)
    (grad,) = torch.autograd.grad(loss, new)
    assert loss.item() == pytest.approx(5.1 / 5, rel=1e-12)
    assert_close(grad, GRAD_SUM / 5, rtol=1e-12, atol=0)


# ---------------------------------------------------------------------------------------------
# DAPO: dynamic sampling's group filter and the overlong punishment
# ---------------------------------------------------------------------------------------------

def make_dapo(**overrides):
    from rlmm.config.options import from_yaml

    return from_yaml("algo", "dapo", **({"group_size": 4} | overrides))


def test_dapo_keeps_groups_whose_rewards_differ():
    rewards = torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, NAN, 1, 1, 1])
    assert make_dapo().keep_groups(rewards).tolist() == [False, True, False, True]  # a NaN group is kept
    assert make().keep_groups(rewards).tolist() == [True] * 4  # GRPO keeps every group


def test_dapo_overlong_punishment_by_hand():
    """L_max 10, L_cache 0.2 * 10 = 2: lengths up to 8 are free, 9 costs 1/2, 10 costs 1 (times the penalty)."""
    rewards, lengths = torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.tensor([8, 9, 10, 3])
    assert make_dapo().shape_rewards(rewards, lengths, max_length=10).tolist() == [1.0, 0.5, 0.0, 0.0]
    assert make_dapo(overlong_penalty=0.5).shape_rewards(rewards, lengths, 10).tolist() == [1.0, 0.75, 0.5, 0.0]
    assert torch.equal(make_dapo(overlong_buffer=0.0).shape_rewards(rewards, lengths, 10), rewards)
    assert torch.equal(make().shape_rewards(rewards, lengths, 10), rewards)


@pytest.mark.parametrize("overrides,message", [
    ({"overlong_buffer": 1.0}, "overlong_buffer: a fraction"), ({"max_sampling_rounds": -1}, "max_sampling_rounds"),
    ({"overlong_penalty": -1.0}, "overlong_penalty")])
def test_dapo_bad_arguments(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_dapo(**overrides)
