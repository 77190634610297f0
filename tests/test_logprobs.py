"""Log-prob definitions shared by samplers and trainer, checked on hand-computed values."""
import math

import pytest
import torch

from rlmm.config.options import from_yaml
from rlmm.policy.logprobs import mask_logits, token_logprobs
from tests.conftest import sampling


def test_raw_logprobs_ignore_temperature_and_truncation():
    logits = torch.tensor([[math.log(1.0), math.log(2.0), math.log(5.0)]])  # probs 1/8, 2/8, 5/8
    lp = token_logprobs(logits, torch.tensor([1]), sampling(temperature=0.5, top_k=1, logprobs="raw",
                                                            support=from_yaml("support", "full")))
    assert lp.item() == pytest.approx(math.log(2 / 8), abs=1e-6)


def test_processed_logprobs_apply_temperature():
    logits = torch.tensor([[0.0, math.log(2.0), math.log(5.0)]])
    # T = 0.5 squares the odds: 1 : 4 : 25
    lp = token_logprobs(logits, torch.tensor([2]), sampling(temperature=0.5))
    assert lp.item() == pytest.approx(math.log(25 / 30), abs=1e-6)


def test_top_k_renormalises_over_kept_tokens():
    logits = torch.tensor([[0.0, math.log(2.0), math.log(5.0)]])
    lp = token_logprobs(logits, torch.tensor([1]), sampling(top_k=2))
    assert lp.item() == pytest.approx(math.log(2 / 7), abs=1e-6)
    assert torch.isneginf(token_logprobs(logits, torch.tensor([0]), sampling(top_k=2))).item()


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log().unsqueeze(0)
    # p = 0.6: ascending cumulative mass 0.1, 0.3, 0.6, 1.0; drop while <= 0.4 -> drop 0.1 and 0.2
    masked = mask_logits(logits, sampling(top_p=0.6))
    assert torch.isneginf(masked[0, :2]).all() and torch.isfinite(masked[0, 2:]).all()
    lp = token_logprobs(logits, torch.tensor([3]), sampling(top_p=0.6))
    assert lp.item() == pytest.approx(math.log(0.4 / 0.7), abs=1e-6)


def test_top_p_always_keeps_the_most_likely_token():
    logits = torch.tensor([[0.0, 0.0, 10.0]])
    masked = mask_logits(logits, sampling(top_p=0.01))
    assert torch.isfinite(masked[0, 2]) and torch.isneginf(masked[0, :2]).all()


def test_sampling_options_reject_bad_values():
    with pytest.raises(ValueError, match="sampling.logprobs: unknown mode 'cooked' \\(allowed: processed, raw\\)"):
        sampling(logprobs="cooked")
    with pytest.raises(ValueError, match="temperature"):
        sampling(temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        sampling(top_p=1.5)
