"""Every place `trainer=deepspeed` reaches past DeepSpeed's public API, one function each.

Checked against DeepSpeed 0.19.8 (and, for `live_process_groups`, torch 2.13.0); each docstring names the
source file (under site-packages/deepspeed/) and the attribute it reads or changes, so an upgrade is a read
of this one file. Everything that changes state a caller cannot see from the call site (a replaced method,
a rewound scheduler, blanked module globals, a switched-off engine flag) happens here and nowhere else.
The rest of the backend (deepspeed_backend.py and its deepspeed_* siblings) uses DeepSpeed's public API
(`deepspeed.initialize`, `engine.backward`/`step`, `set_gradient_accumulation_boundary`,
`get_global_grad_norm`, `zero.GatheredParameters`) and these functions.
"""
from __future__ import annotations

import math

import torch

from rlmm.policy.precision import dtype_name

# DeepSpeed engine attributes that count steps (the LR schedule and loss scaler read them).
ENGINE_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


# -- loss scaling -------------------------------------------------------------------------------------------

def loss_left_unscaled(engine) -> bool:
    """Whether `engine.backward` leaves an fp16 loss unscaled though the optimizer unscales the gradient.

    ZeRO-0 in fp16 wraps the optimizer in `FP16_UnfusedOptimizer` (`FP16_Optimizer` for FusedAdam), which is
    no `ZeROOptimizer`: `engine.backward` scales the loss only through a ZeRO optimizer's `scale_if_loss`
    (or torch autocast's GradScaler), yet `FP16_UnfusedOptimizer.step` divides the gradient by
    `loss_scale_config.cur_scale` (`unscale_and_clip_grads`). Unfixed, every ZeRO-0 fp16 gradient reached
    AdamW 2^16 times too small and no overflow ever came from the scale; rlmm scales such a loss itself.

    Reads runtime/fp16/unfused_optimizer.py `FP16_UnfusedOptimizer.loss_scale_config.use_grad_scaling`,
    runtime/base_optimizer.py `ZeROOptimizer`, runtime/engine.py `DeepSpeedEngine.torch_autocast_z0_gradscaler`
    (and `DeepSpeedEngine.backward`'s scaling branch)."""
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    config = getattr(engine.optimizer, "loss_scale_config", None)
    return (config is not None and config.use_grad_scaling and not isinstance(engine.optimizer, ZeROOptimizer)
            and engine.torch_autocast_z0_gradscaler is None)


def current_loss_scale(engine) -> float:
    """The scale the next backward uses: `engine.optimizer.loss_scale`, a property of every fp16 optimizer
    (runtime/fp16/unfused_optimizer.py, runtime/fp16/fused_optimizer.py, runtime/zero/stage_1_and_2.py,
    runtime/zero/stage3.py: `loss_scale`)."""
    return float(engine.optimizer.loss_scale)


def min_loss_scale(engine) -> float:
    """The scale below which DeepSpeed's fp16 optimizers never go (`fp16.min_loss_scale`, the `min_scale` of
    `engine.dynamic_loss_scale_args()`, which every fp16 optimizer is built from); a static scale
    (`fp16.loss_scale` > 0) has no room at all: infinity.

    Reads runtime/engine.py `DeepSpeedEngine.dynamic_loss_scale_args` / `dynamic_loss_scale` and the key
    runtime/fp16/loss_scaler.py `MIN_LOSS_SCALE`."""
    from deepspeed.runtime.fp16.loss_scaler import MIN_LOSS_SCALE

    return float(engine.dynamic_loss_scale_args()[MIN_LOSS_SCALE]) if engine.dynamic_loss_scale() else math.inf


def skip_at_min_scale(engine) -> None:
    """Make an overflow at the minimum scale a skipped step, as on ZeRO-0 and the torch backends, not an
    exception: the ZeRO optimizers' `DynamicLossScaler` (`engine.optimizer.loss_scaler`) raises "Current loss
    scale already at minimum" from `update_scale` when `raise_error_at_min_scale` (always True, no config key);
    ZeRO-0's `FP16_UnfusedOptimizer` keeps the minimum and skips. rlmm reports that step as a fault.

    Changes runtime/fp16/loss_scaler.py `DynamicLossScaler.raise_error_at_min_scale` (set in its `__init__`,
    read in `update_scale`) on the engine's optimizer's `loss_scaler`."""
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is not None and hasattr(scaler, "raise_error_at_min_scale"):
        scaler.raise_error_at_min_scale = False


# -- gradients: accumulation and reduction ------------------------------------------------------------------

def grad_accum_dtype_of(engine) -> str:
    """What DeepSpeed sums a minibatch's micro-batch gradients in: ZeRO-1/2/3's optimizers keep their own
    accumulation buffers (`gradient_accumulation_dtype` of `DeepSpeedZeroOptimizer` and its stage-3 twin,
    `grad_acc_dtype` of `BF16_Optimizer`, the ZeRO-1 optimizer of a bf16 body with `grad_accum_dtype: fp32`);
    ZeRO-0 leaves them to autograd, in each module parameter's `.grad` (the module's dtype). Both follow
    `data_types.grad_accum_dtype`, the module's dtype by default (`engine.get_data_types()`).

    Reads runtime/zero/stage_1_and_2.py and runtime/zero/stage3.py `gradient_accumulation_dtype`,
    runtime/bf16_optimizer.py `BF16_Optimizer.grad_acc_dtype`, runtime/engine.py `get_data_types`."""
    optimizer = engine.optimizer
    for name in ("gradient_accumulation_dtype", "grad_acc_dtype"):
        if isinstance(getattr(optimizer, name, None), torch.dtype):
            return dtype_name(getattr(optimizer, name))
    return dtype_name(engine.get_data_types()[0])


def keep_out_of_zero0_reduction(engine, param: torch.nn.Parameter) -> None:
    """Leave `param`'s gradient out of DeepSpeed's ZeRO-0 all-reduce (rlmm averages it itself, once, in fp32).

    ZeRO-0's backward all-reduce (`engine.allreduce_gradients` -> `buffered_allreduce_fallback`) takes every
    module parameter that requires a gradient from `engine._get_gradients_for_reduction()`, unless the optimizer
    has its own `get_grads_for_reduction` (BF16_Optimizer) - the fp32 head outside DeepSpeed's optimizer
    included, so it was averaged twice, the first time in `communication_data_type` (bf16 for a bf16 body:
    the fp32 head's gradient rounded to bf16). The ZeRO-1/2 optimizers reduce only their own parameters.

    Replaces, on this engine instance, runtime/engine.py `DeepSpeedEngine._get_gradients_for_reduction`
    (read by `buffered_allreduce_fallback`) with a filter over the original."""
    walk = engine._get_gradients_for_reduction

    def without_param():
        dense, experts = walk()
        mine = param.grad.data_ptr() if param.grad is not None else None
        return [g for g in dense if g.is_sparse or g.data_ptr() != mine], experts

    engine._get_gradients_for_reduction = without_param


def no_backward_allreduce(engine) -> None:
    """Turn off ZeRO-0's gradient all-reduce (for one rank, where it averages nothing, yet first flattens
    every gradient into 500M-element buckets: a second copy of all gradients, 2 GB at 0.5B fp32 parameters).

    Changes runtime/engine.py `DeepSpeedEngine.enable_backward_allreduce` (set True in `__init__`, read by
    `_backward_epilogue` before `allreduce_gradients`)."""
    engine.enable_backward_allreduce = False


# -- skipping a step ----------------------------------------------------------------------------------------

def step_without_optimizer(engine) -> bool:
    """Let `engine.step()` finish a step (counters, zeroed gradients) without the optimizer stepping: its
    `step` shadowed for this one call. A wrapper with an `overflow` flag (the fp16/bf16 and ZeRO optimizers)
    has it set, so the engine itself counts the skip and holds the LR schedule back (`_take_model_step`);
    returns False for a plain optimizer, whose skip the caller must book (`book_skipped_step`).

    Shadows, for one call, the engine's optimizer's `step` (an instance attribute over the class's method,
    deleted after); sets the `overflow` flag of runtime/fp16/unfused_optimizer.py, runtime/fp16/fused_optimizer.py,
    runtime/zero/stage_1_and_2.py, runtime/zero/stage3.py, read by runtime/engine.py `_take_model_step`
    (`overflow = self.optimizer.overflow` -> `skipped_steps += 1`, no `lr_scheduler.step()`)."""
    optimizer = engine.optimizer
    flagged = hasattr(optimizer, "overflow")

    def skipped(*args, **kwargs):
        if flagged:
            optimizer.overflow = True

    optimizer.step = skipped  # shadows the method for this one call
    try:
        engine.step()
    finally:
        del optimizer.step
    return flagged


def book_skipped_step(engine, lr: float) -> None:
    """After `step_without_optimizer` on a plain optimizer (no `overflow` flag): the engine counted a step
    it did not take; count it as skipped, and hold the warm-up back at `lr`, as `_take_model_step` does for
    a flagged overflow.

    Changes runtime/engine.py `DeepSpeedEngine.skipped_steps`, rewinds the engine's `lr_scheduler.last_epoch`
    (torch's `LRScheduler`, stepped once by `_take_model_step`) by one, and puts `lr` back in every
    `engine.optimizer.param_groups` (the scheduler wrote the next step's rate there)."""
    engine.skipped_steps += 1
    engine.lr_scheduler.last_epoch -= 1  # a skipped step does not advance the warm-up
    for group in engine.optimizer.param_groups:
        group["lr"] = lr


# -- process groups -----------------------------------------------------------------------------------------

def live_process_groups() -> dict:
    """torch's live process groups (keys: the groups), empty before `init_process_group`.

    Reads torch 2.13.0 torch/distributed/distributed_c10d.py `_world.pg_group_ranks` (torch has no public
    list of the groups that exist)."""
    import torch.distributed as dist

    return dist.distributed_c10d._world.pg_group_ranks if dist.is_initialized() else {}


def cached_process_groups() -> list:
    """The process groups DeepSpeed has cached in module globals (the non-dict, non-None ones).

    Reads deepspeed/utils/groups.py's module globals named `*_GROUP` (`_WORLD_GROUP`, `_DATA_PARALLEL_GROUP`,
    ...; the expert ones are dicts)."""
    from deepspeed.utils import groups

    cached = [getattr(groups, n) for n in vars(groups) if n.endswith("_GROUP")]
    return [g for g in cached if g is not None and not isinstance(g, dict)]


def forget_process_groups() -> None:
    """Drop every process group DeepSpeed has cached, and its communication backend, so the next
    `deepspeed.init_distributed` / `deepspeed.initialize` builds them from torch's current groups.

    Blanks deepspeed/utils/groups.py's module globals named `*_GROUP` and `*_GROUP_RANKS` (a dict ones to {},
    the others to None, their values at import) and deepspeed/comm/comm.py `cdb` (None at import; set by
    `init_distributed`)."""
    import deepspeed.comm.comm as ds_comm
    from deepspeed.utils import groups

    for name in [n for n in vars(groups) if n.endswith(("_GROUP", "_GROUP_RANKS"))]:
        setattr(groups, name, {} if isinstance(getattr(groups, name), dict) else None)
    ds_comm.cdb = None


# -- checkpoints and ZeRO-3 partitions ----------------------------------------------------------------------

def checkpoint_types() -> list[type]:
    """DeepSpeed classes its optimizers put in their state dicts (a stage enum, the loss scaler, ZeRO's
    fragment addresses): the only non-tensor types `torch.load(weights_only=True)` is allowed to rebuild
    from a trainer checkpoint.

    runtime/zero/config.py `ZeroStageEnum`, runtime/fp16/loss_scaler.py `LossScaler` / `DynamicLossScaler`,
    utils/tensor_fragment.py `fragment_address`."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def engine_counters(engine) -> dict[str, int]:
    """The engine's step counters (`ENGINE_COUNTERS`), for a checkpoint.

    Reads runtime/engine.py `DeepSpeedEngine.global_steps`, `global_samples`, `micro_steps`, `skipped_steps`
    (set in `__init__`; DeepSpeed's own `load_checkpoint` restores them the same way)."""
    return {k: getattr(engine, k) for k in ENGINE_COUNTERS}


def restore_engine_counters(engine, counters: dict[str, int]) -> None:
    """Put back what `engine_counters` read (same attributes of runtime/engine.py `DeepSpeedEngine`)."""
    for key, value in counters.items():
        setattr(engine, key, value)


def load_zero_optimizer(engine, rank_states: list[dict]) -> None:
    """Restore a ZeRO-1/2/3 optimizer from every rank's `optimizer.state_dict()`: each rank's fp32 partition
    comes back and the 16-bit (ZeRO-3: partitioned) weights are rebuilt from it.

    Calls runtime/zero/stage_1_and_2.py `DeepSpeedZeroOptimizer.load_state_dict` / runtime/zero/stage3.py
    `DeepSpeedZeroOptimizer_Stage3.load_state_dict` with `load_optimizer_states=True, load_from_fp32_weights=True`
    (the list of all ranks' states is what `engine.load_checkpoint` hands them)."""
    engine.optimizer.load_state_dict(rank_states, load_optimizer_states=True, load_from_fp32_weights=True)


def local_partition(param: torch.nn.Parameter) -> torch.Tensor:
    """This rank's partition of a ZeRO-3 parameter.

    Reads runtime/zero/partition_parameters.py's `param.ds_tensor` (set by `_partition_param`)."""
    return param.ds_tensor
