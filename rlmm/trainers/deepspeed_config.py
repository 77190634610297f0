"""The DeepSpeed config `trainer=deepspeed` hands `deepspeed.initialize`: derived from the trainer's values
and the precision, then a user's JSON (`trainer.config_file`) merged over it.

Batch sizes are rlmm's, whatever the user's JSON says: `MicroBatching` (rlmm/trainers/packing.py) cuts
each minibatch into micro-batches and `DeepSpeedUpdate` marks the last one as the accumulation boundary
itself, so DeepSpeed's own count is never the one that decides (see `engine_config`).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from rlmm.policy.precision import SidePrecision, to_dtype

GRAD_ACCUM_DTYPES = (None, "fp32")
REDUCE_DTYPES = (None, "fp32", "bf16", "fp16")
# Keys rlmm owns: a user's JSON cannot change them (`train_batch_size` follows from them).
BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def engine_config(precision: SidePrecision, micro_batch_size: int, zero_stage: int, lr: float, weight_decay: float,
                  grad_clip: float, initial_loss_scale: float, loss_scale_growth_interval: int,
                  grad_accum_dtype: str | None, reduce_dtype: str | None) -> dict:
    """rlmm's DeepSpeed config, before a user's JSON.

    `gradient_accumulation_steps` is 1: the number of micro-batches per optimizer step is decided by
    `MicroBatching.split` per minibatch (a token budget makes it vary), and `DeepSpeedUpdate` sets the
    boundary (`set_gradient_accumulation_boundary`) and passes `scale_wrt_gas=False`, so DeepSpeed's count
    reaches only its bookkeeping (`train_batch_size`, `global_samples`) and the 1/count its output hooks
    apply to a backward that bypasses `engine.backward` (none here). `train_micro_batch_size_per_gpu`
    likewise only sizes that bookkeeping (a token budget cuts micro-batches of any row count)."""
    fp16 = fp16_config(precision, initial_loss_scale, loss_scale_growth_interval)
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": grad_clip,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": weight_decay, "torch_adam": True}},
        "bf16": {"enabled": precision.dtype == torch.bfloat16},
        "fp16": fp16,
        "zero_optimization": {"stage": zero_stage},
        "steps_per_print": 1 << 30,
        **({"data_types": {"grad_accum_dtype": grad_accum_dtype}} if grad_accum_dtype else {}),
        **({"communication_data_type": reduce_dtype} if reduce_dtype else {}),
    }


def fp16_config(precision: SidePrecision, initial_loss_scale: float, growth_interval: int) -> dict:
    """DeepSpeed's `fp16` node: off, or dynamic loss scaling from 2^k = `initial_loss_scale`. `hysteresis`
    1, so every overflow lowers the scale at once on every ZeRO stage, as ZeRO-0 and GradScaler do
    (DeepSpeed's ZeRO default, 2, skipped one overflow without lowering it)."""
    if precision.dtype != torch.float16:
        return {"enabled": False}
    mantissa, exponent = math.frexp(initial_loss_scale) if math.isfinite(initial_loss_scale) else (0.0, 0)
    if mantissa != 0.5:
        raise ValueError(f"trainer.initial_loss_scale: DeepSpeed starts its loss scale at a power of two "
                         f"(fp16.initial_scale_power), got {initial_loss_scale} (allowed: 2^k, e.g. 65536.0)")
    if growth_interval < 1:
        raise ValueError(f"trainer.loss_scale_growth_interval: must be >= 1, got {growth_interval}")
    return {"enabled": True, "initial_scale_power": exponent - 1, "loss_scale_window": growth_interval,
            "hysteresis": 1}


def check_dtypes(precision: SidePrecision, zero_stage: int, grad_accum_dtype: str | None,
                 reduce_dtype: str | None) -> None:
    """Raise ValueError for a `grad_accum_dtype` / `reduce_dtype` DeepSpeed cannot run at this stage."""
    if grad_accum_dtype not in GRAD_ACCUM_DTYPES:
        raise ValueError(f"trainer.grad_accum_dtype: unknown dtype '{grad_accum_dtype}' (allowed: null, fp32)")
    if grad_accum_dtype is not None and to_dtype(grad_accum_dtype) != precision.dtype and zero_stage == 0:
        raise ValueError(f"trainer.grad_accum_dtype: {grad_accum_dtype} with a {precision.name} body needs "
                         f"zero_stage 1, 2 or 3, got 0 (DeepSpeed's ZeRO-0 sums gradients in the module's dtype "
                         f"only; or trainer.grad_accum_dtype=null)")
    if reduce_dtype not in REDUCE_DTYPES:
        raise ValueError(f"trainer.reduce_dtype: unknown dtype '{reduce_dtype}' (allowed: null, fp32, bf16, fp16)")


def merge_user_config(config: dict, path: str) -> dict:
    """Merge a user's DeepSpeed JSON over rlmm's config, recursively; batch sizes stay rlmm's.

    An optimizer of another `type` replaces rlmm's optimizer node whole: AdamW's params (`torch_adam`,
    `weight_decay`) mean nothing to, say, SGD, which DeepSpeed builds from `torch.optim` by name."""
    try:
        user = json.loads(Path(path).expanduser().read_text())
    except FileNotFoundError:
        raise ValueError(f"trainer.config_file: '{path}' does not exist") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"trainer.config_file: '{path}' is not valid JSON ({err})") from None
    if not isinstance(user, dict):
        raise ValueError(f"trainer.config_file: '{path}' must hold a JSON object")

    def merge(base: dict, over: dict) -> dict:
        out = dict(base)
        for key, value in over.items():
            out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        return out

    user = {k: v for k, v in user.items() if k not in ("train_batch_size", *BATCH_KEYS)}
    optimizer = user.get("optimizer")
    if isinstance(optimizer, dict) and optimizer.get("type", config["optimizer"]["type"]) != config["optimizer"]["type"]:
        config = {k: v for k, v in config.items() if k != "optimizer"}
    return merge(config, user)
