"""The trainer's support under top-k / top-p sampling (rlmm/policy/support.py, `support=`): the sampler's kept sets, how each
support option normalises the trainer's log-probs, the support/* metrics, and that a token the sampler drew is
always scored (issue 48: it got -inf and the whole step was skipped)."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from rlmm.config.options import from_yaml
from rlmm.policy.rollouts import KeptTokens, Rollouts
from rlmm.policy.support import STATISTICS, statistics, statistics_means
from tests.conftest import build_sampler, build_trainer, sampling, subprocess_env

SUPPORTS = ("sampler", "trainer", "full")


def support(name: str, **values):
    return from_yaml("support", name, **values)


# -- kept sets -----------------------------------------------------------------------------------------------------
def test_kept_sets_round_trip_and_cap():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, -1.0], [3.0, 2.0, 1.0, 0.0, -1.0], [0.5, 0.0, 2.0, 1.0, 0.2]])
    kept = torch.tensor([[False, True, True, True, False], [True, False, False, False, False], [True] * 5])
    tokens = torch.tensor([1, 2, 1])  # row 1 drew a token outside its mask: it is added
    sets = KeptTokens.of_masks(kept, tokens, logits, max_kept=3)
    # row 2 keeps all 5: capped to its 3 most likely (2, 3, 0) and the sampled 1
    assert sets.sizes().tolist() == [3, 2, 4] and sets.capped.tolist() == [False, False, True]
    assert sets.mask(0, 3, 5).tolist() == [[False, True, True, True, False], [True, False, True, False, False],
                                           [True, True, True, True, False]]
    assert sets.ids.dtype == torch.int32 and sets.nbytes() == 9 * 4 + 4 * 8 + 3
    laid = KeptTokens.laid_out([sets, KeptTokens.of_sets([[2]], [False])], width=4)
    assert laid.sizes().tolist() == [3, 2, 4, 0, 1, 0, 0, 0] and laid.capped.tolist()[:4] == [False, False, True, False]
    assert laid.mask(4, 6, 5).tolist() == [[False, False, True, False, False], [False] * 5]


def test_the_vllm_listing_gives_the_sampled_logprob_and_the_kept_set():
    from vllm.logprobs import FlatLogprobs

    from rlmm.samplers.vllm import listed_logprobs

    listing = FlatLogprobs()
    inf = float("inf")
    # position 0: sampled 5, listing 5, 3, 7(-inf); position 1: sampled 9 outside the listed top-2 (both finite)
    listing.append_fast([5, 5, 3, 7], [-0.1, -0.1, -2.4, -inf], iter([1, 1, 2, 3]), [None] * 4)
    listing.append_fast([9, 1, 2], [-3.0, -0.2, -1.9], iter([3, 1, 2]), [None] * 3)
    logprobs, kept = listed_logprobs(listing, [5, 9], listed=2, vocab=100)
    assert logprobs == [-0.1, -3.0]
    assert kept.sizes().tolist() == [2, 3] and kept.ids.tolist() == [3, 5, 1, 2, 9]
    assert kept.capped.tolist() == [False, True]  # every listed token finite: the set may be larger
    _, whole = listed_logprobs(listing, [5, 9], listed=2, vocab=2)
    assert whole.capped.tolist() == [False, False]  # the listing holds the whole vocabulary
    with pytest.raises(RuntimeError, match="starts with token 5, not the sampled 4"):
        listed_logprobs(listing, [4, 9], listed=2, vocab=100)


def test_vllms_sampling_mask_gives_the_kept_sets():
    from vllm.outputs import SamplingMask

    from rlmm.samplers.vllm import kept_of_mask

    kept = kept_of_mask(SamplingMask([[4, 1, 9], [2]]), [9, 3])
    assert kept.ids.tolist() == [1, 4, 9, 2, 3] and kept.sizes().tolist() == [3, 2] and not kept.capped.any()
    with pytest.raises(RuntimeError, match="no sampling mask for every token"):
        kept_of_mask(None, [9])


# -- each support on hand-computed values -----------------------------------------------------------------------------
# probabilities 0.1, 0.2, 0.3, 0.4 at T = 1; top_p 0.5 keeps {3, 2} (0.4 + 0.3 >= 0.5, sorted ascending drop 0.1, 0.2)
LOGITS = torch.tensor([[math.log(0.1), math.log(0.2), math.log(0.3), math.log(0.4)]])


@pytest.mark.parametrize("name,token,kept,expected", [
    ("sampler", 1, [1, 2], math.log(0.2 / 0.5)),  # the sampler kept {1, 2} (its boundary elsewhere)
    ("trainer", 1, [1, 2], math.log(0.2 / 0.9)),  # its own {2, 3} and the sampled 1
    ("trainer", 3, [3], math.log(0.4 / 0.7)),
    ("sampler", 1, None, math.log(0.2 / 0.9)),  # rollouts with no kept set (greedy answers): the trainer's own
    ("full", 1, [1, 2], math.log(0.2)),
])
def test_each_support_normalises_over_its_set(name, token, kept, expected):
    options = sampling(top_p=0.5, support=support(name))
    masks = None if kept is None or not options.support.needs_kept_tokens else \
        KeptTokens.of_sets([kept], [False]).mask(0, 1, 4)
    z = options.support.restrict(LOGITS.clone(), torch.tensor([token]), masks, options)
    got = (z[0, token] - z.logsumexp(-1)[0]).item()
    assert got == pytest.approx(expected, abs=1e-6)


def test_statistics_on_hand_computed_values():
    options = sampling(top_p=0.5, support=support("sampler"))
    kept = KeptTokens.of_sets([[1, 2], []], [True, False])  # a position with an empty set is padding
    columns = statistics(LOGITS.repeat(2, 1), torch.tensor([1, 0]), kept.mask(0, 2, 4), kept.capped, options)
    row = dict(zip(STATISTICS, columns[0].tolist()))
    assert row["position"] == 1 and row["capped"] == 1
    assert row["kept_size_sampler"] == 2 and row["kept_size_trainer"] == 2  # {1, 2} and {2, 3}
    assert row["kept_mass_sampler_set"] == pytest.approx(0.5) and row["kept_mass_trainer_set"] == pytest.approx(0.7)
    assert row["outside_trainer_set"] == 1 and row["jaccard"] == pytest.approx(1 / 3)
    assert row["logprob_sampler_set"] == pytest.approx(math.log(0.4))
    assert row["logprob_trainer_set"] == pytest.approx(math.log(0.2 / 0.9))
    assert row["logprob_full"] == pytest.approx(math.log(0.2))
    assert columns[1].abs().sum() == 0
    mask = torch.tensor([[True, False]])
    means = statistics_means(columns[None], torch.tensor([[math.log(0.4) + 0.01, 0.0]]), mask)
    assert means["log_kept_mass_sampler_set"] == pytest.approx(math.log(0.5))
    assert means["sampler_set/logprob_diff_mean"] == pytest.approx(-0.01, abs=1e-6)
    assert means["full/logprob_diff_mean"] == pytest.approx(math.log(0.2) - math.log(0.4) - 0.01, abs=1e-6)
    assert means["frac_capped"] == 1 and means["frac_outside_trainer_set"] == 1


def test_bad_values_are_one_line():
    with pytest.raises(ValueError, match=r"^support\.max_kept: a count of tokens >= 1, got 0$"):
        support("sampler", max_kept=0)
    for name in ("sampler", "trainer"):
        with pytest.raises(ValueError, match=rf"^support={name}: .* sampling\.logprobs=raw .* \(with raw: support=full"):
            sampling(top_k=5, logprobs="raw", support=support(name))
    sampling(top_k=5, logprobs="raw", support=support("full"))  # raw means the full vocabulary
    sampling(logprobs="raw", support=support("sampler"))  # nothing truncated: nothing to say
    with pytest.raises(ValueError, match=r"^sampling\.top_k: 101 is more than the model's vocabulary of 100 tokens"):
        sampling(top_k=101).check_vocabulary(100)


# -- the engines' kept sets against the trainer's ----------------------------------------------------------------------
SHARP = dict(temperature=0.8, top_p=0.8, top_k=20)


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_an_fp32_samplers_kept_sets_are_the_fp32_trainers_own(engine, small_model_path, prompts):
    """fp32 on both sides: the sampler's kept sets are the trainer's own top-k / top-p sets (Jaccard 1, no sampled
    token outside them), every support scores what the sampler reports but `full`, which is off by log S exactly."""
    from rlmm.policy.precision import SidePrecision
    from rlmm.policy.support import recorded, support_metrics

    fp32 = SidePrecision("fp32", False)
    sampler = build_sampler(engine, small_model_path, fp32, sampling(**SHARP), seed=0)
    try:
        rollouts = sampler.generate(prompts, n=4)
        greedy = sampler.generate(prompts[:2], greedy=True)
    finally:
        sampler.close()
    assert greedy.kept_tokens is None and len(rollouts.kept_tokens) == len(rollouts)
    assert all(len(k) == len(r) for k, r in zip(rollouts.kept_tokens, rollouts.response_ids))
    sampler_logprobs, mask = rollouts.padded_sampler_logprobs()
    for name in SUPPORTS:
        trainer = build_trainer("torch", small_model_path, fp32, sampling(**SHARP, support=support(name)),
                                micro_batch_size=8)
        with recorded(trainer.model) as record:
            trainer_logprobs = trainer.logprobs(rollouts)
        trainer.close()
        metrics = support_metrics(record, sampler_logprobs, mask)
        delta = (trainer_logprobs - sampler_logprobs)[mask]
        assert torch.isfinite(trainer_logprobs[mask]).all()
        assert metrics["jaccard"] == 1 and metrics["frac_outside_trainer_set"] == 0 and metrics["frac_capped"] == 0
        assert 0 < metrics["kept_mass_sampler_set"] < 1 and metrics["kept_size_sampler"] >= 1
        if name == "full":
            assert delta.mean().item() == pytest.approx(metrics["log_kept_mass_sampler_set"], abs=1e-4)
            assert delta.max() < 1e-4 and delta.mean() < -1e-3  # log S < 0 on the truncated positions
        else:
            assert delta.abs().max() < 1e-4
        assert metrics[f"{ {'sampler': 'sampler_set', 'trainer': 'trainer_set', 'full': 'full'}[name]}"
                       "/logprob_abs_diff_mean"] == pytest.approx(delta.abs().mean().item(), abs=1e-6)


def test_kept_sets_survive_the_delay_lines_checkpoint():
    from rlmm.run.rollout_source import InFlight, from_in_flight_state, in_flight_state
    from rlmm.run.step import SampledBatch

    kept = KeptTokens.of_sets([[1, 2], [3]], [False, True])
    rollouts = Rollouts([[1]], [[2, 3]], [torch.tensor([-0.1, -0.2])], ["length"], kept_tokens=[kept])
    state = in_flight_state(InFlight(0, 1, SampledBatch(rollouts, torch.tensor([1.0]), {"a": 1.0}, {})))
    torch.save(state, buffer := __import__("io").BytesIO())
    buffer.seek(0)
    back = from_in_flight_state(torch.load(buffer, weights_only=True)).batch.rollouts.kept_tokens[0]
    assert back.ids.tolist() == [1, 2, 3] and back.offsets.tolist() == [0, 2, 3] and back.capped.tolist() == [False, True]


# -- rlmm train ---------------------------------------------------------------------------------------------------------
def test_top_p_trains_every_step_and_measures_the_truncation(tmp_path):
    """Issue 48's command with the sampler's weights perturbed (sampler.perturb=0.1), so the two sides' nucleus
    boundaries differ on some tokens of every step: before, each such token got -inf and its step was skipped."""
    result = subprocess.run([sys.executable, "-m", "rlmm.cli", "train", "sampling.top_p=0.9", "sampler.perturb=0.1",
                             "train.steps=4", "train.eval_every=0", "train.eval_prompts=8",
                             "train.eval_trained_weights=false", "logger=none", "seed=0", f"hydra.run.dir={tmp_path}"],
                            capture_output=True, text=True, timeout=900, env=subprocess_env(), stdin=subprocess.DEVNULL)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()][1:]
    assert [s["train/skipped"] for s in steps] == [0.0] * 4
    assert all(s["support/kept_size_sampler"] >= 1 and 0 < s["support/kept_mass_sampler_set"] < 1 for s in steps)
    # the default support is the sampler's kept set: the mismatch the run logs is the one normalised over it
    assert all(s["mismatch/logprob_abs_diff_mean"] == pytest.approx(s["support/sampler_set/logprob_abs_diff_mean"],
                                                                    rel=1e-4) for s in steps)
    assert sum(s["support/frac_outside_trainer_set"] for s in steps) > 0  # the event the old code skipped on
    assert "bad step skipped" not in result.stderr + result.stdout


def test_a_run_written_before_the_support_axis_resumes_at_its_default():
    """A run directory from before `support=` existed has no `support` in its config.yaml: resuming it with the
    default support (what it computed) is no difference; with another support, or another max_kept, it is."""
    from omegaconf import OmegaConf

    from rlmm.config.options import option_node
    from rlmm.run.resume import differences

    def config(option: str, **values):
        return {"choices": {"model": "tiny", "support": option}, "seed": 0,
                "support": {**OmegaConf.to_container(option_node("support", option)), **values}}

    before = {"choices": {"model": "tiny"}, "seed": 0}
    assert differences(before, config("sampler")) == []
    assert "choices.support=(not set) there, full here" in differences(before, config("full"))
    assert "support.max_kept=(not set) there, 7 here" in differences(before, config("sampler", max_kept=7))
    assert differences({**before, "seed": 1}, config("sampler")) == ["seed=1 there, 0 here"]
