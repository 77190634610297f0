"""Quantized rollouts (`sampler.quantization`, `sampler.kv_cache_dtype`): the sampler serves quantize(W_trainer).

The trainer keeps its own precision; the sampler quantizes every weight it is given, at start and at every
weight sync, with fresh scales from those weights (online quantization, as FlashRL and verl's FP8 rollouts do:
the trainer sends BF16/FP32 weights and the rollout side quantizes them). What is quantized: the weight of
every `nn.Linear` of the Hugging Face model but the LM head (the decoder layers' q/k/v/o and MLP projections);
the input embedding, the norms and the LM head stay in the sampler's dtype, as llm-compressor's W8A8 recipes
(`ignore=["lm_head"]`) and FlashRL's and verl's FP8 rollouts (vLLM's `Fp8Config` quantizes linear layers
only; `ParallelLMHead` is an embedding) leave them.

Modes (formulas; Q is what the engine multiplies with, s its scale, x a row of activations):

    int8   W8A8, compressed-tensors `int-quantized` (llm-compressor's W8A8 scheme):
           weights per output channel, static:  s_n = max_k |W_nk| / 127,  Q_nk = clamp(round(W_nk / s_n), -127, 127)
           activations per token, dynamic:       s_t = max_k |x_tk| / 127, computed by the kernel on every call
    fp8    W8A16 on vLLM-CPU (its only FP8 GEMM, `CPUFp8BlockScaledMMKernel`; W8A8 with per-token-group activations
           on CUDA), DeepSeek-V3's 128 x 128 blocks (vLLM `quant_method: fp8`, `weight_block_size`):
           s_b = max_{(n,k) in b} |W_nk| / 448,  Q_nk = fp8_e4m3(W_nk / s_b)   (448: E4M3's largest finite value)

round() is round-half-to-even (torch.round), as the engines' own quantizers. The division by 127 (not 127.5)
maps each channel's largest weight to +-127 exactly, as vLLM's own dynamic int8 quantization does.

KV cache (`kv_cache_dtype`): auto (the sampler's dtype), fp8_e4m3 or fp8_e5m2; vLLM stores K and V divided by
a per-layer scale. vLLM 0.32 has no online calibration of those scales (its `calculate_kv_scales` is gone), so
without scales in the checkpoint they are 1.0: K and V are rounded to FP8 as they are. Nothing derived from
the weights is stored, so a sync needs no recalibration; the run's precision report records the scales.

`sampler=hf` emulates the same modes in transformers' forward (`emulate`): the quantized weights dequantized
(Q * s, in the sampler's dtype) and, for int8, each linear layer's input rounded through int8 per token. The
probe's hf-emulated sampler vs the trainer is then the quantization alone; vLLM vs the trainer, the
quantization and vLLM's kernels.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from rlmm.runtime import cpu

WEIGHT_MODES = ("none", "int8", "fp8")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
INT8_MAX = 127
FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP8_BLOCK = 128  # vLLM-CPU's FP8 kernel: K blocks of exactly 128, N blocks a multiple of 32 (we use 128 x 128)
SCALE_FLOOR = torch.finfo(torch.float32).tiny  # an all-zero row keeps a positive scale (its values stay 0)
FP8_WEIGHTS_NEED_AMX = "vLLM-CPU's only FP8 weight kernel needs AMX (Sapphire Rapids or newer); this CPU has none"
FP8_RUNS_INSTEAD = "(runs here: none, int8; fp8 weights run on CUDA)"


@dataclass(frozen=True)
class Quantization:
    """What the sampler quantizes: its weights (`none`, `int8`, `fp8`) and its KV cache (`auto`, `fp8_e4m3`,
    `fp8_e5m2`). Checked on construction: a bad value is one line naming it and the allowed ones."""

    weights: str = "none"
    kv_cache: str = "auto"

    def __post_init__(self):
        if self.weights not in WEIGHT_MODES:
            raise ValueError(f"sampler.quantization: unknown mode {self.weights!r} (allowed: {', '.join(WEIGHT_MODES)})")
        if self.kv_cache not in KV_CACHE_DTYPES:
            raise ValueError(f"sampler.kv_cache_dtype: unknown dtype {self.kv_cache!r} "
                             f"(allowed: {', '.join(KV_CACHE_DTYPES)})")

    @property
    def quantizes_weights(self) -> bool:
        return self.weights != "none"

    def describe(self) -> str:
        """The scheme in words, for the run's precision report."""
        return {"none": "none",
                "int8": "int8 W8A8: weights per output channel (static, amax/127), activations per token (dynamic)",
                "fp8": f"fp8 e4m3 weights in {FP8_BLOCK}x{FP8_BLOCK} blocks (amax/448)"}[self.weights]


# -- the quantizers: tensor in, tensors out ------------------------------------------------------------------
def int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q int8 [N, K], s float32 [N, 1]) with W ~ Q * s, one scale per output channel (see the module's formulas)."""
    weight = weight.detach().float()
    scale = (weight.abs().amax(dim=1, keepdim=True) / INT8_MAX).clamp(min=SCALE_FLOOR)
    return torch.round(weight / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def int8_per_token(x: torch.Tensor) -> torch.Tensor:
    """x rounded through int8 with one scale per row (token), dequantized to x's dtype: what the int8 kernel's
    dynamic activation quantization does to a linear layer's input."""
    scale = (x.detach().float().abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp(min=SCALE_FLOOR)
    return (torch.round(x.float() / scale).clamp(-INT8_MAX, INT8_MAX) * scale).to(x.dtype)


def fp8_blockwise(weight: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q float8_e4m3fn [N, K], s float32 [ceil(N/block), ceil(K/block)]) with W ~ Q * s blockwise; partial
    blocks at the edges take the amax of what they hold."""
    weight = weight.detach().float()
    rows, cols = weight.shape
    row_blocks, col_blocks = -(-rows // block), -(-cols // block)
    padded = torch.nn.functional.pad(weight, (0, col_blocks * block - cols, 0, row_blocks * block - rows))
    blocks = padded.view(row_blocks, block, col_blocks, block)
    scale = (blocks.abs().amax(dim=(1, 3), keepdim=True) / FP8_E4M3_MAX).clamp(min=SCALE_FLOOR)
    quantized = (blocks / scale).to(torch.float8_e4m3fn).view(row_blocks * block, col_blocks * block)
    return quantized[:rows, :cols].contiguous(), scale.view(row_blocks, col_blocks)


def dequantize(quantized: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """Q * s in float32: per channel (s [N, 1]) or per `block` x `block` block (s [ceil(N/b), ceil(K/b)])."""
    rows, cols = quantized.shape
    if scale.shape[1] == 1:
        return quantized.float() * scale
    expanded = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return quantized.float() * expanded


QUANTIZERS = {"int8": (int8_per_channel, "weight_scale"), "fp8": (fp8_blockwise, "weight_scale_inv")}


# -- which tensors -----------------------------------------------------------------------------------------------
def quantized_modules(model_path: str) -> set[str]:
    """The Hugging Face module names whose weight is quantized: every `nn.Linear` but the LM head, read from the
    model built on the meta device (no memory, no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name.split(".")[-1] != "lm_head"}


class WeightQuantizer:
    """Quantizes (name, tensor) pairs as they stream to an engine's loader: a targeted module's `.weight`
    becomes the quantized weight and its scale (`<module>.weight_scale`, or `.weight_scale_inv` for fp8,
    the names vLLM's loaders read); every other tensor passes untouched. `mode` none: the identity."""

    def __init__(self, mode: str, modules: set[str]):
        self.mode, self.modules = mode, modules

    def __call__(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        if self.mode == "none":
            yield from named_tensors
            return
        quantize, scale_name = QUANTIZERS[self.mode]
        for name, tensor in named_tensors:
            module, _, leaf = name.rpartition(".")
            if leaf == "weight" and module in self.modules:
                quantized, scale = quantize(tensor)
                yield name, quantized
                yield f"{module}.{scale_name}", scale
            else:
                yield name, tensor


# -- what the engines are told -----------------------------------------------------------------------------------
def engine_quantization_config(mode: str) -> dict:
    """The `quantization_config` a checkpoint of `mode` would carry, for vLLM's `hf_overrides`: the engine is
    built for quantized weights and given them by the sampler (never read from disk)."""
    if mode == "int8":
        return {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                                "dynamic": False},
                    "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                          "dynamic": True}}}}
    if mode == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    raise ValueError(f"sampler.quantization: no engine configuration for {mode!r}")


def check_sampler_options(sampler, this_machine: bool) -> None:
    """The quantization keys of a sampler's config node, checked before any model is read or engine started: the
    values (`Quantization`), and with `this_machine` what the chosen engine cannot run on this machine whatever the
    model (its `refused_here`: FP8 weights without AMX, an FP8 KV cache without AVX-512 or AMX, on vLLM-CPU). What
    depends on the model's shapes is refused when the sampler starts."""
    from hydra.utils import get_class

    if "quantization" not in sampler and "kv_cache_dtype" not in sampler:
        return
    quantization = Quantization(sampler.get("quantization", "none"), sampler.get("kv_cache_dtype", "auto"))
    if this_machine:
        problem = get_class(sampler._target_).refused_here(quantization)
        if problem:
            raise ValueError(problem)


def weights_refusal(mode: str, model_path: str, cuda: bool, moe: bool) -> str | None:
    """Why `sampler=vllm` cannot quantize this model's weights with `mode` here (None: it can), in one line naming
    the value and what runs instead; read from config.json before any engine starts."""
    if mode == "none":
        return None
    if moe:
        return (f"sampler.quantization={mode}: rlmm quantizes a dense model's linear layers; this model is a "
                "mixture of experts, whose experts it does not quantize yet (runs: none)")
    if mode == "fp8":
        why = fp8_refusal(model_path, cuda)
        if why:
            return f"sampler.quantization=fp8: {why} {FP8_RUNS_INSTEAD}"
    return None


def fp8_refusal(model_path: str, cuda: bool) -> str | None:
    """Why vLLM cannot run fp8 weights of this model on this machine (None: it can). vLLM-CPU 0.32 runs FP8
    weights only through its AMX block-scaled kernel (model_executor/kernels/linear/scaled_mm/cpu.py
    `CPUFp8BlockScaledMMKernel`: `machine_refusal`), for layers whose every output width (each of q/k/v and
    gate/up: a fused layer's blocks are counted per part) is a whole number of 128-row blocks, and not with a bias
    (its kernel wants an fp32 bias and fails on the model's bf16 one: "expected scalar type Float", seen with
    Qwen2)."""
    if cuda:
        return None
    if not cpu.features().amx:
        return FP8_WEIGHTS_NEED_AMX
    config = text_config(model_path)
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    widths = {"hidden_size": config["hidden_size"], "intermediate_size": config.get("intermediate_size", 0),
              "the q width": heads * head_dim, "the k/v width": kv_heads * head_dim}
    odd = [f"{name} {width}" for name, width in widths.items() if width % FP8_BLOCK]
    if odd:
        return f"vLLM-CPU's FP8 kernel needs layer widths in whole {FP8_BLOCK}-blocks; this model has {', '.join(odd)}"
    if config.get("attention_bias", config.get("model_type") == "qwen2"):  # Qwen2's q/k/v always have one
        return "vLLM-CPU 0.32's FP8 kernel fails on a linear layer with a bias, and this model's q/k/v have one"
    return None


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


def machine_refusal(quantization: Quantization) -> str | None:
    """What vLLM-CPU cannot run of `quantization` on this CPU whatever the model (None: all of it): the one answer
    to "does this CPU refuse it", asked by every check before a run or a sweep starts (`check_sampler_options`),
    by the engine when it starts (`weights_refusal`, `kv_cache_refusal`) and by the tests. What depends on the
    model's shapes is refused when the sampler starts."""
    if quantization.weights == "fp8" and not cpu.features().amx:
        return f"sampler.quantization=fp8: {FP8_WEIGHTS_NEED_AMX} {FP8_RUNS_INSTEAD}"
    return machine_kv_cache_refusal(quantization.kv_cache)


def text_config(model_path: str) -> dict:
    """config.json's text model settings (a multimodal checkpoint's `text_config`)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    return config.get("text_config", config)


# -- sampler=hf: the same quantization, emulated -----------------------------------------------------------------
class Emulation:
    """The quantization of `mode` applied to a transformers model: each targeted linear layer's weight replaced
    by dequantize(quantize(W)) whenever weights are loaded (`fake_quantize`), and for int8 its input rounded
    through int8 per token (a forward pre-hook). `remove` takes the hooks out."""

    def __init__(self, model: torch.nn.Module, mode: str, modules: set[str]):
        self.mode, self.modules = mode, modules
        self.hooks = []
        if mode == "int8":
            for name, module in model.named_modules():
                if name in modules:
                    self.hooks.append(module.register_forward_pre_hook(
                        lambda _module, args: (int8_per_token(args[0]), *args[1:])))

    def fake_quantize(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        if self.mode == "none":
            yield from named_tensors
            return
        quantize, _ = QUANTIZERS[self.mode]
        for name, tensor in named_tensors:
            module, _, leaf = name.rpartition(".")
            yield name, dequantize(*quantize(tensor)).to(tensor.dtype) if leaf == "weight" and module in self.modules \
                else tensor

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
