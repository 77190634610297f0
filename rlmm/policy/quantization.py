"""Quantization modes (`quantization=`, conf/quantization/): what the sampler serves is quantize(W_trainer).

Each mode is one class chosen by `_target_`, and it owns all of its behaviour: its tensor quantizer and the name
vLLM's loader reads its scale under, the `quantization_config` vLLM's engine is built with, what the emulation in
transformers' forward does to a linear layer's input, what rlmm or vLLM's kernels refuse of it, and its words in
the run's precision report. A new mode is one class here and one YAML in conf/quantization/. The samplers hold the
plumbing (rlmm/samplers/quantize.py: streaming the quantized tensors to vLLM's loader, the hf emulation's hooks);
the trainer takes the same object (`trainer.fake_quantize: true`, rlmm/trainers/fake_quantization.py: its forward
multiplies with `fake_quantize_weight(W)` and rounds inputs with `round_input`, straight-through gradients).

What is quantized: the weight of every `nn.Linear` of the Hugging Face model but the LM head (the decoder layers'
q/k/v/o and MLP projections); the input embedding, the norms and the LM head stay in the sampler's dtype, as
llm-compressor's W8A8 recipes (`ignore=["lm_head"]`) and FlashRL's and verl's FP8 rollouts (vLLM's `Fp8Config`
quantizes linear layers only; `ParallelLMHead` is an embedding) leave them. Online: the sampler quantizes every
weight it is given, at start and at every weight sync, with fresh scales from those weights, as FlashRL and verl's
FP8 rollouts do (the trainer sends BF16/FP32 weights and the rollout side quantizes them).

Modes (formulas; Q is what the engine multiplies with, s its scale, x a row of activations):

    none   the sampler's dtype (`precision=`), nothing quantized.
    int8   W8A8, compressed-tensors `int-quantized` (llm-compressor's W8A8 scheme):
           weights per output channel, static:  s_n = max_k |W_nk| / 127,  Q_nk = clamp(round(W_nk / s_n), -127, 127)
           activations per token, dynamic:       s_t = max_k |x_tk| / 127, computed by the kernel on every call
    fp8    W8A16 on vLLM-CPU (its only FP8 GEMM, `CPUFp8BlockScaledMMKernel`; W8A8 with per-token-group activations
           on CUDA), DeepSeek-V3's 128 x 128 blocks (vLLM `quant_method: fp8`, `weight_block_size`):
           s_b = max_{(n,k) in b} |W_nk| / 448,  Q_nk = fp8_e4m3(W_nk / s_b)   (448: E4M3's largest finite value)

round() is round-half-to-even (torch.round), as the engines' own quantizers. The division by 127 (not 127.5)
maps each channel's largest weight to +-127 exactly, as vLLM's own dynamic int8 quantization does.

Source (`quantization.source`, a key of every quantizing mode): which tensor W is, of the weight the trainer sends
at a sync (rlmm/trainers/weight_sync.py; the torch and DeepSpeed trainers send the 16-bit module weights they compute
with, FSDP its fp32 masters):

    sent   W as sent.
    bf16   W rounded to bf16 first (xtuner #2044: an FSDP trainer quantizing its fp32 masters while the rollout side
           quantized their bf16 export had a step-2 k3 KL of 8.7e-3; both sides quantizing the bf16 rounding, 3.7e-4).
           The same as `sent` for weights sent in bf16.

What the emulation and a fake-quantizing trainer multiply with is fake_quantize_weight(W) =
dequantize(quantize(W)).to(W's dtype).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import torch

from rlmm.runtime import cpu

INT8_MAX = 127
FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP8_BLOCK = 128  # vLLM-CPU's FP8 kernel: K blocks of exactly 128, N blocks a multiple of 32 (we use 128 x 128)
SCALE_FLOOR = torch.finfo(torch.float32).tiny  # an all-zero row keeps a positive scale (its values stay 0)
FP8_WEIGHTS_NEED_AMX = "vLLM-CPU's only FP8 weight kernel needs AMX (Sapphire Rapids or newer); this CPU has none"
FP8_RUNS_INSTEAD = "(runs here: none, int8; fp8 weights run on CUDA)"


class QuantizationMode(Protocol):
    """What every mode provides (the samplers and the trainers read nothing else of it)."""

    name: str  # its option in conf/quantization/, as refusals name it (`quantization=<name>`)
    quantizes_weights: bool  # False: the weights pass untouched and the engine is built as for the checkpoint
    rounds_inputs: bool  # the kernel also quantizes each linear layer's input (`round_input`)
    scale_name: str  # the scale's tensor name beside `<module>.weight` in a checkpoint of this mode (vLLM's loaders)
    source: str  # `quantization.source`, as refusals name it: sent or bf16 (SOURCES)
    source_dtype: torch.dtype | None  # the dtype a weight is rounded to before it is quantized (None: as sent)

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(Q, s) of one [N, K] weight (of its `source`): what the engine multiplies with and its scale."""
        ...

    def dequantize(self, quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Q * s in float32, the weight the engine's arithmetic stands for."""
        ...

    def fake_quantize_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """dequantize(quantize(W)) in W's dtype: what `sampler=hf`'s emulation holds and a fake-quantizing trainer
        multiplies with (W itself where nothing is quantized)."""
        ...

    def round_input(self, x: torch.Tensor) -> torch.Tensor:
        """A linear layer's input as the kernel quantizes it, dequantized to x's dtype (x itself if it does not)."""
        ...

    def engine_config(self) -> dict:
        """The `quantization_config` a checkpoint of this mode would carry (vLLM's `hf_overrides`)."""
        ...

    def refusal(self, model_path: str, moe: bool) -> str | None:
        """Why rlmm cannot quantize this model in this mode on any engine (None: it can)."""
        ...

    def cpu_kernel_refusal(self, model_path: str) -> str | None:
        """Why vLLM-CPU's kernels cannot run this model in this mode on this CPU (None: they can)."""
        ...

    def cpu_machine_refusal(self) -> str | None:
        """Why vLLM-CPU's kernels cannot run this mode on this CPU whatever the model (None: they can)."""
        ...

    def describe(self) -> str:
        """The scheme in words, for the run's precision report."""
        ...


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
    """Q * s in float32: per channel (s [N, 1]) or per `block` x `block` block (s [ceil(N/b), ceil(K/b)]; for
    K <= b that is [ceil(N/b), 1], which only the row count tells from a per-channel scale)."""
    rows, cols = quantized.shape
    if scale.shape == (rows, 1):
        return quantized.float() * scale
    expanded = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return quantized.float() * expanded


def fake_quantized(mode: QuantizationMode, weight: torch.Tensor) -> torch.Tensor:
    """dequantize(quantize(W)).to(W.dtype): every quantizing mode's `fake_quantize_weight`."""
    return mode.dequantize(*mode.quantize(weight)).to(weight.dtype)


# -- which tensors -----------------------------------------------------------------------------------------------
def quantized_modules(model_path: str) -> set[str]:
    """The Hugging Face module names whose weight is quantized: every `nn.Linear` but the LM head, read from the
    model built on the meta device (no memory, no weights read). Both sides ask here: the samplers' quantizer and
    emulation (rlmm/samplers/quantize.py) and the trainer's fake quantization (rlmm/trainers/fake_quantization.py)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name.split(".")[-1] != "lm_head"}


# -- the source: which tensor is quantized -------------------------------------------------------------------------
SOURCES: dict[str, torch.dtype | None] = {"sent": None, "bf16": torch.bfloat16}  # `quantization.source`


def source_dtype(source: str) -> torch.dtype | None:
    """`quantization.source`'s dtype (None: the weight as sent), or a one-line error naming the allowed ones."""
    if source not in SOURCES:
        raise ValueError(f"quantization.source: unknown source '{source}' (allowed: {', '.join(SOURCES)})")
    return SOURCES[source]


def of_source(weight: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The tensor a mode quantizes: `weight`, rounded to `dtype` first when a source dtype is set."""
    return weight if dtype is None else weight.detach().to(dtype)


# -- what every quantizing mode refuses ----------------------------------------------------------------------------
def moe_refusal(name: str, moe: bool) -> str | None:
    """rlmm quantizes a dense model's linear layers; an MoE's experts are fused tensors it does not quantize yet."""
    if moe:
        return (f"quantization={name}: rlmm quantizes a dense model's linear layers; this model is a mixture of "
                "experts, whose experts it does not quantize yet (runs: none)")
    return None


def text_config(model_path: str) -> dict:
    """config.json's text model settings (a multimodal checkpoint's `text_config`)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    return config.get("text_config", config)


# -- the modes ---------------------------------------------------------------------------------------------------
class NoQuantization:
    """`quantization=none`: the sampler serves the weights it is given, in its dtype."""

    name = "none"
    quantizes_weights = False
    rounds_inputs = False
    scale_name = ""
    source, source_dtype = "sent", None  # nothing is quantized: the weights serve as sent (its YAML has no `source`)

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise TypeError("quantization=none quantizes nothing")  # never asked: `quantizes_weights` is False

    def dequantize(self, quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        raise TypeError("quantization=none quantizes nothing")

    def fake_quantize_weight(self, weight: torch.Tensor) -> torch.Tensor:
        return weight

    def round_input(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def engine_config(self) -> dict:
        raise TypeError("quantization=none: the engine is built as for the checkpoint")

    def refusal(self, model_path: str, moe: bool) -> str | None:
        return None

    def cpu_kernel_refusal(self, model_path: str) -> str | None:
        return None

    def cpu_machine_refusal(self) -> str | None:
        return None

    def describe(self) -> str:
        return "none"


class Int8W8A8:
    """`quantization=int8`: int8 weights per output channel (static, amax/127) and int8 activations per token
    (dynamic, computed by the kernel), compressed-tensors' `int-quantized` W8A8 (llm-compressor's scheme). vLLM-CPU
    runs it on every x86 CPU: `CPUInt8ScaledMMLinearKernel`, the sgl AMX kernel or oneDNN."""

    name = "int8"
    quantizes_weights = True
    rounds_inputs = True
    scale_name = "weight_scale"  # compressed-tensors' name for a per-channel scale

    def __init__(self, source: str):
        """source: the tensor quantized, of the weight the trainer sends: sent (as sent) or bf16 (its bf16 rounding)."""
        self.source, self.source_dtype = source, source_dtype(source)

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return int8_per_channel(of_source(weight, self.source_dtype))

    def dequantize(self, quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return dequantize(quantized, scale)

    def fake_quantize_weight(self, weight: torch.Tensor) -> torch.Tensor:
        return fake_quantized(self, weight)

    def round_input(self, x: torch.Tensor) -> torch.Tensor:
        return int8_per_token(x)

    def engine_config(self) -> dict:
        return {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                                "dynamic": False},
                    "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                          "dynamic": True}}}}

    def refusal(self, model_path: str, moe: bool) -> str | None:
        return moe_refusal(self.name, moe)

    def cpu_kernel_refusal(self, model_path: str) -> str | None:
        return None

    def cpu_machine_refusal(self) -> str | None:
        return None

    def describe(self) -> str:
        return (f"int8 W8A8: weights per output channel (static, amax/127), activations per token (dynamic); "
                f"source {self.source}")


class Fp8Blockwise:
    """`quantization=fp8`: e4m3 weights in 128 x 128 blocks (amax/448; vLLM `quant_method: fp8`,
    `weight_block_size`); activations in the sampler's dtype on vLLM-CPU (W8A16), per-token-group FP8 on CUDA.
    vLLM-CPU 0.32 runs FP8 weights only through its AMX block-scaled kernel (model_executor/kernels/linear/
    scaled_mm/cpu.py `CPUFp8BlockScaledMMKernel`), for layers whose every output width (each of q/k/v and gate/up:
    a fused layer's blocks are counted per part) is a whole number of 128-row blocks, and not with a bias (its
    kernel wants an fp32 bias and fails on the model's bf16 one: "expected scalar type Float", seen with Qwen2)."""

    name = "fp8"
    quantizes_weights = True
    rounds_inputs = False  # the emulation keeps vLLM-CPU's W8A16: activations untouched
    scale_name = "weight_scale_inv"  # block-scaled checkpoints' name for the dequantization multiplier

    def __init__(self, source: str):
        """source: the tensor quantized, of the weight the trainer sends: sent (as sent) or bf16 (its bf16 rounding)."""
        self.source, self.source_dtype = source, source_dtype(source)

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fp8_blockwise(of_source(weight, self.source_dtype))

    def dequantize(self, quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return dequantize(quantized, scale)

    def fake_quantize_weight(self, weight: torch.Tensor) -> torch.Tensor:
        return fake_quantized(self, weight)

    def round_input(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def engine_config(self) -> dict:
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}

    def refusal(self, model_path: str, moe: bool) -> str | None:
        return moe_refusal(self.name, moe)

    def cpu_kernel_refusal(self, model_path: str) -> str | None:
        machine = self.cpu_machine_refusal()
        if machine:
            return machine
        why = self.shape_refusal(model_path)
        return f"quantization=fp8: {why} {FP8_RUNS_INSTEAD}" if why else None

    def cpu_machine_refusal(self) -> str | None:
        if not cpu.features().amx:
            return f"quantization=fp8: {FP8_WEIGHTS_NEED_AMX} {FP8_RUNS_INSTEAD}"
        return None

    @staticmethod
    def shape_refusal(model_path: str) -> str | None:
        """Why vLLM-CPU's AMX kernel cannot run this model's shapes (None: it can), read from config.json."""
        config = text_config(model_path)
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        widths = {"hidden_size": config["hidden_size"], "intermediate_size": config.get("intermediate_size", 0),
                  "the q width": heads * head_dim, "the k/v width": kv_heads * head_dim}
        odd = [f"{name} {width}" for name, width in widths.items() if width % FP8_BLOCK]
        if odd:
            return (f"vLLM-CPU's FP8 kernel needs layer widths in whole {FP8_BLOCK}-blocks; this model has "
                    f"{', '.join(odd)}")
        if config.get("attention_bias", config.get("model_type") == "qwen2"):  # Qwen2's q/k/v always have one
            return "vLLM-CPU 0.32's FP8 kernel fails on a linear layer with a bias, and this model's q/k/v have one"
        return None

    def describe(self) -> str:
        return f"fp8 e4m3 weights in {FP8_BLOCK}x{FP8_BLOCK} blocks (amax/448); source {self.source}"
