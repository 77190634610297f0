"""Correction methods (the `correction=` group): every YAML builds and honours the output contract; each method
matches values worked out by hand on a small batch."""
from __future__ import annotations

import math

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from rlmm.config.options import CONF_DIR, ConfigError, validate_node
from rlmm.corrections import (METRIC_KEYS, Bypass, Correction, CorrectionOutput, GeometricRejection, KLRejection,
                              NoCorrection, SequenceMask, SequenceTIS, TokenMask, TokenTIS)

# Found by glob: a new method's YAML is tested here without editing this file.
YAMLS = sorted(CONF_DIR.glob("correction/*.yaml"))
NAMES = [p.stem for p in YAMLS]


def build(name: str) -> Correction:
    return instantiate(OmegaConf.load(CONF_DIR / "correction" / f"{name}.yaml"))


def random_batch(seed: int = 0, noise: float = 0.3, dtype=torch.float32):
    """[6, 9] right-padded log-probs with lengths 9, 5, 1, 0, 7, 3 and a sizeable mismatch."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([9, 5, 1, 0, 7, 3])
    mask = torch.arange(9) < lengths[:, None]
    sampler = -torch.rand(6, 9, generator=g, dtype=torch.float64) * 3
    train = sampler + noise * torch.randn(6, 9, generator=g, dtype=torch.float64)
    return train.to(dtype), sampler.to(dtype), mask


def mixed_staleness(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] int64 token staleness as partial rollouts give it, 0 on padding: row i begun i mod 4 updates before
    pi_old and continued by newer weights, one version every two tokens (row 0: 0, 0, ...; row 3: 3, 3, 2, 2, 1, 1,
    0, ...). Every option is given it; only those that read it (`needs_versions`) may depend on it."""
    begun = torch.arange(mask.size(0))[:, None] % 4
    return torch.where(mask, (begun - torch.arange(mask.size(1)) // 2).clamp_min(0), 0)


def with_padding(x: torch.Tensor, mask: torch.Tensor, value: float) -> torch.Tensor:
    return torch.where(mask, x, torch.full_like(x, value))


def same(a: dict[str, float], b: dict[str, float]) -> bool:
    return a.keys() == b.keys() and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


# ---------------------------------------------------------------- every YAML, by glob

def test_there_are_correction_options():
    assert {"none", "bypass", "tis", "seq_tis", "icepop", "mis", "seq_mis", "geo_rs", "kl_rs"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_yaml_validates_and_builds(name):
    node = OmegaConf.load(CONF_DIR / "correction" / f"{name}.yaml")
    validate_node(node, f"correction={name}")
    assert isinstance(instantiate(node), Correction)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", NAMES)
def test_output_contract(name, dtype):
    train, sampler, mask = random_batch(dtype=dtype)
    train = with_padding(train, mask, math.nan).requires_grad_()
    sampler = with_padding(sampler, mask, math.inf)
    out = build(name)(train, sampler, mask, token_staleness=mixed_staleness(mask))

    assert isinstance(out, CorrectionOutput)
    for t in (out.old_logprobs, out.weights, out.mask):
        assert t.shape == mask.shape and not t.requires_grad
    assert out.weights.dtype == torch.float32 and out.mask.dtype == torch.bool
    assert out.old_logprobs.dtype == dtype
    assert not (out.mask & ~mask).any()  # mask is a subset of the response mask
    assert torch.isfinite(out.weights).all() and (out.weights >= 0).all()
    assert (out.weights[~out.mask] == 0).all()
    assert torch.isfinite(out.old_logprobs).all() and (out.old_logprobs[~mask] == 0).all()
    assert set(METRIC_KEYS) <= out.metrics.keys()
    assert all(type(v) is float for v in out.metrics.values())
    # Every row here is short enough for exp(sum delta) to stay finite; the weight_* statistics are NaN only if nothing
    # is kept.
    assert all(math.isfinite(v) or (k.startswith("weight_") and not out.mask.any()) for k, v in out.metrics.items())


@pytest.mark.parametrize("name", NAMES)
def test_padding_garbage_never_leaks(name):
    train, sampler, mask = random_batch(seed=1)
    correction = build(name)
    outs = [correction(with_padding(train, mask, a), with_padding(sampler, mask, b), mask,
                       token_staleness=with_padding(mixed_staleness(mask), mask, s))
            for a, b, s in [(0.0, 0.0, 0), (math.nan, math.nan, 99), (math.inf, -math.inf, -5),
                            (-math.inf, math.inf, 2), (1e30, -7, 1 << 40)]]
    for out in outs[1:]:
        assert torch.equal(out.old_logprobs, outs[0].old_logprobs)
        assert torch.equal(out.weights, outs[0].weights)
        assert torch.equal(out.mask, outs[0].mask)
        assert same(out.metrics, outs[0].metrics)


@pytest.mark.parametrize("name", NAMES)
def test_identical_logprobs_change_nothing(name):
    train, _, mask = random_batch(seed=2)
    train = with_padding(train, mask, math.nan)
    # on-policy: the same weights sampled every token (staleness 0) and the trainer agrees with the sampler
    out = build(name)(train, train.clone(), mask, token_staleness=torch.zeros(mask.shape, dtype=torch.int64))
    assert torch.equal(out.mask, mask)
    assert (out.weights[mask] == 1).all() and (out.weights[~mask] == 0).all()
    assert torch.equal(out.old_logprobs[mask], train[mask])
    m = out.metrics
    assert m["ratio_mean"] == m["ratio_min"] == m["ratio_max"] == m["seq_ratio_max"] == m["weight_mean"] == 1.0
    assert m["frac_tokens_masked"] == m["frac_sequences_masked"] == 0.0


@pytest.mark.parametrize("name", NAMES)
def test_extreme_ratios_keep_weights_finite(name):
    # Row 0: delta = +800 per token, so r and exp(sum delta) overflow float64 to inf; row 1: delta = -800 (r = 0).
    sampler = torch.full((3, 4), -1.0)
    train = sampler + torch.tensor([[800.0] * 4, [-800.0] * 4, [0.1, -0.1, 0.0, 0.0]])
    mask = torch.ones(3, 4, dtype=torch.bool)
    out = build(name)(train, sampler, mask, token_staleness=mixed_staleness(mask))
    assert torch.isfinite(out.weights).all() and (out.weights >= 0).all()
    assert out.metrics["seq_ratio_max"] == math.inf and out.metrics["ratio_max"] == math.inf


@pytest.mark.parametrize("name", NAMES)
def test_empty_mask_gives_nan_metrics(name):
    train, sampler, mask = random_batch()
    out = build(name)(train, sampler, torch.zeros_like(mask), token_staleness=mixed_staleness(mask))
    assert not out.mask.any() and (out.weights == 0).all() and (out.old_logprobs == 0).all()
    assert all(math.isnan(v) for v in out.metrics.values())


# ---------------------------------------------------------------- values worked out by hand
#
# Ratios r = pi_train / pi_sampler per token (PAD = padding), with sequence ratios prod_t r_t and geometric means:
#   row 0: r = 4, 0.25, 1.5       prod = 1.5    geo = 1.5^(1/3) = 1.1447
#   row 1: r = 1.25, 2            prod = 2.5    geo = 2.5^(1/2) = 1.5811
#   row 2: r = 1, 1, 1, 1         prod = 1      geo = 1
#   row 3: empty
# 9 response tokens in 3 non-empty sequences; sum r = 4 + 0.25 + 1.5 + 1.25 + 2 + 4 = 13, so ratio_mean = 13/9.

PAD = math.nan
RATIOS = [[4.0, 0.25, 1.5, PAD], [1.25, 2.0, PAD, PAD], [1.0, 1.0, 1.0, 1.0], [PAD, PAD, PAD, PAD]]


def hand_batch():
    r = torch.tensor(RATIOS, dtype=torch.float64)
    mask = ~r.isnan()
    sampler = torch.tensor([[-0.5, -2.0, -1.0, PAD], [-0.25, -1.5, PAD, PAD], [-3.0, -0.1, -0.2, -0.3], [PAD] * 4],
                           dtype=torch.float64)
    train = torch.where(mask, sampler + r.log(), PAD)  # log pi_train = log pi_sampler + log r
    return train, sampler, mask


def run(correction):
    train, sampler, mask = hand_batch()
    return correction(train, sampler, mask), train, sampler, mask


def weights_of(out) -> list[list[float]]:
    return [[round(w, 6) for w in row] for row in out.weights.tolist()]


def check_ratio_metrics(m):
    assert m["ratio_mean"] == pytest.approx(13 / 9)
    assert m["ratio_min"] == pytest.approx(0.25) and m["ratio_max"] == pytest.approx(4.0)
    assert m["seq_ratio_max"] == pytest.approx(2.5)


def test_none_recomputes_old_logprobs_with_the_trainer():
    out, train, _, mask = run(NoCorrection())
    assert torch.equal(out.old_logprobs[mask], train[mask]) and torch.equal(out.mask, mask)
    assert weights_of(out) == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    check_ratio_metrics(out.metrics)
    assert out.metrics["weight_mean"] == 1.0 and out.metrics["frac_tokens_masked"] == 0.0


def test_bypass_uses_the_sampler_as_old_policy():
    out, _, sampler, mask = run(Bypass())
    assert torch.equal(out.old_logprobs[mask], sampler[mask]) and torch.equal(out.mask, mask)
    assert weights_of(out) == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    check_ratio_metrics(out.metrics)


def test_tis_truncates_token_ratios_at_the_cap():
    out, train, _, mask = run(TokenTIS(cap=2.0))
    # min(r, 2): only r = 4 is cut (r = 2 is not above the cap).
    assert weights_of(out) == [[2, 0.25, 1.5, 0], [1.25, 2, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    assert torch.equal(out.old_logprobs[mask], train[mask]) and torch.equal(out.mask, mask)
    m = out.metrics
    check_ratio_metrics(m)
    assert m["frac_tokens_truncated"] == pytest.approx(1 / 9)
    assert m["weight_mean"] == pytest.approx((2 + 0.25 + 1.5 + 1.25 + 2 + 4) / 9)  # = 11/9


def test_seq_tis_truncates_the_sequence_ratio():
    out, _, _, mask = run(SequenceTIS(cap=2.0))
    # min(prod r, 2): row 0 -> 1.5, row 1 -> min(2.5, 2) = 2, row 2 -> 1; every token of a row gets its weight.
    assert weights_of(out) == [[1.5, 1.5, 1.5, 0], [2, 2, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    assert torch.equal(out.mask, mask)
    m = out.metrics
    check_ratio_metrics(m)
    assert m["frac_sequences_truncated"] == pytest.approx(1 / 3) and m["frac_tokens_truncated"] == pytest.approx(2 / 9)
    assert m["weight_mean"] == pytest.approx((3 * 1.5 + 2 * 2 + 4 * 1) / 9)  # = 12.5/9


def test_icepop_drops_tokens_outside_the_band_and_weights_the_rest_by_r():
    out, train, _, mask = run(TokenMask(low=0.5, high=2.0, reweight=True))
    # [0.5, 2]: r = 4 and r = 0.25 fall outside; r = 2 is on the edge and kept.
    assert out.mask.tolist() == [[False, False, True, False], [True, True, False, False], [True] * 4, [False] * 4]
    assert weights_of(out) == [[0, 0, 1.5, 0], [1.25, 2, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    assert torch.equal(out.old_logprobs[mask], train[mask])
    m = out.metrics
    check_ratio_metrics(m)  # raw ratios, before masking
    assert m["frac_tokens_masked"] == pytest.approx(2 / 9) and m["frac_sequences_masked"] == 0.0
    assert m["weight_mean"] == pytest.approx((1.5 + 1.25 + 2 + 4) / 7)


def test_token_mask_without_reweighting_is_pure_rejection():
    out, _, _, _ = run(TokenMask(low=0.5, high=2.0, reweight=False))
    assert weights_of(out) == [[0, 0, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    assert out.metrics["weight_mean"] == 1.0


def test_mis_yaml_masks_only_large_ratios():
    out, _, _, _ = run(build("mis"))
    # low 0, high 2: only r = 4 is dropped; r = 0.25 stays with its weight.
    assert weights_of(out) == [[0, 0.25, 1.5, 0], [1.25, 2, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    assert out.metrics["frac_tokens_masked"] == pytest.approx(1 / 9)


def test_seq_mis_rejects_sequences_above_the_cap_and_keeps_the_full_weight():
    out, _, _, mask = run(SequenceMask(cap=2.0))
    # prod r = 1.5 (kept, weight 1.5), 2.5 (> 2: rejected), 1 (kept, weight 1).
    assert weights_of(out) == [[1.5, 1.5, 1.5, 0], [0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    assert out.mask.tolist() == [[True] * 3 + [False], [False] * 4, [True] * 4, [False] * 4]
    m = out.metrics
    check_ratio_metrics(m)
    assert m["frac_tokens_masked"] == pytest.approx(2 / 9) and m["frac_sequences_masked"] == pytest.approx(1 / 3)
    assert m["weight_mean"] == pytest.approx((3 * 1.5 + 4 * 1) / 7)


def test_geo_rs_rejects_sequences_by_geometric_mean_ratio():
    out, _, _, _ = run(GeometricRejection(low=0.9, high=1.2))
    # geo = 1.1447 (kept), 1.5811 (> 1.2: rejected), 1 (kept); kept tokens weigh 1.
    assert weights_of(out) == [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    m = out.metrics
    assert m["frac_sequences_masked"] == pytest.approx(1 / 3) and m["weight_mean"] == 1.0
    assert m["geo_ratio_min"] == pytest.approx(1.0) and m["geo_ratio_max"] == pytest.approx(2.5 ** 0.5)
    # With a tighter band row 0 goes too (1.1447 > 1.1), and row 2 (geo = 1) is all that is left.
    out = run(GeometricRejection(low=0.9, high=1.1))[0]
    assert out.mask.any(dim=1).tolist() == [False, False, True, False]


def test_geo_rs_lower_bound():
    # r = 0.5, 0.5: geo = 0.5 < 0.9, rejected; r = 0.8, 1.25: geo = sqrt(1) = 1, kept.
    sampler = torch.full((2, 2), -1.0, dtype=torch.float64)
    train = sampler + torch.tensor([[0.5, 0.5], [0.8, 1.25]], dtype=torch.float64).log()
    out = GeometricRejection(low=0.9, high=1.1)(train, sampler, torch.ones(2, 2, dtype=torch.bool))
    assert out.mask.tolist() == [[False, False], [True, True]]


# Schulman's estimators of KL(pi_sampler || pi_train) per token, delta = log r:
#   k1 = -delta,  k2 = delta^2 / 2,  k3 = r - 1 - delta.
#   row 0: k1 = -1.3863, +1.3863, -0.4055   k2 = 0.9609, 0.9609, 0.0822   k3 = 1.6137, 0.6363, 0.0945
#   row 1: k1 = -0.2231, -0.6931            k2 = 0.0249, 0.2402           k3 = 0.0269, 0.3069
#   row 2: all 0.
def k3(r: float) -> float:
    return r - 1 - math.log(r)


def test_kl_rs_token_level():
    out = run(KLRejection(estimator="k3", level="token", threshold=0.5))[0]
    # k3 > 0.5 for r = 4 (1.6137) and r = 0.25 (0.6363) only.
    assert out.mask.tolist() == [[False, False, True, False], [True, True, False, False], [True] * 4, [False] * 4]
    assert weights_of(out) == [[0, 0, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    m = out.metrics
    assert m["kl_max"] == pytest.approx(k3(4.0))
    assert m["kl_mean"] == pytest.approx(sum(k3(r) for r in (4, 0.25, 1.5, 1.25, 2)) / 9)
    # k2 = delta^2 / 2 is symmetric in delta: 0.9609 for both r = 4 and r = 0.25, the only ones above 0.5.
    out = run(KLRejection(estimator="k2", level="token", threshold=0.5))[0]
    assert out.mask[0].tolist() == [False, False, True, False] and out.mask[1:3].all(dim=1).tolist() == [False, True]
    # |k1| = |log r| > 1 for r = 4 and r = 0.25 (1.3863) only.
    out = run(KLRejection(estimator="k1", level="token", threshold=1.0))[0]
    assert out.mask[0].tolist() == [False, False, True, False]


def test_kl_rs_sequence_level():
    # mean k3: row 0 (1.6137 + 0.6363 + 0.0945) / 3 = 0.7815, row 1 (0.0269 + 0.3069) / 2 = 0.1668, row 2 0.
    out = run(KLRejection(estimator="k3", level="sequence", threshold=0.5))[0]
    assert out.mask.any(dim=1).tolist() == [False, True, True, False]
    assert out.metrics["kl_max"] == pytest.approx((k3(4) + k3(0.25) + k3(1.5)) / 3)
    out = run(KLRejection(estimator="k3", level="sequence", threshold=0.1))[0]
    assert out.mask.any(dim=1).tolist() == [False, False, True, False]
    assert out.metrics["frac_tokens_masked"] == pytest.approx(5 / 9)
    # k1 is signed: row 0's tokens cancel to |mean k1| = log(1.5) / 3 = 0.1352 (kept), while row 1 has
    # |mean k1| = log(2.5) / 2 = 0.4581 (rejected at 0.2).
    out = run(KLRejection(estimator="k1", level="sequence", threshold=0.2))[0]
    assert out.mask.any(dim=1).tolist() == [True, False, True, False]
    assert out.metrics["kl_max"] == pytest.approx(math.log(2.5) / 2)


# ---------------------------------------------------------------- bad arguments

@pytest.mark.parametrize("make,message", [
    (lambda: TokenTIS(cap=0.5), "correction.cap: must be a finite number >= 1, got 0.5"),
    (lambda: TokenTIS(cap=math.inf), "correction.cap: must be a finite number >= 1, got inf"),
    (lambda: SequenceTIS(cap=math.nan), "correction.cap: must be a finite number >= 1, got nan"),
    (lambda: SequenceMask(cap=0.9), "correction.cap: must be a finite number >= 1, got 0.9"),
    (lambda: TokenMask(low=1.5, high=2.0, reweight=True), "correction.low: must be in [0, 1], got 1.5"),
    (lambda: TokenMask(low=0.5, high=0.8, reweight=True), "correction.high: must be a finite number >= 1, got 0.8"),
    (lambda: GeometricRejection(low=0.0, high=1.001), "correction.low: must be in (0, 1], got 0.0"),
    (lambda: KLRejection(estimator="k4", level="token", threshold=0.1),
     "correction.estimator: must be one of k1, k2, k3, got 'k4'"),
    (lambda: KLRejection(estimator="k3", level="batch", threshold=0.1),
     "correction.level: must be one of token, sequence, got 'batch'"),
    (lambda: KLRejection(estimator="k3", level="token", threshold=-1.0), "correction.threshold: must be >= 0, got -1.0"),
])
def test_bad_arguments_raise_one_line_errors(make, message):
    with pytest.raises(ValueError) as err:
        make()
    assert str(err.value) == message and "\n" not in message


def test_unknown_and_mistyped_yaml_keys_are_rejected():
    node = OmegaConf.load(CONF_DIR / "correction" / "tis.yaml")
    with pytest.raises(ConfigError, match=r"correction=tis: unknown key 'clip' \(allowed: cap\)"):
        validate_node(OmegaConf.merge(node, {"clip": 2.0}), "correction=tis")
    with pytest.raises(ConfigError, match="correction=tis: cap: Value 'big'"):
        validate_node(OmegaConf.merge(node, {"cap": "big"}), "correction=tis")


def test_mismatched_shapes_are_rejected():
    with pytest.raises(ValueError, match=r"correction: expected .* equal shape \[B, T\]"):
        NoCorrection()(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool))
