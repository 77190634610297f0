"""Quantization both sides share (`trainer.fake_quantize: true`): the trainer's forward multiplies with the weights the
sampler serves, so a quantized rollout's quantization is no longer train-inference mismatch.

Quantization-aware RL (NeMo-RL, docs/guides/quantization-aware-rl.md; Miles: one quantization path for both sides).
Each targeted layer (`quantized_modules`: every `nn.Linear` but the LM head, the sampler's own set) computes, with the
run's `quantization=` mode (rlmm/policy/quantization.py; its `quantization.source` included),

    y = F.linear(round_input(x), fq(W), b),    fq(W) = dequantize(quantize(W)).to(W.dtype)

which is what `sampler=hf`'s emulation computes (rlmm/samplers/quantize.py `Emulation`: fq(W) held as the layer's
weight, round_input a forward pre-hook; round_input is the identity for a mode whose kernel keeps activations, fp8).
The gradient is the straight-through estimator (Bengio et al. 2013; NeMo-RL's and Miles' QAT):
dL/dW = dL/dfq(W) and dL/dx = dL/dround_input(x), the value of W + (fq(W) - W).detach(). It is written as an
autograd function whose forward returns fq(W) itself: the sum W + (fq(W) - W) rounds in W's dtype and need not be
fq(W) to the bit.

Bitwise with the sampler: the sampler quantizes what the trainer sends at a sync (`state_dict()`,
rlmm/trainers/weight_sync.py) and holds fq(W_sent) in its dtype; the trainer quantizes the weight its forward sees.
`trainer=torch` and `trainer=deepspeed` send the module weights they compute with (16-bit ones in 16 bits, their fp32
masters stay in the optimizer), so the two are one tensor. `trainer=fsdp` sends its fp32 masters and computes with
their cast to its dtype: the same tensor only for an fp32 trainer, or when `quantization.source=bf16` rounds both to
the bf16 the forward holds; otherwise it refuses (`FSDPTrainer.fake_quantize_refusal`, asked before any engine
starts). With both sides in one dtype the sampler then holds exactly the weights the trainer multiplies with
(tests/test_fake_quantization.py).

Installed by replacing each targeted module's `forward` on the instance: DeepSpeed (ZeRO-0 to 3) and FSDP2 gather a
module's parameters in hooks around `forward`, so the replaced one reads the full weight; the state dict's names do
not change. A value model (PPO's critic) is not fake-quantized: it only scores values, the sampler never runs it.
Cost: fq(W) is recomputed at every forward (one quantize and dequantize a weight; nothing is cached across the
optimizer's steps).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from rlmm.config.options import from_yaml, group_options
from rlmm.policy.precision import SidePrecision
from rlmm.policy.quantization import QuantizationMode, quantized_modules


class StraightThrough(torch.autograd.Function):
    """y = f(x) forward; dL/dx = dL/dy backward (as if f were the identity)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, f) -> torch.Tensor:
        return f(x.detach())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def fake_quantized_linear(module: torch.nn.Linear, mode: QuantizationMode, x: torch.Tensor) -> torch.Tensor:
    """F.linear(round_input(x), fq(W), b) with straight-through gradients to x and W."""
    if mode.rounds_inputs:
        x = StraightThrough.apply(x, mode.round_input)
    return F.linear(x, StraightThrough.apply(module.weight, mode.fake_quantize_weight), module.bias)


class FakeQuantization:
    """`mode` installed in `model`'s forward: each module named in `modules` computes `fake_quantized_linear`.
    A mode that quantizes nothing installs nothing. `remove` gives the modules their own forward back."""

    def __init__(self, model: torch.nn.Module, mode: QuantizationMode, modules: set[str]):
        self.mode = mode
        self.modules = [module for name, module in model.named_modules() if name in modules] \
            if mode.quantizes_weights else []
        for module in self.modules:
            module.forward = functools.partial(fake_quantized_linear, module, mode)

    @classmethod
    def of(cls, model: torch.nn.Module, model_path: str, mode: QuantizationMode, fake_quantize: bool, trainer: type,
           precision: SidePrecision) -> FakeQuantization:
        """What a trainer of class `trainer` computing in `precision` installs: with `fake_quantize`, its run's mode
        on the sampler's modules, or a one-line ValueError (`refusal`); without, nothing."""
        if not fake_quantize:
            return cls(model, mode, set())
        problem = refusal(mode, trainer, precision)
        if problem:
            raise ValueError(problem)
        return cls(model, mode, quantized_modules(model_path))

    @property
    def installed(self) -> bool:
        """Whether the forward is fake-quantized (then it is not what a fresh load of the checkpoint computes)."""
        return bool(self.modules)

    def report(self) -> dict:
        """The trainer's precision report's part: {} when nothing is installed."""
        if not self.installed:
            return {}
        return {"quantization": {"fake_quantize": f"{self.mode.describe()}; {len(self.modules)} linear layers fake-"
                                                  "quantized in the trainer's forward, straight-through gradients"}}

    def remove(self) -> None:
        for module in self.modules:
            del module.forward
        self.modules = []


def refusal(mode: QuantizationMode, trainer: type, precision: SidePrecision) -> str | None:
    """Why `trainer.fake_quantize=true` cannot run with `mode` on a trainer of class `trainer` computing in `precision`
    (None: it can): a mode that quantizes nothing, or what the trainer refuses (its `fake_quantize_refusal`)."""
    if not mode.quantizes_weights:
        shared = [option for option in group_options("quantization")
                  if from_yaml("quantization", option).quantizes_weights]
        return (f"trainer.fake_quantize=true: quantization={mode.name} quantizes nothing for the trainer to share "
                f"with the sampler (quantizing modes: {', '.join(shared)})")
    return trainer.fake_quantize_refusal(mode, precision)


def check_trainer_options(trainer: DictConfig, mode: QuantizationMode, precision: SidePrecision) -> None:
    """`trainer.fake_quantize` with the run's mode and the trainer side's precision, checked before any engine
    starts (rlmm/launch/overrides.py): a ValueError of one line when `refusal` refuses it."""
    from hydra.utils import get_class

    if trainer.fake_quantize:
        problem = refusal(mode, get_class(trainer._target_), precision)
        if problem:
            raise ValueError(problem)
