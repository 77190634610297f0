"""The typed loss statistics (rlmm/mismatch/loss_stats.py): each field combines over micro-batches as it declares,
and every algorithm's metrics are the names of its record."""
from __future__ import annotations

import math

import pytest
import torch

from rlmm.algos.surrogate import ClippedSurrogate
from rlmm.config.options import CONF_DIR, from_yaml
from rlmm.mismatch.loss_stats import Combine, PolicyLossStats, ValueLossStats, combine_ranks, combined_metrics, reductions

NAN = math.nan


def policy_part(**values) -> dict[str, float]:
    return {"loss": 0.0, "pg_loss": 0.0, "approx_kl": 0.0, "ppo_kl": 0.0, "clipfrac": 0.0, "clipfrac_low": 0.0,
            "clipfrac_high": 0.0, "ratio_mean": 1.0, "ratio_min": 1.0, "ratio_max": 1.0, "num_tokens": 0} | values


def test_policy_stats_combine_over_micro_batches_as_declared():
    """Three micro-batches, the last with no kept token (its means NaN, as `policy_loss` gives them): sums add
    up (a NaN-free loss of 0 included), token means are weighted by num_tokens and skip the empty one, min
    and max skip NaN, and `kl`, absent from every part, stays absent. The expected values are worked by hand."""
    parts = [policy_part(loss=0.5, pg_loss=0.4, entropy=2.0, approx_kl=0.1, ppo_kl=0.2, clipfrac=0.2, clipfrac_low=0.1,
                         clipfrac_high=0.1, ratio_mean=1.0, ratio_min=0.8, ratio_max=1.5, num_tokens=3),
             policy_part(loss=0.25, pg_loss=0.2, entropy=1.0, approx_kl=0.4, ppo_kl=-0.2, ratio_mean=1.1, ratio_min=0.5,
                         ratio_max=1.2, num_tokens=1),
             policy_part(entropy=NAN, approx_kl=NAN, ppo_kl=NAN, clipfrac=NAN, clipfrac_low=NAN, clipfrac_high=NAN,
                         ratio_mean=NAN, ratio_min=NAN, ratio_max=NAN, num_tokens=0)]
    combined = combined_metrics(PolicyLossStats, parts)
    expected = {"loss": 0.75, "pg_loss": 0.6, "entropy": (2.0 * 3 + 1.0) / 4, "approx_kl": (0.1 * 3 + 0.4) / 4,
                "ppo_kl": (0.2 * 3 - 0.2) / 4,
                "clipfrac": 0.6 / 4, "clipfrac_low": 0.3 / 4, "clipfrac_high": 0.3 / 4,
                "ratio_mean": (1.0 * 3 + 1.1) / 4, "ratio_min": 0.5, "ratio_max": 1.5, "num_tokens": 4}
    assert combined == pytest.approx(expected)
    assert list(combined) == list(expected)  # the record's order, which is policy_loss's
    assert isinstance(combined["num_tokens"], int)


def test_value_stats_combine_over_micro_batches_as_declared():
    parts = [{"loss": 0.3, "value_clipfrac": 0.5, "num_tokens": 2}, {"loss": 0.1, "value_clipfrac": 0.0, "num_tokens": 6},
             {"loss": 0.0, "value_clipfrac": 0.0, "num_tokens": 0}]  # value_loss's clipfrac is 0 with no token
    assert combined_metrics(ValueLossStats, parts) == pytest.approx(
        {"loss": 0.4, "value_clipfrac": 1.0 / 8, "num_tokens": 8})


def test_policy_stats_combine_over_ranks_as_the_whole_minibatch():
    """Two ranks' minibatch statistics (each already combined over its micro-batches): the counts add up, the loss
    terms are the ranks' mean (each rank divided its loss by the normaliser agreed over ranks), token means are
    weighted by each rank's tokens, min and max are the extremes. Worked by hand."""
    ranks = [PolicyLossStats(**policy_part(loss=0.6, pg_loss=0.5, approx_kl=0.1, clipfrac=0.5, ratio_mean=1.2,
                                           ratio_min=0.7, ratio_max=1.4, num_tokens=3)),
             PolicyLossStats(**policy_part(loss=0.2, pg_loss=0.1, approx_kl=0.5, clipfrac=0.0, ratio_mean=1.0,
                                           ratio_min=0.9, ratio_max=2.0, num_tokens=1))]
    whole = combine_ranks(ranks)
    assert whole.num_tokens == 4 and whole.loss == pytest.approx(0.4) and whole.pg_loss == pytest.approx(0.3)
    assert whole.approx_kl == pytest.approx((0.1 * 3 + 0.5) / 4) and whole.clipfrac == pytest.approx(1.5 / 4)
    assert whole.ratio_mean == pytest.approx((1.2 * 3 + 1.0) / 4)
    assert (whole.ratio_min, whole.ratio_max) == (0.7, 2.0)


def test_all_nan_and_no_micro_batch():
    """A minibatch with no kept token at all: its token means, min and max are NaN; no micro-batch: nothing."""
    combined = combined_metrics(PolicyLossStats, [policy_part(approx_kl=NAN, ratio_min=NAN, ratio_max=NAN)] * 2)
    assert all(math.isnan(combined[k]) for k in ("approx_kl", "ratio_min", "ratio_max"))
    assert combined_metrics(PolicyLossStats, []) == {}


def test_the_declared_reductions():
    """What the records declare, read back from their annotations (the table docs/training.md describes)."""
    assert reductions(PolicyLossStats) == {
        "loss": Combine.SUM, "pg_loss": Combine.SUM, "kl": Combine.TOKEN_MEAN, "entropy": Combine.TOKEN_MEAN,
        "approx_kl": Combine.TOKEN_MEAN, "ppo_kl": Combine.TOKEN_MEAN, "clipfrac": Combine.TOKEN_MEAN,
        "clipfrac_low": Combine.TOKEN_MEAN,
        "clipfrac_high": Combine.TOKEN_MEAN, "clipfrac_dual": Combine.TOKEN_MEAN, "penalty": Combine.SUM,
        "ratio_mean": Combine.TOKEN_MEAN, "ratio_min": Combine.MIN,
        "ratio_max": Combine.MAX, "num_tokens": Combine.COUNT}
    assert reductions(ValueLossStats) == {"loss": Combine.SUM, "value_clipfrac": Combine.TOKEN_MEAN,
                                          "num_tokens": Combine.COUNT}


def test_a_name_the_record_does_not_declare_is_refused():
    with pytest.raises(TypeError, match="ratio_maximum"):
        combined_metrics(PolicyLossStats, [policy_part(ratio_maximum=2.0)])
    missing = policy_part()
    del missing["num_tokens"]
    with pytest.raises(TypeError, match="num_tokens"):
        combined_metrics(PolicyLossStats, [missing])


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF_DIR / "algo").glob("*.yaml")))
def test_every_algorithm_reports_the_names_of_its_records(name):
    """Every algo option's `policy_loss` (with a reference, the entropy, a correction's penalty and, where the
    objective has a clip, PPO's dual clip: so every optional name is there too) gives exactly `PolicyLossStats`'s
    names, and a critic's `value_loss` `ValueLossStats`'s."""
    objective = from_yaml("algo", name, group_size=2).loss.objective
    clipped = isinstance(objective, ClippedSurrogate)
    with_dual_clip = {"objective": ClippedSurrogate(objective.clip_low, objective.clip_high, 3.0)} if clipped else {}
    algo = from_yaml("algo", name, group_size=2, **with_dual_clip)
    generator = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(4, 5, generator=generator)
    mask = torch.ones(4, 5, dtype=torch.bool)
    _, metrics = algo.policy_loss(logprobs, logprobs - 0.1, torch.randn(4, generator=generator), mask,
                                  torch.ones(4, 5), ref_logprobs=logprobs + 0.1, entropy=torch.rand(4, 5),
                                  max_length=5, normalizer=algo.loss_normalizer(mask, max_length=5),
                                  penalty=lambda lp: lp * lp)
    assert set(metrics) == set(reductions(PolicyLossStats)) - (set() if clipped else {"clipfrac_dual"}), name
    if hasattr(algo, "value_loss"):
        values = torch.rand(4, 5, generator=generator)
        _, metrics = algo.value_loss(values, values, values + 0.5, mask, normalizer=20.0)
        assert set(metrics) == set(reductions(ValueLossStats)), name
