"""The probe's checks: of its `probe.*` options before any engine starts (`check_options`, which
rlmm/launch/overrides.py runs on every combination of a sweep), and of the log-probs it scored (`check_finite`)."""
from __future__ import annotations

import re

import torch
from omegaconf import DictConfig

from rlmm.policy.precision import nonfinite_cause
from rlmm.trainers.packing import MicroBatching


def check_finite(logprobs: dict[str, torch.Tensor], precision_report: dict, close=()) -> None:
    """Stop with one line instead of reporting NaN metrics when a side's log-probs are not finite
    (the known cause: fp16 activations that overflow, as Qwen2's do)."""
    bad = {side: 1 - torch.isfinite(lp).float().mean().item() for side, lp in logprobs.items()}
    if not any(bad.values()):
        return
    for engine in close:
        engine.close()
    dtypes = {side: precision_report["actual"][side]["dtype"] for side in bad}
    sides = ", ".join(f"{frac:.1%} of the {side}'s ({dtypes[side]})" for side, frac in bad.items() if frac)
    raise ValueError(f"probe: non-finite log-probs: {sides}{nonfinite_cause(dtypes.values())}")


def check_options(cfg: DictConfig) -> dict[str, MicroBatching]:
    """Every `probe.*` value that can be checked before an engine starts (rlmm/launch/overrides.py checks each
    combination of a sweep with it); returns the trainer layouts to score."""
    for key in ("num_prompts", "samples_per_prompt", "position_buckets"):  # named here, not as the task's examples
        if cfg.probe[key] < 1:
            raise ValueError(f"probe.{key}: must be >= 1, got {cfg.probe[key]}")
    check_micro_batch_sizes(cfg.probe.trainer_micro_batch_sizes)
    check_entropy_edges(cfg.probe.entropy_edges)
    check_early_vs_late(cfg.probe.early_vs_late, cfg.sampling.max_new_tokens)
    check_batch_invariance(cfg.probe.batch_invariance)
    if cfg.probe.attribution:
        from rlmm.mismatch.attribution import check_attribution

        check_attribution(cfg.precision.sampler_dtype, cfg.precision.trainer_dtype, cfg.trainer)
    if cfg.probe.layers:
        from rlmm.mismatch.layer_attribution import check_layers

        check_layers(cfg.precision.sampler_dtype, cfg.precision.trainer_dtype, cfg.trainer)
    return check_layouts(cfg.probe.trainer_layouts, cfg.trainer.micro_batch_size)


def check_micro_batch_sizes(sizes) -> tuple[int, int]:
    """`probe.trainer_micro_batch_sizes` as (small, large): two different sizes, each >= 1."""
    sizes = sorted(sizes)
    if len(sizes) != 2 or sizes[0] == sizes[1] or sizes[0] < 1:
        raise ValueError(f"probe.trainer_micro_batch_sizes: two different sizes >= 1, got {sizes}")
    return sizes[0], sizes[1]


def check_entropy_edges(edges) -> tuple[float, ...]:
    """`probe.entropy_edges`: the entropy buckets' inner edges (nats), increasing and > 0 (`entropy_profile`'s rule)."""
    edges = [float(e) for e in edges]
    if not edges or any(not e > 0 for e in edges) or edges != sorted(set(edges)):
        raise ValueError(f"probe.entropy_edges: increasing values > 0 (nats), got {edges}")
    return tuple(edges)


def check_batch_invariance(options) -> None:
    """`probe.batch_invariance`: at least two batch sizes, and a largest batch that holds every target prompt."""
    for key, least in (("num_prompts", 1), ("num_completions", 2), ("max_batch_size", 1)):
        if options[key] < least:
            raise ValueError(f"probe.batch_invariance.{key}={options[key]}: must be >= {least}")
    if options.max_batch_size < options.num_prompts:
        raise ValueError(f"probe.batch_invariance.max_batch_size={options.max_batch_size}: must be >= "
                         f"probe.batch_invariance.num_prompts={options.num_prompts} (the largest batch holds every prompt)")


def check_early_vs_late(options, max_new_tokens: int) -> None:
    """`probe.early_vs_late`: off (null), or windows that fit the responses the sampler can give."""
    n, window = options.response_tokens, options.window
    if n is None:
        return
    if not 1 <= window <= n // 2:
        raise ValueError(f"probe.early_vs_late.window={window}: must be between 1 and response_tokens/2 = {n // 2}")
    if n > max_new_tokens:
        raise ValueError(f"probe.early_vs_late.response_tokens={n}: responses are at most "
                         f"sampling.max_new_tokens={max_new_tokens} tokens long (null turns it off)")


def check_layouts(layouts, micro_batch_size: int) -> dict[str, MicroBatching]:
    """`probe.trainer_layouts` as MicroBatching settings, the padded reference (micro-batches of
    `trainer.micro_batch_size` rows) under "reference". A name is a metric name's part: letters, digits, _."""
    out = {"reference": MicroBatching(micro_batch_size, None, False)}
    for name, layout in layouts.items():
        if not re.fullmatch(r"[A-Za-z0-9_]+", name) or name == "reference":
            raise ValueError(f"probe.trainer_layouts: {name!r} is not a name of letters, digits and _ "
                             f"(other than 'reference')")
        try:
            out[name] = MicroBatching(micro_batch_size, layout.micro_batch_tokens, layout.padding_free)
        except ValueError as err:
            raise ValueError(f"probe.trainer_layouts.{name}: {err}") from None
    return out
