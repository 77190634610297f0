"""Tests for rlmm.mismatch.metrics against values worked out by hand."""

import math

import pytest
import torch

from rlmm.mismatch.metrics import METRIC_KEYS, early_vs_late, mismatch_metrics, position_profile

LN2 = math.log(2.0)
NAN = math.nan


def _lp(probs):
    return torch.tensor(probs, dtype=torch.float64).log()


# Two sequences, T = 3: A has 2 response tokens, B has 1 (positions marked "pad" are masked out).
#            A0     A1     pad  |  B0     pad    pad
# p_train    1/2    1/4    -    |  1/8    -      -
# p_sampler  1/4    1/4    -    |  1/2    -      -
# delta      ln2    0      -    |  -2ln2  -      -
# r          2      1      -    |  1/4    -      -
TRAIN = _lp([[0.5, 0.25, 1.0], [0.125, 1.0, 1.0]])
SAMPLER = _lp([[0.25, 0.25, 1.0], [0.5, 1.0, 1.0]])
MASK = torch.tensor([[True, True, False], [True, False, False]])

EXPECTED = {
    "num_tokens": 3,
    "num_sequences": 2,
    # |dp| = [1/4, 0, 3/8] = [6, 0, 9]/24 -> mean 5/24; deviations [1, -5, 4]/24 -> var 42/3/24^2
    "prob_abs_diff_mean": 5 / 24,
    "prob_abs_diff_max": 3 / 8,
    "prob_abs_diff_std": math.sqrt(14) / 24,
    # |delta| = [ln2, 0, 2ln2]
    "logprob_abs_diff_mean": LN2,
    "logprob_abs_diff_max": 2 * LN2,
    # in units of 1/8: x = [4, 2, 1] (mean 7/3), y = [2, 2, 4] (mean 8/3)
    # xc = [5, -1, -4]/3, yc = [-2, -2, 4]/3: sxy = -24/9, sxx = 42/9, syy = 24/9
    # corr = -24 / sqrt(42 * 24) = -sqrt(4/7)
    "prob_pearson": -2 / math.sqrt(7),
    # k1 = -(ln2 + 0 - 2ln2)/3; k2 = (ln2^2 + 4 ln2^2)/2/3
    # k3 = [(2 - 1 - ln2) + 0 + (1/4 - 1 + 2ln2)]/3 = (1/4 + ln2)/3
    "kl_k1": LN2 / 3,
    "kl_k2": 5 * LN2**2 / 6,
    "kl_k3": (0.25 + LN2) / 3,
    # NeMo-RL's: k3(-delta) = [1/2 - 1 + ln2, 0, 4 - 1 - 2ln2] -> (5/2 - ln2)/3
    "policy_kl_error": (2.5 - LN2) / 3,
    # per token (k3(log p_t/m) + k3(log p_s/m))/2 = ln(m / sqrt(p_t p_s)) (the two ratios to m average 1):
    # m = 3/8 -> ln(9/8)/2, equal -> 0, m = 5/16 -> ln(25/16)/2; mean ln(225/128)/6
    "js_divergence_error": math.log(225 / 128) / 6,
    # exp|delta| = [2, 1, 4]
    "token_mult_prob_error": 7 / 3,
    # ppl_train = exp((1 + 2 + 3) ln2 / 3) = 4; ppl_sampler = exp((2 + 2 + 1) ln2 / 3) = 2^(5/3)
    "ppl_train": 4.0,
    "ppl_sampler": 2 ** (5 / 3),
    "ppl_ratio": 2 ** (1 / 3),
    # (r - 1)^2 = [1, 0, 9/16] -> mean 25/48
    "chi2_token": 25 / 48,
    # S = [ln2, -2ln2] -> exp(S) = [2, 1/4] -> ((1)^2 + (3/4)^2)/2 = 25/32
    "chi2_seq": 25 / 32,
    "seq_logratio_mean": -LN2 / 2,
    "seq_logratio_abs_max": 2 * LN2,
    # S / L = [ln2/2, -2ln2] -> mean -3ln2/4
    "seq_geo_logratio_mean": -3 * LN2 / 4,
    "seq_geo_logratio_abs_max": 2 * LN2,
    # r = [24, 12, 3]/12 -> mean 13/12; deviations [11, -1, -10]/12 -> var 222/3/144
    "ratio_mean": 13 / 12,
    "ratio_std": math.sqrt(74) / 12,
    "ratio_min": 0.25,
    "ratio_max": 2.0,
    # (13/4)^2 / (3 * (4 + 1 + 1/16)) = (169/16) / (243/16)
    "ess_token": 169 / 243,
    # (9/4)^2 / (2 * (4 + 1/16)) = (81/16) / (130/16)
    "ess_seq": 81 / 130,
    # C = 2: only r = 1/4 < 1/2 (r = 2 sits on the boundary; see the explicit-cap test)
    "frac_ratio_outside": 1 / 3,
}


def close(got: float, want: float, rel: float = 1e-12) -> bool:
    """Equal up to rel (rel=0: exactly), with NaN equal to NaN."""
    both_nan = math.isnan(got) and math.isnan(want)
    return both_nan or got == pytest.approx(want, rel=rel, abs=1e-15 if rel else 0)


def assert_same(got: dict, want: dict, rel=1e-12):
    assert got.keys() == want.keys()
    for k, w in want.items():
        assert close(got[k], w, rel), f"{k}: got {got[k]}, want {w}"


def test_hand_example():
    got = mismatch_metrics(TRAIN, SAMPLER, MASK)
    assert list(got) == list(METRIC_KEYS)
    assert all(type(v) is (int if k.startswith("num_") else float) for k, v in got.items())
    assert_same(got, EXPECTED)


def test_ratio_cap():
    # r = [2, 1, 1/4]: C = 1.5 -> 2 and 1/4 outside; C = 3 -> 1/4 < 1/3 outside; C = 5 -> none
    for cap, frac in [(1.5, 2 / 3), (3.0, 1 / 3), (5.0, 0.0)]:
        got = mismatch_metrics(TRAIN, SAMPLER, MASK, ratio_cap=cap)["frac_ratio_outside"]
        assert got == pytest.approx(frac)
    with pytest.raises(ValueError):
        mismatch_metrics(TRAIN, SAMPLER, MASK, ratio_cap=0.5)


def test_identical_inputs():
    lp = _lp([[0.9, 0.3, 0.05], [0.6, 0.2, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    got = mismatch_metrics(lp, lp, mask)
    zeros = [k for k in METRIC_KEYS if "diff" in k or k.startswith(("kl_", "chi2", "seq_"))]
    zeros += ["ratio_std", "frac_ratio_outside", "policy_kl_error", "js_divergence_error"]
    assert all(got[k] == 0.0 for k in zeros), {k: got[k] for k in zeros}
    ones = ["prob_pearson", "ppl_ratio", "ratio_mean", "ratio_min", "ratio_max"]
    assert all(got[k] == 1.0 for k in ones + ["ess_token", "ess_seq", "token_mult_prob_error"])
    assert got["ppl_train"] == got["ppl_sampler"]
    assert (got["num_tokens"], got["num_sequences"]) == (5, 2)


def test_padding_garbage_is_ignored():
    clean = mismatch_metrics(TRAIN, SAMPLER, MASK)
    garbage_t, garbage_s = TRAIN.clone(), SAMPLER.clone()
    garbage_t[0, 2], garbage_s[0, 2] = math.inf, math.nan
    garbage_t[1, 1:], garbage_s[1, 1:] = torch.tensor([math.nan, -math.inf]), 1e300
    assert_same(mismatch_metrics(garbage_t, garbage_s, MASK.int()), clean, rel=0)  # 0/1 mask too
    # A fully padded row is not a sequence and changes nothing.
    extra = torch.full((1, 3), math.nan, dtype=torch.float64)
    got = mismatch_metrics(
        torch.cat([garbage_t, extra]),
        torch.cat([garbage_s, extra]),
        torch.cat([MASK, torch.zeros(1, 3, dtype=torch.bool)]),
    )
    assert_same(got, clean, rel=0)


def test_low_precision_inputs_are_not_rounded_further():
    for dtype in (torch.bfloat16, torch.float16):
        t, s = TRAIN.to(dtype), SAMPLER.to(dtype)
        # Same numbers as feeding the (exactly representable) low-precision values as float64.
        assert_same(mismatch_metrics(t, s, MASK), mismatch_metrics(t.double(), s.double(), MASK), 0)
    # A gap of one fp32 ulp at -1 (6e-8) would vanish if the metric worked in bf16.
    t = torch.tensor([[-1.0]], dtype=torch.float32)
    s = torch.nextafter(t, torch.tensor(0.0))
    gap = t.double().item() - s.double().item()
    got = mismatch_metrics(t, s, torch.ones(1, 1))
    assert got["logprob_abs_diff_mean"] == pytest.approx(abs(gap), rel=1e-15)
    assert got["kl_k1"] == pytest.approx(-gap, rel=1e-15)


def test_empty_mask_gives_nan():
    for mask in (torch.zeros(2, 3, dtype=torch.bool), torch.zeros(0, 0, dtype=torch.bool)):
        t = torch.zeros(mask.shape)
        got = mismatch_metrics(t, t, mask)
        assert list(got) == list(METRIC_KEYS)
        assert (got["num_tokens"], got["num_sequences"]) == (0, 0)
        assert all(math.isnan(v) for k, v in got.items() if not k.startswith("num_"))


def test_undefined_correlation_is_nan():
    # a single token has no variance
    one = torch.tensor([[True, False, False], [False, False, False]])
    assert math.isnan(mismatch_metrics(TRAIN, SAMPLER, one)["prob_pearson"])
    # p_sampler constant (1/4) while p_train varies
    t, s = _lp([[0.5, 0.25]]), _lp([[0.25, 0.25]])
    assert math.isnan(mismatch_metrics(t, s, torch.ones(1, 2))["prob_pearson"])


def test_huge_sequence_ratio_overflows_honestly():
    # 400 tokens with delta = 1 each: S = 400, exp(S)^2 overflows float64 -> chi2_seq = inf,
    # while ESS stays finite because it is computed from shifted log-weights.
    t = torch.zeros(2, 400, dtype=torch.float64)
    s = torch.full((2, 400), -1.0, dtype=torch.float64)
    s[1] = 0.0  # second sequence: no mismatch, S = 0
    got = mismatch_metrics(t, s, torch.ones(2, 400))
    assert got["chi2_seq"] == math.inf
    assert got["seq_logratio_abs_max"] == 400.0
    # weights [e^400, 1] -> ESS = (1 + e^-400)^2 / (2 (1 + e^-800)) = 1/2 in float64
    assert got["ess_seq"] == 0.5


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        mismatch_metrics(TRAIN, SAMPLER[:, :2], MASK)


# Position profile example, T = 4, sampler p = 1/2 everywhere:
#   A (len 4): p_train [1/4, 1/2, 1/2, 1]  -> delta [-ln2, 0, 0, ln2], |dp| [1/4, 0, 0, 1/2]
#   B (len 2): p_train [1, 1/2]            -> delta [ln2, 0],          |dp| [1/2, 0]
# k3 per token: delta = -ln2 -> 1/2 - 1 + ln2 = ln2 - 1/2; delta = ln2 -> 2 - 1 - ln2 = 1 - ln2.
P_TRAIN = _lp([[0.25, 0.5, 0.5, 1.0], [1.0, 0.5, 1.0, 1.0]])
P_SAMPLER = _lp([[0.5] * 4, [0.5, 0.5, 1.0, 1.0]])
P_MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)


def assert_profile(got, want):
    assert got.keys() == want.keys()
    for k, w in want.items():
        assert len(got[k]) == len(w), k
        assert all(close(g, x) for g, x in zip(got[k], w)), f"{k}: got {got[k]}, want {w}"


def test_position_profile_two_buckets():
    # L = 4, 2 buckets: [0, 2) holds A0 A1 B0 B1, [2, 4) holds A2 A3.
    # bucket 0: |delta| (ln2 + 0 + ln2 + 0)/4; |dp| (1/4 + 1/2)/4; k3 ((ln2 - 1/2) + (1 - ln2))/4
    # bucket 1: |delta| ln2/2; |dp| (1/2)/2; k3 (1 - ln2)/2
    got = position_profile(P_TRAIN, P_SAMPLER, P_MASK, num_buckets=2)
    assert_profile(
        got,
        {
            "bucket_start": [0, 2],
            "bucket_end": [2, 4],
            "num_tokens": [4, 2],
            "logprob_abs_diff_mean": [LN2 / 2, LN2 / 2],
            "prob_abs_diff_mean": [3 / 16, 1 / 4],
            "kl_k3": [1 / 8, (1 - LN2) / 2],
        },
    )


def test_position_profile_fixed_size_and_garbage():
    t, s = P_TRAIN.clone(), P_SAMPLER.clone()
    t[1, 2:], s[1, 2:] = math.nan, -math.inf  # padding garbage must not matter
    # bucket_size 3: [0, 3) holds A0 A1 A2 B0 B1, [3, 6) holds A3.
    got = position_profile(t, s, P_MASK, bucket_size=3)
    assert_profile(
        got,
        {
            "bucket_start": [0, 3],
            "bucket_end": [3, 6],
            "num_tokens": [5, 1],
            "logprob_abs_diff_mean": [2 * LN2 / 5, LN2],
            "prob_abs_diff_mean": [0.75 / 5, 0.5],
            "kl_k3": [0.5 / 5, 1 - LN2],
        },
    )


def test_position_profile_empty_buckets():
    # L = 4 over 8 buckets: edges ceil(4k/8) = [0, 1, 1, 2, 2, 3, 3, 4, 4]; odd buckets are empty.
    got = position_profile(P_TRAIN, P_SAMPLER, P_MASK)
    assert got["bucket_start"] == [0, 1, 1, 2, 2, 3, 3, 4]
    assert got["bucket_end"] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert got["num_tokens"] == [2, 0, 2, 0, 1, 0, 1, 0]
    # position 0 holds A0 (delta -ln2) and B0 (delta ln2)
    assert got["logprob_abs_diff_mean"][0] == pytest.approx(LN2)
    assert all(math.isnan(got[k][i]) for k in ("kl_k3", "prob_abs_diff_mean") for i in (1, 3, 5, 7))


def test_position_profile_counts_from_first_response_token():
    # Row B's response moved to start at column 1 (e.g. a prompt token before it) profiles the same.
    t = torch.stack([P_TRAIN[0], P_TRAIN[1].roll(1)])
    s = torch.stack([P_SAMPLER[0], P_SAMPLER[1].roll(1)])
    m = torch.stack([P_MASK[0], P_MASK[1].roll(1)])
    assert_profile(
        position_profile(t, s, m, num_buckets=2),
        position_profile(P_TRAIN, P_SAMPLER, P_MASK, num_buckets=2),
    )


def test_position_profile_empty_mask():
    z = torch.zeros(2, 3)
    got = position_profile(z, z, torch.zeros(2, 3, dtype=torch.bool), num_buckets=3)
    assert got["num_tokens"] == [0, 0, 0] and got["bucket_start"] == [0, 0, 0]
    assert all(math.isnan(v) for v in got["kl_k3"])
    assert all(v == [] for v in position_profile(z, z, z.bool(), bucket_size=4).values())


def test_early_vs_late_compares_the_same_long_responses():
    # Rows: A (4 tokens, right-aligned after 1 padding column), B (2 tokens, too short for
    # response_tokens=4), C (5 tokens). Windows of 1: position 0 (early) and position 3 (late).
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    sampler = torch.full((3, 5), -1.0)
    train = sampler.clone()
    train[0, 1], train[0, 4] = -1.0 + 0.1, -1.0 - 0.3   # A: δ 0.1 at position 0, -0.3 at position 3
    train[2, 0], train[2, 3] = -1.0 + 0.2, -1.0 + 0.5   # C: δ 0.2 at position 0, 0.5 at position 3
    train[2, 4] = -1.0 + 9.0                             # C's position 4: past response_tokens, never counted
    train[1, 0], train[1, 1] = 5.0, 5.0                  # B: short, never counted
    got = early_vs_late(train, sampler, mask, response_tokens=4, window=1)
    assert got["num_sequences"] == 2
    assert got["early_logprob_abs_diff_mean"] == pytest.approx((0.1 + 0.2) / 2)
    assert got["late_logprob_abs_diff_mean"] == pytest.approx((0.3 + 0.5) / 2)
    assert got["late_minus_early_logprob_abs_diff"] == pytest.approx(0.25)
    k3 = lambda d: math.expm1(d) - d
    assert got["late_kl_k3"] == pytest.approx((k3(-0.3) + k3(0.5)) / 2)
    wide = early_vs_late(train, sampler, mask, response_tokens=4, window=2)  # [0, 2) and [2, 4)
    assert wide["early_logprob_abs_diff_mean"] == pytest.approx((0.1 + 0.2) / 4)
    none = early_vs_late(train, sampler, mask, response_tokens=5, window=2)  # only C is 5 long
    assert none["num_sequences"] == 1
    assert math.isnan(early_vs_late(train, sampler, mask & False, response_tokens=4, window=1)["early_kl_k3"])
    with pytest.raises(ValueError, match="2 \\* window <= response_tokens"):
        early_vs_late(train, sampler, mask, response_tokens=4, window=3)


def test_entropy_profile_by_hand():
    """Three tokens of the hand example with entropies 0.05, 0.7, 3.0 and a padded one at 0.3: with edges (0.1, 1.0)
    each lands in its own bucket; |delta| = ln2, 0, 2ln2; k3 = 1 - ln2, 0, 1/4 - 1 + 2ln2; one token a bucket, so
    ratio_std 0. With edges (0.5,) the last two share [0.5, inf): r = 1 and 1/4, std 3/8."""
    from rlmm.mismatch.metrics import entropy_profile

    entropy = torch.tensor([[0.05, 0.7, 0.3], [3.0, math.nan, math.nan]], dtype=torch.float64)
    got = entropy_profile(TRAIN, SAMPLER, MASK, entropy, edges=(0.1, 1.0))
    assert got["bucket_start"] == [0.0, 0.1, 1.0] and got["bucket_end"] == [0.1, 1.0, math.inf]
    assert got["num_tokens"] == [1, 1, 1]
    assert got["logprob_abs_diff_mean"] == pytest.approx([LN2, 0.0, 2 * LN2])
    assert got["kl_k3"] == pytest.approx([1 - LN2, 0.0, 0.25 - 1 + 2 * LN2])
    assert got["ratio_std"] == pytest.approx([0.0, 0.0, 0.0], abs=1e-12)
    two = entropy_profile(TRAIN, SAMPLER, MASK, entropy, edges=(0.5,))
    assert two["num_tokens"] == [1, 2]
    assert two["ratio_std"] == pytest.approx([0.0, 3 / 8])
    empty = entropy_profile(TRAIN, SAMPLER, MASK, entropy, edges=(0.01, 0.02, 0.5))
    assert empty["num_tokens"] == [0, 0, 1, 2] and math.isnan(empty["kl_k3"][0])
    assert entropy_profile(TRAIN, SAMPLER, MASK, entropy, edges=(0.7,))["num_tokens"] == [1, 2]  # [0.7, inf) holds 0.7
    with pytest.raises(ValueError, match="edges must be increasing and > 0"):
        entropy_profile(TRAIN, SAMPLER, MASK, entropy, edges=(1.0, 0.5))
