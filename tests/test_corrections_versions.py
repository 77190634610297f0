"""Corrections on mixed-version responses (issue 53, partial rollouts: one response's tokens sampled by several weight
versions). The staleness mask (`correction=token_staleness_mask`, xtuner's `max_token_staleness`) worked out by hand,
alone and stacked, and refused where a run tracks no versions; and the methods that need no versions shown right on
such responses: a sequence ratio is the product over tokens of pi_old(y_t) / mu_{v_t}(y_t), each token against the
policy of the version that sampled it, as long as each token carries its own sampler log-prob."""
from __future__ import annotations

import math

import pytest
import torch
from hydra.utils import instantiate

from rlmm.algos.gspo import sequence_ratio as gspo_sequence_ratio
from rlmm.config.options import CONF_DIR, from_yaml
from rlmm.corrections.base import BatchView, MicroBatchView, check_versions
from rlmm.corrections.bypass import Bypass
from rlmm.corrections.m2po import SecondMomentMask
from rlmm.corrections.on_current_policy import OnCurrentPolicy
from rlmm.corrections.opsm import OffPolicySequenceMask
from rlmm.corrections.seq_mis import SequenceMask
from rlmm.corrections.seq_tis import SequenceTIS
from rlmm.corrections.stack import Stack
from rlmm.corrections.tis import TokenTIS
from rlmm.corrections.token_staleness import TokenStalenessMask

# ---------------------------------------------------------------- the staleness mask, by hand
#
# Each token's updates behind pi_old (PAD: padding). Row 0 was begun 3 updates back and finished by pi_old's own
# weights; row 1 is wholly 2 behind; row 2 one token 1 behind then pi_old's; row 3 pi_old's throughout.
PAD = -1
STALENESS = [[3, 3, 1, 0], [2, 2, 2, PAD], [1, 0, PAD, PAD], [0, 0, 0, 0]]
# 13 response tokens, staleness summing to 3 + 3 + 1 + 6 + 1 = 14, the largest 3.
KEPT = {  # max_token_staleness N -> the tokens kept, [s_t <= N]
    0: [[False, False, False, True], [False, False, False, False], [False, True, False, False], [True] * 4],
    1: [[False, False, True, True], [False, False, False, False], [True, True, False, False], [True] * 4],
    2: [[False, False, True, True], [True, True, True, False], [True, True, False, False], [True] * 4],
    3: [[True, True, True, True], [True, True, True, False], [True, True, False, False], [True] * 4],
}
STALE_TOKENS = {0: 7, 1: 5, 2: 2, 3: 0}  # response tokens with s_t > N


def hand_batch(padding_staleness: int = 0):
    """Log-probs with a mismatch on every token (r_t = 1.25 on row 0, 0.8 elsewhere), the mask, and the staleness with
    `padding_staleness` on padding (the contract says 0; nothing may depend on it)."""
    s = torch.tensor(STALENESS)
    mask = s != PAD
    sampler = torch.full(s.shape, -1.0, dtype=torch.float64)
    train = sampler + torch.tensor([[math.log(1.25)]] + [[math.log(0.8)]] * 3, dtype=torch.float64)
    return train, sampler, mask, torch.where(mask, s, padding_staleness)


@pytest.mark.parametrize("bound", sorted(KEPT))
def test_the_mask_keeps_exactly_the_tokens_at_most_the_bound_behind(bound):
    """keep_t = [s_t <= N]: inclusive (xtuner's s < (N + 1) * sync interval, rlmm syncing every update); w = 1 and
    pi_old the trainer's on what it keeps; padding's staleness changes nothing."""
    train, sampler, mask, staleness = hand_batch()
    out = TokenStalenessMask(bound)(train, sampler, mask, token_staleness=staleness)
    assert out.mask.tolist() == KEPT[bound]
    assert torch.equal(out.weights, torch.where(out.mask, 1.0, 0.0).float())
    assert torch.equal(out.old_logprobs, torch.where(mask, train, 0.0))
    m = out.metrics
    assert m["frac_tokens_stale"] == m["frac_tokens_masked"] == pytest.approx(STALE_TOKENS[bound] / 13, abs=1e-15)
    assert m["frac_sequences_masked"] == (0.25 if bound <= 1 else 0.0)  # row 1 wholly 2 behind: nothing of it left
    assert m["token_staleness_mean"] == pytest.approx(14 / 13, abs=1e-15) and m["token_staleness_max"] == 3.0
    garbage = TokenStalenessMask(bound)(train, sampler, mask, token_staleness=hand_batch(padding_staleness=99)[3])
    assert torch.equal(garbage.mask, out.mask) and garbage.metrics == out.metrics


def test_the_staleness_figures_are_the_batchs_wherever_the_mask_stands_in_a_stack():
    """frac_tokens_stale and the staleness statistics are the batch's response tokens', wherever the mask stands in
    a stack; frac_tokens_masked is of the tokens it was given."""
    train, sampler, mask, staleness = hand_batch()
    given = mask.clone()
    given[3] = False  # an earlier stage dropped row 3 (4 fresh tokens)
    out = TokenStalenessMask(1).before_update(BatchView(train, sampler, given, torch.zeros(mask.shape), None,
                                                        response_mask=mask, token_staleness=staleness))
    assert out.metrics["frac_tokens_stale"] == pytest.approx(5 / 13) and out.metrics["frac_tokens_masked"] == 5 / 9
    assert out.metrics["token_staleness_mean"] == pytest.approx(14 / 13)


def test_a_batch_without_versions_raises_and_bad_bounds_are_refused():
    train, sampler, mask, _ = hand_batch()
    with pytest.raises(ValueError, match=r"^correction: the token staleness mask reads each token's weight version, "
                                         r"and this batch has none .*train.staleness >= 1 or "
                                         r"train.partial_rollouts=true$"):
        TokenStalenessMask(1)(train, sampler, mask)
    for bad in (-1, 1.5, True, "1", None):
        with pytest.raises(ValueError) as err:
            TokenStalenessMask(bad)
        assert str(err.value) == f"correction.max_token_staleness: must be an integer >= 0, got {bad!r}"


def test_check_versions_refuses_a_reader_of_versions_where_the_run_tracks_none():
    message = ("{}: {} reads each token's weight version, which this run does not track (train.staleness=0); use "
               "train.staleness >= 1, with whole responses or train.partial_rollouts=true")
    mask = TokenStalenessMask(1)
    with pytest.raises(ValueError) as err:
        check_versions(mask, tracked=False)
    assert str(err.value) == message.format("correction", "TokenStalenessMask") and "\n" not in str(err.value)
    stack = Stack({"seq_veto": from_yaml("correction", "seq_veto"), "token_staleness_mask": mask,
                   "tis": TokenTIS(2.0)})
    with pytest.raises(ValueError) as err:
        check_versions(stack, tracked=False, option="train.monitor.switch_to")
    assert str(err.value) == message.format("train.monitor.switch_to", "token_staleness_mask")
    inside = OnCurrentPolicy({"token_staleness_mask": {"max_token_staleness": 1}})
    with pytest.raises(ValueError, match="^correction: token_staleness_mask reads"):
        check_versions(inside, tracked=False)
    for fine in (mask, stack, inside):
        check_versions(fine, tracked=True)
    for name in ("none", "tis", "seq_tis", "m2po", "opsm", "bypass"):  # no version read: fine either way
        check_versions(from_yaml("correction", name), tracked=False)


def test_the_mask_stacks_before_tis_and_the_stack_needs_versions():
    """`correction=token_staleness_mask+tis`, composed as the CLI does: the mask's tokens with TIS's weights on them;
    the stack says it needs versions (the run refuses it without), a stack without the mask does not."""
    from hydra import compose, initialize_config_dir

    import rlmm.config.schema  # noqa: F401

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["correction=token_staleness_mask+tis"])
    stack = instantiate(cfg.correction)
    assert isinstance(stack, Stack) and list(stack.stages) == ["token_staleness_mask", "tis"]
    assert stack.needs_versions and not Stack({"tis": TokenTIS(2.0)}).needs_versions
    train, sampler, mask, staleness = hand_batch()
    out = stack(train, sampler, mask, token_staleness=staleness)
    assert out.mask.tolist() == KEPT[1]
    tis = TokenTIS(2.0)(train, sampler, mask)
    assert torch.equal(out.weights, torch.where(out.mask, tis.weights, 0.0))  # 1.25 on row 0, 0.8 elsewhere
    assert out.metrics["token_staleness_mask/frac_tokens_stale"] == pytest.approx(5 / 13)
    assert out.metrics["frac_tokens_masked"] == pytest.approx(5 / 13)
    with pytest.raises(ValueError, match="this batch has none"):
        stack(train, sampler, mask)


# ---------------------------------------------------------------- sequence-level methods on a mixed response
#
# One response of 5 tokens: tokens 0-2 sampled by version a (2 updates behind pi_old), tokens 3-4 by version b (pi_old's
# own weights, after a weight sync mid-response). Each policy's probability of each sampled token:
OLD = [0.5, 0.2, 0.9, 0.4, 0.7]    # pi_old
MU_A = [0.4, 0.25, 0.8, 0.3, 0.5]  # the sampler at version a
MU_B = [0.9, 0.6, 0.3, 0.5, 0.6]    # the sampler at version b
THETA = [0.55, 0.15, 0.85, 0.45, 0.6]  # pi_theta, inside the update
VERSION = ["a", "a", "a", "b", "b"]
MU = [{"a": MU_A, "b": MU_B}[v][t] for t, v in enumerate(VERSION)]  # each token's own behaviour policy
# The sequence ratio against each token's own behaviour policy, in float64 by hand: 1.25 * 0.8 * 1.125 * 0.8 * 7/6
SEQ_RATIO = math.prod(o / m for o, m in zip(OLD, MU))
ONE_POLICY = math.prod(o / m for o, m in zip(OLD, MU_B))  # what pricing every token by the last version would give


def mixed_response():
    """[2, 5] log-probs: row 0 the mixed response, row 1 padding but for one token on which all agree (so a batch
    statistic is row 0's alone where a row's are compared)."""
    lp = lambda p: torch.tensor([p, [0.5] + [1.0] * 4], dtype=torch.float64).log()  # noqa: E731
    mask = torch.tensor([[True] * 5, [True] + [False] * 4])
    return lp(OLD), lp(MU), lp(THETA), mask


def test_the_mixed_response_is_worth_testing():
    assert SEQ_RATIO == pytest.approx(1.05, rel=1e-12)
    assert abs(ONE_POLICY - SEQ_RATIO) > 0.5  # a method that priced every token by one version would fail below


def test_seq_tis_weight_is_the_product_of_each_tokens_ratio_to_its_own_sampler():
    old, mu, _, mask = mixed_response()
    out = SequenceTIS(cap=10.0)(old, mu, mask)
    assert out.weights[0].double() == pytest.approx([SEQ_RATIO] * 5, rel=1e-7)  # float32 weights
    assert out.metrics["seq_ratio_max"] == pytest.approx(SEQ_RATIO, rel=1e-12)
    truncated = SequenceTIS(cap=1.0)(old, mu, mask)  # 1.05 > 1: capped
    assert truncated.metrics["frac_sequences_truncated"] == 0.5


def test_seq_mis_accepts_and_rejects_at_the_product_of_each_tokens_ratio_to_its_own_sampler():
    old, mu, _, mask = mixed_response()
    kept = SequenceMask(cap=SEQ_RATIO * (1 + 1e-9))(old, mu, mask)
    assert kept.mask[0].all() and kept.weights[0].double() == pytest.approx([SEQ_RATIO] * 5, rel=1e-7)
    assert not SequenceMask(cap=SEQ_RATIO * (1 - 1e-9))(old, mu, mask).mask[0].any()


def opsm_keeps(threshold: float) -> bool:
    old, mu, theta, mask = mixed_response()
    micro = MicroBatchView(logprobs=theta, old_logprobs=old, trainer_logprobs=old, sampler_logprobs=mu,
                           advantages=torch.full(mask.shape, -1.0), mask=mask, weights=torch.where(mask, 1.0, 0.0))
    return bool(OffPolicySequenceMask(threshold, "sampler").in_update(micro).mask[0].all())


def test_opsm_statistic_is_the_mean_log_ratio_of_each_token_to_its_own_sampler():
    """D = (1/|y|) sum_t log mu_{v_t}(y_t) / pi_theta(y_t): a negative-advantage response is kept just above it and
    dropped just below."""
    divergence = sum(math.log(m / t) for m, t in zip(MU, THETA)) / 5
    one_policy = sum(math.log(m / t) for m, t in zip(MU_B, THETA)) / 5
    assert abs(one_policy - divergence) > 0.05
    assert opsm_keeps(divergence + 1e-12) and not opsm_keeps(divergence - 1e-12)


def test_gspo_ratio_under_bypass_is_the_geometric_mean_against_each_tokens_own_sampler():
    """GSPO's s = (pi_theta(y) / pi_old(y))^(1/|y|) with pi_old := mu (bypass): each token against its own sampler.
    (Against the trainer's pi_old, GSPO's default, no sampler log-prob enters and versions do not matter.)"""
    old, mu, theta, mask = mixed_response()
    bypassed = Bypass()(old, mu, mask).old_logprobs
    s = gspo_sequence_ratio(torch.where(mask, theta - bypassed, 0.0), mask)
    expected = math.prod(t / m for t, m in zip(THETA, MU)) ** (1 / 5)
    assert s[0].tolist() == pytest.approx([expected] * 5, rel=1e-12)


# ---------------------------------------------------------------- M2PO on a mixed-version batch
#
# delta_t = log pi_old - log mu_{v_t} per token: the stale tokens (version a) carry the larger ones.
M2_DELTA = [[0.3, 0.1, 0.0], [0.2, 0.05, 0.0]]  # row 1's last token padding
M2_VERSION = [["a", "a", "b"], ["a", "b", None]]
M2_SHIFT = {"a": 0.0, "b": 0.4}  # version b's log-prob of every token is version a's + 0.4


def test_m2po_second_moment_uses_each_tokens_own_behaviour_logprob():
    """m2_t = (log mu_{v_t}(y_t) - log pi_old(y_t))^2 = 0.09, 0.01, 0, 0.04, 0.0025: mean 0.0285 >= tau = 0.02;
    without the largest (0.09) 0.0525 / 4 = 0.013125 < tau, so only row 0's first token goes. Priced by version a
    throughout, m2 would differ on the version-b tokens."""
    mask = torch.tensor([[True, True, True], [True, True, False]])
    mu_a = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, 0.0]], dtype=torch.float64)
    mu = mu_a + torch.tensor([[M2_SHIFT[v] if v else 0.0 for v in row] for row in M2_VERSION], dtype=torch.float64)
    old = mu + torch.tensor(M2_DELTA, dtype=torch.float64)
    out = SecondMomentMask(0.02)(old, mu, mask)
    assert out.metrics["second_moment"] == pytest.approx((0.09 + 0.01 + 0.0 + 0.04 + 0.0025) / 5, rel=1e-12)
    assert out.metrics["second_moment_kept"] == pytest.approx((0.01 + 0.0 + 0.04 + 0.0025) / 4, rel=1e-12)
    assert out.mask.tolist() == [[False, True, True], [True, True, False]]
    one_version = SecondMomentMask(0.02)(old, mu_a, mask)
    assert one_version.metrics["second_moment"] != pytest.approx(out.metrics["second_moment"])
