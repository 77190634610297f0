"""Quantized rollouts, the samplers' side: the mode's quantized tensors streamed to vLLM's loader
(`WeightQuantizer`), the same mode emulated in transformers' forward for `sampler=hf` (`Emulation`), vLLM's KV
cache dtype (`sampler.kv_cache_dtype`), and what vLLM refuses of either on this machine.

The modes themselves (`quantization=`: their quantizers, formulas, scale names, engine arguments, refusals and
descriptions) are rlmm/policy/quantization.py's classes, chosen by `_target_` in conf/quantization/; the app builds
one and hands it to the sampler.

KV cache (`sampler.kv_cache_dtype`, `sampler=vllm` only): auto (the sampler's dtype), fp8_e4m3 or fp8_e5m2, vLLM's
own `kv_cache_dtype` argument passed through; vLLM stores K and V divided by a per-layer scale. vLLM 0.32 has no
online calibration of those scales (its `calculate_kv_scales` is gone), so without scales in the checkpoint they are
1.0: K and V are rounded to FP8 as they are (`sampler.kv_scales=unit`). `sampler.kv_scales=calibrated` sets them from
the K and V of a fixed calibration batch at start and at every sync, as NeMo-RL does (rlmm/policy/kv_scales.py). The
run's precision report records the scales.

`sampler=hf` emulates the same modes in transformers' forward (`Emulation`): the quantized weights dequantized
(Q * s, in the sampler's dtype) and, for a mode whose kernel quantizes activations (int8), each linear layer's input
rounded through it per token. The probe's hf-emulated sampler vs the trainer is then the quantization alone; vLLM
vs the trainer, the quantization and vLLM's kernels.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from rlmm.policy.kv_scales import check_kv_scales
from rlmm.policy.quantization import QuantizationMode, text_config
from rlmm.runtime import cpu

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")


def check_kv_cache_dtype(kv_cache: str) -> None:
    """One line for a KV cache dtype vLLM has no name for (its names: KV_CACHE_DTYPES)."""
    if kv_cache not in KV_CACHE_DTYPES:
        raise ValueError(f"sampler.kv_cache_dtype: unknown dtype {kv_cache!r} (allowed: {', '.join(KV_CACHE_DTYPES)})")


# -- which tensors: rlmm/policy/quantization.py's `quantized_modules`, shared with the trainer's fake quantization --
class WeightQuantizer:
    """Quantizes (name, tensor) pairs as they stream to an engine's loader: a targeted module's `.weight`
    becomes the mode's quantized weight and its scale (`<module>.<mode.scale_name>`, the names vLLM's loaders
    read); every other tensor passes untouched. A mode that quantizes no weights (`none`): the identity."""

    def __init__(self, mode: QuantizationMode, modules: set[str]):
        self.mode, self.modules = mode, modules

    def __call__(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        if not self.mode.quantizes_weights:
            yield from named_tensors
            return
        for name, tensor in named_tensors:
            module, _, leaf = name.rpartition(".")
            if leaf == "weight" and module in self.modules:
                quantized, scale = self.mode.quantize(tensor)
                yield name, quantized
                yield f"{module}.{self.mode.scale_name}", scale
            else:
                yield name, tensor


# -- what vLLM refuses -------------------------------------------------------------------------------------------
def check_sampler_options(sampler, quantization: QuantizationMode, this_machine: bool) -> None:
    """The sampler's quantization, checked before any model is read or engine started: its KV cache dtype's value,
    and with `this_machine` what the chosen engine cannot run of the mode and the KV cache on this machine whatever
    the model (its `refused_here`: FP8 weights without AMX, an FP8 KV cache without AVX-512 or AMX, on vLLM-CPU).
    What depends on the model's shapes is refused when the sampler starts."""
    from hydra.utils import get_class

    kv_cache = sampler.get("kv_cache_dtype", "auto")  # a key of sampler=vllm only (hf has no KV cache to quantize)
    check_kv_cache_dtype(kv_cache)
    if "kv_scales" in sampler:  # sampler=vllm's too
        check_kv_scales(sampler.kv_scales, kv_cache, sampler.kv_calibration_prompts)
    if this_machine:
        problem = get_class(sampler._target_).refused_here(quantization, kv_cache)
        if problem:
            raise ValueError(problem)


def vllm_refusal(quantization: QuantizationMode, kv_cache: str, model_path: str, cuda: bool, moe: bool) -> str | None:
    """Why `sampler=vllm` cannot run this model with `quantization` and a KV cache of `kv_cache` here (None: it
    can), in one line naming the value and what runs instead; read from config.json before any engine starts."""
    return (quantization.refusal(model_path, moe) or (None if cuda else quantization.cpu_kernel_refusal(model_path))
            or kv_cache_refusal(kv_cache, model_path, cuda))


def kv_cache_refusal(kv_cache: str, model_path: str, cuda: bool) -> str | None:
    """Why vLLM cannot keep this model's KV cache in `kv_cache` here (None: it can): vLLM-CPU 0.32's attention
    (v1/attention/backends/cpu_attn.py `_get_attn_isa`) stores an FP8 cache only on x86 with AVX-512 or AMX,
    and only for a head size divisible by 32."""
    if kv_cache == "auto" or cuda:
        return None
    problem = machine_kv_cache_refusal(kv_cache)
    if problem:
        return problem
    config = text_config(model_path)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head_dim % 32:
        return (f"sampler.kv_cache_dtype={kv_cache}: vLLM-CPU's FP8 KV cache needs a head size divisible by 32, "
                f"this model's is {head_dim} (runs here: auto)")
    return None


def machine_kv_cache_refusal(kv_cache: str) -> str | None:
    """Why vLLM-CPU cannot keep a KV cache of `kv_cache` on this CPU whatever the model (None: it can)."""
    features = cpu.features()
    if kv_cache != "auto" and not (features.avx512 or features.amx):
        return (f"sampler.kv_cache_dtype={kv_cache}: vLLM-CPU keeps an FP8 KV cache only with AVX-512 or AMX, "
                "which this CPU lacks (runs here: auto)")
    return None


def machine_refusal(quantization: QuantizationMode, kv_cache: str) -> str | None:
    """What vLLM-CPU cannot run of `quantization` and a KV cache of `kv_cache` on this CPU whatever the model (None:
    all of it): the one answer to "does this CPU refuse it", asked by every check before a run or a sweep starts
    (`check_sampler_options`), by the engine when it starts (`vllm_refusal`) and by the tests. What depends on the
    model's shapes is refused when the sampler starts."""
    return quantization.cpu_machine_refusal() or machine_kv_cache_refusal(kv_cache)


# -- sampler=hf: the same quantization, emulated -----------------------------------------------------------------
class Emulation:
    """`mode` applied to a transformers model: each targeted linear layer's weight replaced by
    dequantize(quantize(W)) in W's dtype whenever weights are loaded (`fake_quantize`: the mode's `fake_quantize_weight`,
    what a fake-quantizing trainer multiplies with, rlmm/trainers/fake_quantization.py), and where the mode's kernel
    quantizes activations (`rounds_inputs`: int8) its input rounded as the kernel does (a forward pre-hook). `remove`
    takes the hooks out."""

    def __init__(self, model: torch.nn.Module, mode: QuantizationMode, modules: set[str]):
        self.mode, self.modules = mode, modules
        self.hooks = []
        if mode.rounds_inputs:
            for name, module in model.named_modules():
                if name in modules:
                    self.hooks.append(module.register_forward_pre_hook(
                        lambda _module, args: (mode.round_input(args[0]), *args[1:])))

    def fake_quantize(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        if not self.mode.quantizes_weights:
            yield from named_tensors
            return
        for name, tensor in named_tensors:
            module, _, leaf = name.rpartition(".")
            targeted = leaf == "weight" and module in self.modules
            yield name, self.mode.fake_quantize_weight(tensor) if targeted else tensor

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
