"""FP8 KV cache scales (`sampler.kv_scales`; rlmm/policy/kv_scales.py, rlmm/samplers/vllm.py `calibrate_kv_scales`):
the formula on hand-made amaxes, what vLLM-CPU's kernels do with a scale (called directly), calibrated scales reaching
the engine at start and after a sync (read back from the engine and compared with the K and V of a transformers
forward of the same weights, the trainer's side), and the refusals."""
from __future__ import annotations

import pytest
import torch

from rlmm.policy.kv_scales import MARGIN, check_kv_scales, fp8_kv_scales
from rlmm.policy.precision import SidePrecision
from rlmm.samplers.perturb import checkpoint_tensors
from rlmm.samplers.vllm_internals import engine_model, kv_cache_scales
from tests.conftest import build_sampler, sampling
from tests.this_cpu import fp8_kv_cache_here

BF16 = SidePrecision("bf16", False)
FP8_KV_HERE = fp8_kv_cache_here()
needs_fp8_kv = pytest.mark.skipif(not FP8_KV_HERE, reason="vLLM-CPU keeps an FP8 KV cache only with AVX-512 or AMX "
                                                          "(rlmm/samplers/quantize.py machine_kv_cache_refusal)")


# -- the formula -----------------------------------------------------------------------------------------------------
def test_the_scale_maps_each_layers_amax_to_just_under_the_fp8_maximum():
    keys = torch.tensor([[0.5, -3.0, 2.0], [0.25, 0.125, -0.0625]])  # two layers' K, hand-made
    values = torch.tensor([[-7.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # the second layer's V all zero
    amax = torch.stack([keys.abs().amax(dim=1), values.abs().amax(dim=1)], dim=1)  # [layers, (k, v)]
    assert amax.tolist() == [[3.0, 7.0], [0.25, 0.0]]
    scales = fp8_kv_scales(amax, "fp8_e4m3")
    assert MARGIN == 1.05  # NeMo-RL's default margin
    expected = torch.tensor([[1.05 * 3.0 / 448, 1.05 * 7.0 / 448], [1.05 * 0.25 / 448, 1.0]])  # amax 0: 1.0
    assert torch.allclose(scales, expected, rtol=1e-6, atol=0)
    assert torch.allclose(fp8_kv_scales(amax, "fp8_e5m2")[0], 1.05 * amax[0] / 57344, rtol=1e-6, atol=0)
    # The largest value lands at 448 / 1.05, inside E4M3's range, and rounds there without clamping.
    largest = (keys[0, 1] / scales[0, 0]).to(torch.float8_e4m3fn).float()
    assert 400 < largest.abs() < 448
    with pytest.raises(ValueError, match=r"^sampler.kv_scales=calibrated: K/V amax must be finite and >= 0"):
        fp8_kv_scales(torch.tensor([1.0, float("nan")]), "fp8_e4m3")


# -- what vLLM-CPU's kernels do with the scales (its custom ops called directly) ----------------------------------------
def write_and_read(key, value, query, write_scale: float, read_scale: float, block: int = 32):
    """One sequence through vLLM-CPU's FP8 KV cache ops (v1/attention/backends/cpu_attn.py calls them so): K and V
    written with `write_scale`, attention computed reading them with `read_scale`; returns (the cache's K and V
    decoded to fp32 and multiplied by the write scale, [tokens, head dim], and the attention output)."""
    import vllm._custom_ops as ops

    tokens, kv_heads, head_dim = key.shape
    cache = torch.zeros(1, kv_heads, 2 * block, head_dim, dtype=torch.uint8)
    key_cache, value_cache = cache.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(tokens), "vec",
                                   k_scale=write_scale, v_scale=write_scale, kv_cache_dtype="fp8_e4m3")
    starts, lengths = torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([tokens], dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=query.shape[1], num_kv_heads=kv_heads, head_dim=head_dim, seq_lens=lengths,
        dtype=query.dtype, query_start_loc=starts, causal=True, sliding_window_size=-1, isa="vec",
        enable_kv_split=False, kv_cache_dtype="fp8_e4m3")
    out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts, seq_lens=lengths,
        scale=1.0, causal=True, alibi_slopes=None, sliding_window=-1, block_table=torch.zeros(1, 1, dtype=torch.int32),
        softcap=0.0, scheduler_metadata=metadata, s_aux=None, k_scale=read_scale, v_scale=read_scale,
        kv_cache_dtype="fp8_e4m3")
    stored_k = key_cache.view(torch.float8_e4m3fn).float()[0, 0].reshape(head_dim, block).T[:tokens]  # K column-major
    stored_v = value_cache.view(torch.float8_e4m3fn).float()[0, 0][:tokens]
    return stored_k * write_scale, stored_v * write_scale, out.float()


@needs_fp8_kv
def test_vllm_cpu_writes_k_over_its_scale_rounded_toward_zero_and_reads_it_back_times_the_scale():
    generator = torch.Generator().manual_seed(0)
    tokens, head_dim = 16, 64
    key = (torch.randn(tokens, 1, head_dim, generator=generator) * 0.05).to(torch.bfloat16)  # small: below 2^-6 often
    value = (torch.randn(tokens, 1, head_dim, generator=generator) * 0.05).to(torch.bfloat16)
    query = torch.randn(tokens, 2, head_dim, generator=generator).to(torch.bfloat16)
    reference = torch.nn.functional.scaled_dot_product_attention(
        query.float().transpose(0, 1), key.float().expand(-1, 2, -1).transpose(0, 1),
        value.float().expand(-1, 2, -1).transpose(0, 1), is_causal=True, scale=1.0).transpose(0, 1)
    calibrated = MARGIN * max(key.abs().max(), value.abs().max()).item() / 448
    subnormal = {}
    for scale in (1.0, calibrated):
        k, v, out = write_and_read(key, value, query, scale, scale)
        for stored, x in ((k, key[:, 0].float()), (v, value[:, 0].float())):
            assert (stored.abs() <= x.abs()).all()  # truncated toward zero, never rounded up (torch rounds to nearest)
            normal = (x / scale).abs() >= 2 ** -6  # E4M3's normal range: 3 mantissa bits, < 12.5% relative error
            assert ((stored - x).abs() < 0.125 * x.abs())[normal].all()
            subnormal[scale] = subnormal.get(scale, 0) + int((~normal & (x != 0)).sum())
        assert (out - reference).abs().max() < 0.02  # written with s, read with s: attention as in bf16, nearly
    # At 1.0 a quarter of these small values fall below 2^-6 and lose mantissa bits; calibrated, none does.
    assert subnormal[1.0] > 0.1 * 2 * key.numel() and subnormal[calibrated] == 0
    # Read with 1.0 instead of the s they were written with, attention is wrong by orders of magnitude: the read
    # multiplies by the scale it is given.
    _, _, misread = write_and_read(key, value, query, calibrated, 1.0)
    assert (misread - reference).abs().max() > 10


# -- the engine: calibrated scales at start and after every sync ---------------------------------------------------------
def trainer_kv_amax(model_path: str, state: dict[str, torch.Tensor], prompts: list[list[int]]) -> torch.Tensor:
    """[layers, (k, v)]: the largest |K| and |V| a transformers forward (fp32, the trainer's side) of `state` computes
    on `prompts`, one prompt at a time, K taken after the rotary embedding as vLLM caches it (Qwen2: no k-norm)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.load_state_dict({name: tensor.float() for name, tensor in state.items()}, strict=False)
    layers = model.model.layers
    outputs = {}
    hooks = [getattr(layer.self_attn, f"{part}_proj").register_forward_hook(
        lambda _m, _args, out, key=(i, part): outputs.__setitem__(key, out))
        for i, layer in enumerate(layers) for part in "kv"]
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    amax = torch.zeros(len(layers), 2)
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            model(ids)
            positions = torch.arange(len(prompt))[None]
            for i in range(len(layers)):
                k = outputs[i, "k"].view(1, len(prompt), -1, head_dim).transpose(1, 2)
                cos, sin = model.model.rotary_emb(k, positions)
                k, _ = apply_rotary_pos_emb(k, k, cos, sin)
                amax[i] = torch.maximum(amax[i], torch.stack([k.abs().max(), outputs[i, "v"].abs().max()]))
    for hook in hooks:
        hook.remove()
    return amax


@pytest.fixture(scope="module")
def calibrated_sampler(small_model_path, prompts):
    sampler = build_sampler("vllm", small_model_path, BF16, sampling(max_new_tokens=8), seed=0,
                            kv_cache_dtype="fp8_e4m3", kv_scales="calibrated", calibration_prompts=prompts[:4])
    yield sampler
    sampler.close()


def engine_scales(sampler) -> torch.Tensor:
    """The [layers, (k, v)] scales the engine's attention layers hold now, read back from vLLM."""
    return torch.tensor(kv_cache_scales(engine_model(sampler.llm)))


@needs_fp8_kv
def test_calibrated_scales_reach_the_engine_at_start_and_after_every_sync(calibrated_sampler, small_model_path,
                                                                          prompts):
    checkpoint = dict(checkpoint_tensors(small_model_path))
    start = engine_scales(calibrated_sampler)
    # The engine's own K and V (bf16) give the scales the trainer's fp32 forward of the same weights gives.
    trainer = fp8_kv_scales(trainer_kv_amax(small_model_path, checkpoint, prompts[:4]), "fp8_e4m3")
    assert torch.allclose(start, trainer, rtol=0.03, atol=0), (start, trainer)
    assert (start < 0.5).all()  # far from vLLM's default 1.0
    record = calibrated_sampler.actual_precision["quantization"]["kv_scales"]
    assert record == {"scales": "calibrated", "layers": 2, "calibration_prompts": 4,
                      "k": [start[:, 0].min().item(), start[:, 0].max().item()],
                      "v": [start[:, 1].min().item(), start[:, 1].max().item()]}
    # A sync whose first layer computes K at half and V at twice the size: its scales follow exactly (powers of
    # two), and every layer's match the trainer's forward of the synced weights.
    state = {name: tensor.to(torch.bfloat16) for name, tensor in checkpoint.items()}
    for part, factor in (("k", 0.5), ("v", 2.0)):
        for leaf in ("weight", "bias"):
            name = f"model.layers.0.self_attn.{part}_proj.{leaf}"
            state[name] = state[name] * factor
    calibrated_sampler.load_weights(state)
    synced = engine_scales(calibrated_sampler)
    assert torch.allclose(synced[0], start[0] * torch.tensor([0.5, 2.0]), rtol=1e-6, atol=0), (synced, start)
    trainer = fp8_kv_scales(trainer_kv_amax(small_model_path, state, prompts[:4]), "fp8_e4m3")
    assert torch.allclose(synced, trainer, rtol=0.03, atol=0), (synced, trainer)
    rollouts = calibrated_sampler.generate(prompts, greedy=True)
    assert all(torch.isfinite(lp).all() for lp in rollouts.sampler_logprobs)
    calibrated_sampler.load_weights(checkpoint)  # and back: the start's scales again
    assert torch.allclose(engine_scales(calibrated_sampler), start, rtol=1e-6, atol=0)


# -- refusals ----------------------------------------------------------------------------------------------------------
def test_bad_kv_scales_are_one_line_errors():
    with pytest.raises(ValueError, match=r"^sampler.kv_scales: unknown value 'amax' \(allowed: unit, calibrated\)$"):
        check_kv_scales("amax", "fp8_e4m3", 16)
    with pytest.raises(ValueError, match=r"^sampler.kv_scales=calibrated: scales of an FP8 KV cache, and "
                                         r"sampler.kv_cache_dtype=auto keeps K and V unscaled \(allowed: unit; "
                                         r"calibrated with sampler.kv_cache_dtype=fp8_e4m3 or fp8_e5m2\)$"):
        check_kv_scales("calibrated", "auto", 16)
    with pytest.raises(ValueError, match=r"^sampler.kv_calibration_prompts: a count of prompts >= 1, got 0$"):
        check_kv_scales("calibrated", "fp8_e4m3", 0)
    check_kv_scales("unit", "auto", 16)
    check_kv_scales("calibrated", "fp8_e5m2", 1)


def test_calibrated_scales_without_an_fp8_cache_stop_the_command_before_any_engine():
    from tests.test_cli import assert_one_line, run_cli

    result = run_cli("probe", "sampler.kv_scales=calibrated")
    assert_one_line(result.returncode, result.stderr, "rlmm: error: sampler.kv_scales=calibrated: scales of an FP8 KV "
                                                      "cache, and sampler.kv_cache_dtype=auto keeps K and V unscaled")
