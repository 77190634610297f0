"""Mismatch injection (`sampler.perturb`): seeded Gaussian noise on every weight the sampler loads.

For each floating-point tensor W the sampler loads (at construction and at every weight sync),

    W_sampler = W + ε · rms(W) · Z,      rms(W) = sqrt(mean(W²)),   Z ~ N(0, I)

with ε = `sampler.perturb` (0: off, the weights pass through untouched). Z is drawn from a generator
seeded by (run seed, load index, tensor name), so a run is reproducible and each sync draws fresh
noise. The trainer keeps the exact weights, so the sampler's policy is a nearby but different one,
and the sampler-vs-trainer mismatch grows with ε: a dial for experiments that need a mismatch larger
than the engines' own (e.g. `experiments/tis_under_mismatch`), with fp32 on both sides when the
injected mismatch should be the only one.

What it simulates: a rollout engine whose weights are not the trainer's, such as quantized rollouts.
Rounding a weight to p significant bits leaves a relative error spread uniformly over ±2⁻ᵖ, of
standard deviation 2⁻ᵖ/√3 relative to each weight, so RMS-relative noise of

    ε ≈ 0.0023  matches bf16 weights (p = 8),    ε ≈ 0.036  matches FP8 E4M3 weights (p = 4).

It departs from real rounding in three ways, on purpose: the noise is Gaussian and independent of
the weight's own magnitude within a tensor (rounding error scales with |w|), it is redrawn at every
sync (rounding error is a fixed function of the weights), and activations are not touched (a 16-bit
engine also rounds every activation and accumulation). So it reproduces the size of a weight
mismatch, not its exact pattern. A resumed run draws from the load index it restarts at, not the
one the interrupted run had reached.
"""
from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch


def check_perturb(value: float) -> float:
    if not value >= 0:  # also rejects NaN
        raise ValueError(f"sampler.perturb: must be >= 0 (0: off), got {value}")
    return float(value)


class WeightNoise:
    """Applies W + ε · rms(W) · Z to (name, tensor) pairs as they stream to an engine's loader.

    Args:
        relative_std: ε (0: the identity).
        seed: the run's seed; with the load index and the tensor name it seeds each draw.
    """

    def __init__(self, relative_std: float, seed: int):
        self.relative_std = check_perturb(relative_std)
        self.seed = seed
        self.loads = 0  # one per call: construction, then each weight sync

    def __call__(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        if self.relative_std == 0:
            return iter(named_tensors)
        load = self.loads
        self.loads += 1
        return ((name, self.perturb(name, tensor, load)) for name, tensor in named_tensors)

    @torch.no_grad()
    def perturb(self, name: str, tensor: torch.Tensor, load: int) -> torch.Tensor:
        if not tensor.is_floating_point():
            return tensor
        generator = torch.Generator(device=tensor.device)
        generator.manual_seed(zlib.crc32(f"{self.seed}:{load}:{name}".encode()))
        weight = tensor.detach().float()
        rms = weight.pow(2).mean().sqrt()
        noise = torch.randn(weight.shape, generator=generator, device=weight.device, dtype=torch.float32)
        return (weight + self.relative_std * rms * noise).to(tensor.dtype)


def checkpoint_tensors(model_path: str, *, head_from_embedding: bool = False,
                       why: str = "sampler.perturb") -> Iterator[tuple[str, torch.Tensor]]:
    """The Hugging Face-named tensors of a local safetensors checkpoint, one file at a time (for an
    engine that loaded them itself and must now be given a perturbed copy, or that starts untied). With
    `head_from_embedding`, a checkpoint that stores no `lm_head.weight` (a tied one) yields a copy of
    its input embedding under that name, last."""
    from safetensors.torch import load_file

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{why}: '{model_path}' holds no *.safetensors files to load "
                         f"(other checkpoint formats are not read here)")
    embedding, head_seen = None, False
    for file in files:
        for name, tensor in load_file(file).items():
            head_seen |= name == "lm_head.weight"
            if name.endswith("embed_tokens.weight"):
                embedding = tensor
            yield name, tensor
    if head_from_embedding and not head_seen:
        if embedding is None:
            raise ValueError(f"{why}: '{model_path}' stores neither lm_head.weight nor an input embedding")
        yield "lm_head.weight", embedding.clone()
