"""The layer attribution (rlmm/mismatch/layer_attribution.py; vLLM's capture in rlmm/samplers/vllm_capture.py): each engine's
hidden states, captured while it samples, line up with the trainer's token by token and site by site; the trainer
against itself is exactly 0; capturing changes no sample and leaves no hook behind; the figures follow from the
states as defined."""
from __future__ import annotations

import math

import pytest
import torch

from rlmm.mismatch.layer_attribution import (PARTS, compare_layers, layer_verdict, relative_errors, site_names, summarize,
                                    trainer_states)
from rlmm.policy.precision import SidePrecision
from tests.conftest import build_sampler, build_trainer, sampling

OPTIONS = sampling(max_new_tokens=6)
FP32 = SidePrecision("fp32", False)


def captured(option: str, path: str, prompts, precision=FP32):
    sampler = build_sampler(option, path, precision, OPTIONS, seed=0, prompt_tokens=32, max_rows=16)
    try:
        with sampler.capturing_layers():
            return sampler.generate(prompts, n=2)
    finally:
        sampler.close()


@pytest.mark.parametrize("option", ["hf", "vllm"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_fp32_engines_states_line_up_with_the_fp32_trainers(option, kind, small_model_path, moe_model_path, prompts):
    """fp32 on both sides, so only rounding separates them: at every site the mean relative error is below 1e-4,
    the embedding's output is the same to the bit, and exactly the last response token (never fed back) has no
    state. A state filed one position off or under another row, or vLLM's stream taken without its residual, is
    off by O(1)."""
    path = small_model_path if kind == "dense" else moe_model_path
    rollouts = captured(option, path, prompts[:4])
    trainer = build_trainer("torch", path, FP32, OPTIONS)
    try:
        layers = len(trainer.model.model.layers)
        for prompt, response, states in zip(rollouts.prompt_ids, rollouts.response_ids, rollouts.layer_states):
            assert states.shape == (len(prompt) + len(response), len(site_names(layers)), trainer.model.config.hidden_size)
            missing = states.isnan().any(-1).any(-1).nonzero().flatten().tolist()
            assert missing == ([len(prompt) + len(response) - 1] if response else [])
        result = compare_layers(trainer, rollouts, "fp32", bucket_size=4)
    finally:
        trainer.close()
    assert list(result["comparisons"]) == ["kernels"]  # both fp32: no precision part
    kernels = result["comparisons"]["kernels"]
    assert result["sites"] == site_names(layers) and len(result["sites"]) == 2 + layers * (len(PARTS) + 1)
    assert result["tokens"] == sum(len(p) + len(r) - 1 for p, r in zip(rollouts.prompt_ids, rollouts.response_ids))
    assert kernels["frac_identical"][0] == 1.0 and kernels["rel_error"][0] == 0.0
    assert all(0 <= e < 1e-4 for e in kernels["rel_error"]), kernels["rel_error"]


def test_the_trainer_against_itself_is_exactly_zero_and_the_verdict_says_so(small_model_path, prompts):
    rollouts = captured("hf", small_model_path, prompts[:3])
    trainer = build_trainer("torch", small_model_path, FP32, OPTIONS)
    try:
        rollouts.layer_states = trainer_states(trainer, rollouts)
        result = compare_layers(trainer, rollouts, "fp32", bucket_size=4)
    finally:
        trainer.close()
    kernels = result["comparisons"]["kernels"]
    assert kernels["rel_error_max"] == [0.0] * len(result["sites"]) and kernels["frac_identical"] == [1.0] * len(result["sites"])
    assert kernels["first_departing"] is None and math.isnan(kernels["growth"])
    assert "equal the trainer's to the bit at every site" in layer_verdict(result)


def test_the_figures_follow_from_the_states_as_defined():
    """Two rows worked by hand: sites [embed, layer_0.attn_norm, .attn, .mlp_norm, .mlp, layer_0, norm], hidden 2;
    the tested side differs from the reference first at layer_0.attn, at one prompt and one response position."""
    sites = site_names(1)
    reference = [torch.ones(3, len(sites), 2), torch.ones(2, len(sites), 2)]
    tested = [r.clone() for r in reference]
    tested[0][1, 2] = torch.tensor([1.0, 1.5])  # row 0 (prompt length 2), position 1 (prompt): attn off by 0.5
    tested[0][2, 5:] = torch.tensor([2.0, 1.0])  # position 2 (response): the stream and the final norm
    tested[1][1] = math.nan  # row 1's last response token: never fed back, no state
    compared = relative_errors(tested, reference, [2, 1])
    assert compared["positions"].tolist() == [0, 1, 2, 0] and compared["prompt"].tolist() == [True, True, False, True]
    figures = summarize(compared, sites, bucket_size=2)
    e = 0.5 / math.sqrt(2)  # ||(0, 0.5)|| / ||(1, 1)||, and ||(1, 0)|| / ||(1, 1)|| = 2 e
    assert figures["rel_error"][2] == pytest.approx(e / 4) and figures["rel_error_prompt"][2] == pytest.approx(e / 3)
    assert figures["rel_error_response"][2] == 0 and figures["rel_error_response"][5] == pytest.approx(2 * e)
    assert figures["rel_error_max"][5] == pytest.approx(2 * e) and figures["frac_identical"][2] == 0.75
    assert figures["first_departing"] == "layer_0.attn"
    assert figures["growth"] == pytest.approx(1.0)  # the norm's error over the stream's after layer 0
    assert figures["profile"][2] == pytest.approx([e / 3, 0.0])  # positions {0, 1} (3 tokens), {2}
    assert figures["profile"][5] == pytest.approx([0.0, 2 * e])


def test_capturing_changes_no_sample_and_leaves_no_hook(small_model_path, prompts):
    """vLLM: the same seeded draws with and without the capture, to the bit; after it the engine's modules hold
    the hooks they held before and its model runner's forward is its own again."""
    from rlmm.samplers.vllm_internals import engine_model, model_runner

    sampler = build_sampler("vllm", small_model_path, SidePrecision("bf16", False), OPTIONS, seed=0, prompt_tokens=32,
                            max_rows=16)
    try:
        hooks = sum(len(m._forward_hooks) for m in engine_model(sampler.llm).modules())
        forward = model_runner(sampler.llm)._model_forward
        plain = sampler.generate(prompts, n=2)
        sampler.calls = 0
        with sampler.capturing_layers():
            with_states = sampler.generate(prompts, n=2)
        assert sum(len(m._forward_hooks) for m in engine_model(sampler.llm).modules()) == hooks
        assert model_runner(sampler.llm)._model_forward == forward
        sampler.calls = 0
        after = sampler.generate(prompts, n=2)
    finally:
        sampler.close()
    for other in (with_states, after):
        assert other.response_ids == plain.response_ids
        assert all(torch.equal(a, b) for a, b in zip(other.sampler_logprobs, plain.sampler_logprobs))
    assert plain.layer_states is None and after.layer_states is None and len(with_states.layer_states) == len(plain)
