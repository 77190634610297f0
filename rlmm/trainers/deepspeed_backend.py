"""`trainer=deepspeed`: the training model wrapped in a DeepSpeed engine (CPU accelerator here, CUDA on GPUs)."""
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from rlmm.collectives import average_over_ranks
from rlmm.devices import init_process_group, select_device
from rlmm.models.head import install_output_head
from rlmm.models.loading import load_value_model, model_precision, padding_id
from rlmm.precision import SidePrecision, dtype_name
from rlmm.samplers.base import Rollouts, SamplingOptions
from rlmm.trainers.loss_scale import skip_metrics
from rlmm.trainers.optim import linear_warmup
from rlmm.trainers.memory import ActivationBudget, optimizer_state_bytes, prepare_for_training
from rlmm.trainers.packing import Batch, MicroBatching, use_varlen_attention
from rlmm.trainers.scoring import model_scores, score_rollouts
from rlmm.trainers.update import MicroBatchedUpdate


# DeepSpeed engine attributes that count steps (the LR schedule and loss scaler read them).
ENGINE_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")
GRAD_ACCUM_DTYPES = (None, "fp32")
REDUCE_DTYPES = (None, "fp32", "bf16", "fp16")


# -- DeepSpeed internals this backend reaches into, one function each (checked against DeepSpeed 0.19.8) --------

def loss_left_unscaled(engine) -> bool:
    """Whether `engine.backward` leaves an fp16 loss unscaled though the optimizer unscales the gradient.

    ZeRO-0 in fp16 wraps the optimizer in `FP16_UnfusedOptimizer` (`FP16_Optimizer` for FusedAdam), which is
    no `ZeROOptimizer`: `engine.backward` scales the loss only through a ZeRO optimizer's `scale_if_loss`
    (or torch autocast's GradScaler), yet `FP16_UnfusedOptimizer.step` divides the gradient by
    `loss_scale_config.cur_scale` (`unscale_and_clip_grads`). Unfixed, every ZeRO-0 fp16 gradient reached
    AdamW 2^16 times too small and no overflow ever came from the scale; rlmm scales such a loss itself."""
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    config = getattr(engine.optimizer, "loss_scale_config", None)
    return (config is not None and config.use_grad_scaling and not isinstance(engine.optimizer, ZeROOptimizer)
            and engine.torch_autocast_z0_gradscaler is None)


def min_loss_scale(engine) -> float:
    """The scale below which DeepSpeed's fp16 optimizers never go (`fp16.min_loss_scale`, the `min_scale` of
    `engine.dynamic_loss_scale_args()`, which every fp16 optimizer is built from); a static scale
    (`fp16.loss_scale` > 0) has no room at all: infinity."""
    from deepspeed.runtime.fp16.loss_scaler import MIN_LOSS_SCALE

    return float(engine.dynamic_loss_scale_args()[MIN_LOSS_SCALE]) if engine.dynamic_loss_scale() else math.inf


def skip_at_min_scale(engine) -> None:
    """Make an overflow at the minimum scale a skipped step, as on ZeRO-0 and the torch backends, not an
    exception: the ZeRO optimizers' `DynamicLossScaler` (`engine.optimizer.loss_scaler`) raises "Current loss
    scale already at minimum" from `update_scale` when `raise_error_at_min_scale` (always True, no config key);
    ZeRO-0's `FP16_UnfusedOptimizer` keeps the minimum and skips. rlmm reports that step as a fault."""
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is not None and hasattr(scaler, "raise_error_at_min_scale"):
        scaler.raise_error_at_min_scale = False


def grad_accum_dtype_of(engine) -> str:
    """What DeepSpeed sums a minibatch's micro-batch gradients in: ZeRO-1/2/3's optimizers keep their own
    accumulation buffers (`gradient_accumulation_dtype` of `DeepSpeedZeroOptimizer` and its stage-3 twin,
    `grad_acc_dtype` of `BF16_Optimizer`, the ZeRO-1 optimizer of a bf16 body with `grad_accum_dtype: fp32`);
    ZeRO-0 leaves them to autograd, in each module parameter's `.grad` (the module's dtype). Both follow
    `data_types.grad_accum_dtype`, the module's dtype by default (`engine.get_data_types()`)."""
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
    the fp32 head's gradient rounded to bf16). The ZeRO-1/2 optimizers reduce only their own parameters."""
    walk = engine._get_gradients_for_reduction

    def without_param():
        dense, experts = walk()
        mine = param.grad.data_ptr() if param.grad is not None else None
        return [g for g in dense if g.is_sparse or g.data_ptr() != mine], experts

    engine._get_gradients_for_reduction = without_param


def skip_optimizer_step(engine) -> bool:
    """Let `engine.step()` finish a step (counters, zeroed gradients) without the optimizer stepping: its
    `step` shadowed for this one call. A wrapper with an `overflow` flag (the fp16/bf16 and ZeRO optimizers)
    has it set, so the engine itself counts the skip and holds the LR schedule back (`_take_model_step`);
    returns False for a plain optimizer, whose skip the caller must book."""
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


class ZeRO3Weights(Mapping):
    """Hugging Face-named weights of a ZeRO-3 module, each parameter gathered from its partitions as it is
    read (`deepspeed.zero.GatheredParameters([p])`) and returned as a detached clone, so the extra peak is
    one full tensor, not the model twice (the gather, then its clone). Reading is a collective: every rank
    must read the same names in the same order (the names of `module.state_dict()`, tied aliases included:
    a tied head is read under both names). Buffers are whole on every rank. `local_shards()`: this rank's
    partitions (`param.ds_tensor`), for the NaN guard (rlmm/trainers/weight_sync.py)."""

    def __init__(self, module: torch.nn.Module):
        self.names = list(module.state_dict(keep_vars=True))
        self.params = dict(module.named_parameters(remove_duplicate=False))
        self.buffers = dict(module.named_buffers(remove_duplicate=False))
        self.module = module

    def __getitem__(self, name: str) -> torch.Tensor:
        import deepspeed

        if name in self.params:
            param = self.params[name]
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                return param.detach().clone()
        return self.buffers[name].detach()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def local_shards(self) -> list[torch.Tensor]:
        own = {id(p): p.ds_tensor for p in self.module.parameters()}
        return [*own.values(), *(self.buffers[n] for n in self.names if n in self.buffers)]


def _deepspeed_checkpoint_types() -> list[type]:
    """DeepSpeed classes its optimizers put in their state dicts (a stage enum, the loss scaler, ZeRO's fragment addresses): the
    only non-tensor types `torch.load(weights_only=True)` is allowed to rebuild from a trainer checkpoint."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def merge_user_config(config: dict, path: str) -> dict:
    """Merge a user's DeepSpeed JSON over rlmm's config, recursively; batch sizes stay rlmm's.

    An optimizer of another `type` replaces rlmm's optimizer node whole: AdamW's params (`torch_adam`,
    `weight_decay`) mean nothing to, say, SGD, which DeepSpeed builds from `torch.optim` by name."""
    import json

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

    fixed = {k: config[k] for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")}
    user = {k: v for k, v in user.items() if k not in ("train_batch_size", *fixed)}
    optimizer = user.get("optimizer")
    if isinstance(optimizer, dict) and optimizer.get("type", config["optimizer"]["type"]) != config["optimizer"]["type"]:
        config = {k: v for k, v in config.items() if k != "optimizer"}
    return merge(config, user)


def forget_stale_groups() -> None:
    """Drop DeepSpeed's cached process groups when they no longer belong to torch's current world.

    DeepSpeed caches groups in module globals; if the default group was destroyed and re-created since
    (in-process vLLM does both when engines come and go), the cache points at dead groups."""
    import deepspeed.comm.comm as ds_comm
    import torch.distributed as dist
    from deepspeed.utils import groups

    live = dist.distributed_c10d._world.pg_group_ranks if dist.is_initialized() else {}
    cached = [getattr(groups, n) for n in vars(groups) if n.endswith("_GROUP")]
    stale = [g for g in cached if g is not None and not isinstance(g, dict) and g not in live]
    if stale or not dist.is_initialized():
        for name in [n for n in vars(groups) if n.endswith(("_GROUP", "_GROUP_RANKS"))]:
            setattr(groups, name, {} if isinstance(getattr(groups, name), dict) else None)
        ds_comm.cdb = None


class FP32HeadOptimizer:
    """The fp32 LM head's own optimizer beside DeepSpeed's (see `DeepSpeedTrainer`): torch AdamW on the
    fp32 weight, the trainers' linear warm-up, the gradient averaged over the ranks once, in fp32, by rlmm
    (DeepSpeed's own reductions leave it out: `keep_out_of_zero0_reduction`), fp16 loss scaling undone,
    and clipping to `grad_clip` by the head's own norm."""

    def __init__(self, param: torch.nn.Parameter, lr: float, weight_decay: float, warmup_steps: int,
                 grad_clip: float):
        self.param = param
        self.optimizer = torch.optim.AdamW([param], lr=lr, weight_decay=weight_decay)
        self.schedule = linear_warmup(self.optimizer, warmup_steps)
        self.grad_clip = grad_clip
        self.norm = 0.0

    def reduce(self, loss_scale: float | None) -> bool:
        """At the accumulation boundary, before DeepSpeed steps: average, unscale; True when finite."""
        grad = self.param.grad
        if grad is None:
            self.norm = 0.0
            return True
        average_over_ranks([grad])
        if loss_scale:
            grad.div_(loss_scale)
        self.norm = torch.linalg.vector_norm(grad).item()
        return math.isfinite(self.norm)

    def step(self, skip: bool) -> None:
        """Step with the body, or skip with it; the gradient is cleared either way."""
        if not skip and self.param.grad is not None:
            if self.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_([self.param], self.grad_clip)
            self.optimizer.step()
            self.schedule.step()
        self.param.grad = None

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "schedule": self.schedule.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])


class DeepSpeedTrainer:
    """Args:
        micro_batch_size: rollouts per forward pass.
        micro_batch_tokens: null, or micro-batches of at most this many tokens instead (rows longest first;
            rlmm/trainers/packing.py).
        padding_free: each micro-batch's sequences packed into one row without padding (packing.py).
        zero_stage: ZeRO stage 0-3.
        lr, weight_decay: AdamW (torch's implementation, so it runs on CPU too).
        warmup_steps: linear learning-rate warm-up over this many optimizer steps (0: none).
        grad_clip: clip the global gradient norm to this (0: off).
        logits_chunk_size: response positions whose full-vocabulary logits exist at once while scoring
            (memory: about 5 x this x vocabulary x 4 bytes; rlmm/models/head.py).
        gradient_checkpointing: recompute each decoder layer in the backward pass instead of keeping its
            activations (transformers' gradient checkpointing; about a third more compute). null: for an
            update whose largest micro-batch would not fit otherwise (rlmm/trainers/memory.py).
        initial_loss_scale, loss_scale_growth_interval: fp16 dynamic loss scaling (ignored otherwise), as the
            torch and FSDP trainers': DeepSpeed's `fp16.initial_scale_power` (log2 of the scale, so a power of
            two) and `fp16.loss_scale_window`; rlmm sets `fp16.hysteresis` to 1, so every overflow lowers the
            scale at once on every ZeRO stage, as ZeRO-0 and GradScaler do (DeepSpeed's ZeRO default, 2,
            skipped one overflow without lowering it).
        grad_accum_dtype: what a minibatch's micro-batch gradients are summed in (`data_types.grad_accum_dtype`):
            null, DeepSpeed's default, the body's dtype (a bf16 body: each micro-batch's contribution below 2^-9
            of the running sum is lost); fp32 (a 16-bit body needs zero_stage 1, 2 or 3: DeepSpeed's ZeRO-0
            accumulates in the module's dtype only; ZeRO-1 then runs DeepSpeed's BF16_Optimizer for bf16).
        reduce_dtype: the dtype gradients are averaged over ranks in (`communication_data_type`): null,
            DeepSpeed's default, the body's dtype; fp32, bf16, fp16. ZeRO-1 reduces the accumulated sum at the
            minibatch's end, so bf16 there rounds an fp32 sum to bf16 again (FSDP2 reduces in fp32 by default).
        config_file: a DeepSpeed JSON of your own, merged over the config rlmm derives from the values
            above and the precision (yours wins key by key; batch sizes stay rlmm's, they follow the run).
        accumulation_steps: micro-batches per optimizer step (set by the app from the minibatch size; DeepSpeed's
            `gradient_accumulation_steps`, though the optimizer steps at each minibatch's last micro-batch,
            whatever their count: `DeepSpeedUpdate` sets the boundary itself).
        value_head: a value model instead of the policy (PPO's critic, rlmm/critic.py; set by the app).

    An fp32 LM head under a 16-bit body (precision `*_fp32head`) trains as a parameter group of its own:
    DeepSpeed casts the whole module to 16 bits and its optimizer keeps one dtype per group, so the head
    stays out of it (`FP32HeadOptimizer`): its fp32 weight, gradient and AdamW moments are rlmm's, its
    gradient is averaged over the ranks and clipped to `grad_clip` by its own norm, and it steps with the
    body (and skips with it). ZeRO-3 cannot hold it: it partitions every parameter of the module into its
    16-bit flat buffers, the head included.
    """

    def __init__(self, model_path: str, precision: SidePrecision, sampling: SamplingOptions, micro_batch_size: int,
                 zero_stage: int, lr: float, weight_decay: float, warmup_steps: int, grad_clip: float,
                 logits_chunk_size: int, gradient_checkpointing: bool | None, initial_loss_scale: float,
                 loss_scale_growth_interval: int, grad_accum_dtype: str | None, reduce_dtype: str | None,
                 config_file: str | None, micro_batch_tokens: int | None, padding_free: bool,
                 accumulation_steps: int, value_head: bool = False):
        import deepspeed
        import torch.distributed as dist
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.batching = MicroBatching(micro_batch_size, micro_batch_tokens, padding_free)
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"trainer.zero_stage: unknown stage {zero_stage} (allowed: 0, 1, 2, 3)")
        if precision.fp32_head and zero_stage == 3:
            raise ValueError("precision: an fp32 LM head on trainer=deepspeed needs zero_stage 0, 1 or 2 (ZeRO-3 "
                             "partitions every parameter, the head included, into its 16-bit buffers)")
        problem = self.unsupported(precision)
        if problem:
            raise ValueError(problem)
        fp16 = self._fp16_config(precision, initial_loss_scale, loss_scale_growth_interval)
        if grad_accum_dtype not in GRAD_ACCUM_DTYPES:
            raise ValueError(f"trainer.grad_accum_dtype: unknown dtype '{grad_accum_dtype}' (allowed: null, fp32)")
        if grad_accum_dtype is not None and grad_accum_dtype != precision.dtype and zero_stage == 0:
            raise ValueError(f"trainer.grad_accum_dtype: {grad_accum_dtype} with a {precision.dtype} body needs "
                             f"zero_stage 1, 2 or 3, got 0 (DeepSpeed's ZeRO-0 sums gradients in the module's dtype "
                             f"only; or trainer.grad_accum_dtype=null)")
        if reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"trainer.reduce_dtype: unknown dtype '{reduce_dtype}' (allowed: null, fp32, bf16, fp16)")
        self.sampling = sampling
        self.device = select_device()
        forget_stale_groups()
        init_process_group()
        deepspeed.init_distributed(verbose=False)  # DeepSpeed's handle on the group just made (or vLLM's)
        if value_head:  # PPO's critic: the policy's body with a scalar head (rlmm/critic.py)
            model, self.head, fp32_head = load_value_model(model_path, SidePrecision("fp32", False)), None, None
        else:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
            fp32_head = model.get_output_embeddings().weight.detach().clone() if precision.fp32_head else None
            self.head = install_output_head(model, fp32=precision.fp32_head, chunk_size=logits_chunk_size,
                                            fp32_weight=fp32_head)
        if padding_free:
            use_varlen_attention(model, self.device, precision.torch_dtype)
        prepare_for_training(model, gradient_checkpointing)
        config = {
            "train_micro_batch_size_per_gpu": micro_batch_size,
            "gradient_accumulation_steps": accumulation_steps,
            "gradient_clipping": grad_clip,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": weight_decay, "torch_adam": True}},
            "bf16": {"enabled": precision.dtype == "bf16"},
            "fp16": fp16,
            "zero_optimization": {"stage": zero_stage},
            "steps_per_print": 1 << 30,
            **({"data_types": {"grad_accum_dtype": grad_accum_dtype}} if grad_accum_dtype else {}),
            **({"communication_data_type": reduce_dtype} if reduce_dtype else {}),
        }
        if config_file:
            config = merge_user_config(config, config_file)
        body = [p for p in model.parameters() if fp32_head is None or p is not self.head.weight]
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=body, config=config,
                                               lr_scheduler=lambda optimizer: linear_warmup(optimizer, warmup_steps))
        if zero_stage == 0 and dist.get_world_size() == 1:
            # Nothing to average over one rank, and DeepSpeed's ZeRO-0 all-reduce first flattens every gradient
            # into 500M-element buckets: a second copy of all gradients (2 GB at 0.5B parameters in fp32).
            self.engine.enable_backward_allreduce = False
        self.head_optimizer = None
        if fp32_head is not None:
            # DeepSpeed cast the whole module to 16 bits: give the head its fp32 values back.
            self.head.weight.data = fp32_head.to(self.engine.device)
            self.head_optimizer = FP32HeadOptimizer(self.head.weight, lr, weight_decay, warmup_steps, grad_clip)
            keep_out_of_zero0_reduction(self.engine, self.head.weight)
        # fp16/bf16 optimizers check for overflow and skip the step themselves (dynamic loss scaling).
        self.loss_scaled = precision.dtype in ("fp16", "bf16")
        self.fp16 = precision.dtype == "fp16"
        if self.fp16:
            skip_at_min_scale(self.engine)
        self.scales_loss = self.fp16 and loss_left_unscaled(self.engine)  # ZeRO-0: rlmm scales the loss
        self.min_loss_scale = min_loss_scale(self.engine) if self.fp16 else math.inf
        parameters = sum(p.numel() for p in model.parameters())
        # ZeRO-3 releases each module's parameters after its forward and fetches them again for its
        # backward, in the order of the last forward: several forwards before the first backward gave wrong
        # gradients (relative error 0.65 against the hand-computed step, tests/test_update.py), so under
        # ZeRO-3 the one-pass step always scores first.
        self.budget = ActivationBudget(model.config, precision.torch_dtype, self.engine.device, gradient_checkpointing,
                                       optimizer_state_bytes(parameters // dist.get_world_size() if zero_stage
                                                             else parameters, precision.torch_dtype),
                                       one_pass=zero_stage != 3)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = padding_id(tokenizer, model_path)
        # grad_accum_dtype: the dtype a minibatch's micro-batch gradients are summed in (an fp32 head's: fp32);
        # reduce_dtype: the dtype the ranks average them in (DeepSpeed's communication_data_type).
        self.actual_precision = {**model_precision(self.engine.module),
                                 "grad_accum_dtype": grad_accum_dtype_of(self.engine),
                                 "reduce_dtype": dtype_name(self.engine.communication_data_type)}

    @staticmethod
    def _fp16_config(precision: SidePrecision, initial_loss_scale: float, growth_interval: int) -> dict:
        """DeepSpeed's `fp16` node: off, or dynamic loss scaling from 2^k = `initial_loss_scale`."""
        if precision.dtype != "fp16":
            return {"enabled": False}
        mantissa, exponent = math.frexp(initial_loss_scale) if math.isfinite(initial_loss_scale) else (0.0, 0)
        if mantissa != 0.5:
            raise ValueError(f"trainer.initial_loss_scale: DeepSpeed starts its loss scale at a power of two "
                             f"(fp16.initial_scale_power), got {initial_loss_scale} (allowed: 2^k, e.g. 65536.0)")
        if growth_interval < 1:
            raise ValueError(f"trainer.loss_scale_growth_interval: must be >= 1, got {growth_interval}")
        return {"enabled": True, "initial_scale_power": exponent - 1, "loss_scale_window": growth_interval,
                "hysteresis": 1}

    @staticmethod
    def unsupported(precision: SidePrecision) -> str | None:
        """Why DeepSpeed's accelerator on this machine cannot run `precision` (None when it can)."""
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        supported = ["fp32"] + [name for name, ok in (("bf16", accelerator.is_bf16_supported()),
                                                      ("fp16", accelerator.is_fp16_supported())) if ok]
        if precision.dtype not in supported:
            return (f"precision: trainer=deepspeed cannot run {precision.dtype} on this machine's "
                    f"{accelerator.device_name()} accelerator (allowed here: {', '.join(supported)}; "
                    f"trainer=torch scores in any)")
        return None

    def _forward(self, batch: Batch) -> torch.Tensor:
        return model_scores(self.engine, batch, self.engine.device, value_model=self.head is None)

    def logprobs(self, rollouts: Rollouts, micro_batch_size: int | None = None, *,
                 layout: MicroBatching | None = None) -> torch.Tensor:
        return score_rollouts(self._forward, self.head, rollouts, self.sampling,
                              (layout or self.batching).sized(micro_batch_size),
                              self.pad_id)

    def begin_update(self, rollouts: Rollouts, rows: list[int]) -> DeepSpeedUpdate:
        return DeepSpeedUpdate(self, rollouts, rows)

    @property
    def model(self) -> torch.nn.Module:
        """The transformers model inside the engine (`trainer.model`, as on the torch and FSDP trainers)."""
        return self.engine.module

    @property
    def generates_in_place(self) -> bool:
        """Whether `model` can generate the trained policy as it is (the evaluation then needs no copy of it,
        rlmm/train.py's `Evaluation`): ZeRO-0/1/2 keep every full weight on each rank, ZeRO-3 only its
        partitions; not a value model, nor with padding-free attention installed."""
        return self.engine.zero_optimization_stage() < 3 and self.head is not None and not self.batching.padding_free

    def state_dict(self) -> Mapping[str, torch.Tensor]:
        """Full Hugging Face-named weights on every rank. Under ZeRO-3 each is gathered from its partitions as
        it is read (`ZeRO3Weights`: a collective, every rank reads them all in one order, as a weight sync
        does), one tensor at a time."""
        if self.engine.zero_optimization_stage() == 3:
            return ZeRO3Weights(self.engine.module)
        return {k: v.detach() for k, v in self.engine.module.state_dict().items()}

    @staticmethod
    def safe_checkpoint_types() -> list[type]:
        return _deepspeed_checkpoint_types()

    def checkpoint_state(self) -> dict:
        """This rank's optimizer (ZeRO: its partition and fp32 master weights), LR schedule and step
        counters: tensors and plain values only, so `torch.load(weights_only=True)` reads them back
        (with DeepSpeed's bookkeeping types allowed, see `safe_checkpoint_types`)."""
        engine = self.engine
        state = {"optimizer": engine.optimizer.state_dict(), "lr_schedule": engine.lr_scheduler.state_dict(),
                 "counters": {k: getattr(engine, k) for k in ENGINE_COUNTERS}}
        if self.head_optimizer is not None:
            state["fp32_head"] = self.head_optimizer.state_dict()
        return state

    def load_checkpoint(self, weights: dict[str, torch.Tensor], rank_states: list[dict]) -> None:
        """Restore the state `state_dict()` and every rank's `checkpoint_state()` saved (same world size)."""
        import torch.distributed as dist

        engine = self.engine
        if len(rank_states) != dist.get_world_size():
            raise ValueError(f"train.resume: the checkpoint was written by {len(rank_states)} ranks, this run has "
                             f"{dist.get_world_size()} (resume with the same number of ranks)")
        if engine.zero_optimization_stage() == 0:
            engine.module.load_state_dict(weights)
            engine.optimizer.load_state_dict(rank_states[dist.get_rank()]["optimizer"])
        else:
            if engine.zero_optimization_stage() < 3:
                engine.module.load_state_dict(weights)
            # ZeRO restores each rank's fp32 partition and rebuilds the 16-bit / partitioned weights from it.
            engine.optimizer.load_state_dict([s["optimizer"] for s in rank_states], load_optimizer_states=True,
                                             load_from_fp32_weights=True)
        own = rank_states[dist.get_rank()]
        engine.lr_scheduler.load_state_dict(own["lr_schedule"])
        if self.head_optimizer is not None:  # its weight came back with the module's state dict, in fp32
            self.head_optimizer.load_state_dict(own["fp32_head"])
        for key, value in own["counters"].items():
            setattr(engine, key, value)

    def close(self) -> None:
        """Release the engine and DeepSpeed's handle on the process group (which may be the one
        in-process vLLM created and is about to destroy)."""
        import deepspeed.comm.comm as ds_comm
        from deepspeed.utils import groups

        self.engine.destroy()
        del self.engine
        ds_comm.cdb = None
        for name in [n for n in vars(groups) if n.endswith(("_GROUP", "_GROUP_RANKS"))]:
            setattr(groups, name, {} if isinstance(getattr(groups, name), dict) else None)


class DeepSpeedUpdate(MicroBatchedUpdate):
    """One optimizer step of `DeepSpeedTrainer` (see `MinibatchUpdate`). DeepSpeed steps its optimizer at
    the accumulation boundary, inside the last micro-batch's `backward`; `step()` then reports. The boundary
    is set here (`set_gradient_accumulation_boundary`) at the minibatch's last micro-batch, not counted by
    the engine from `accumulation_steps`, since a token budget makes the count vary per minibatch. A
    non-finite gradient skips the step (DeepSpeed's skipped_steps + 1): in fp16/bf16 DeepSpeed's optimizers
    do it, in fp32 (and for a non-finite fp32 head) rlmm drops the gradients first. metrics["skipped"] = 1
    for a fault; an fp16 overflow at a scale above `fp16.min_loss_scale` is the loss scaler's normal
    business, metrics["loss_scale_skipped"] = 1 (rlmm/trainers/loss_scale.py)."""

    def __init__(self, trainer: DeepSpeedTrainer, rollouts: Rollouts, rows: list[int]):
        engine = trainer.engine
        super().__init__(trainer._forward, trainer.head, rollouts, rows, trainer.sampling, trainer.pad_id,
                         trainer.batching, trainer.budget, engine.module)
        self.trainer, self.engine, self.backwards = trainer, engine, 0
        self.own_norm: float | None = None  # ZeRO-0: DeepSpeed reports no norm, rlmm takes it
        self.fault = False  # rlmm skipped the step itself (a non-finite fp32 gradient or fp32 head)
        self.booked = False  # ... and the engine counted that skip itself (`skip_optimizer_step`)
        self.skipped_before = engine.skipped_steps
        self.lr = engine.get_lr()[0]  # the rate this step uses (the schedule advances inside engine.step)
        # The scale this step's backward uses (DeepSpeed's fp16 optimizers, ZeRO or not).
        self.loss_scale = float(engine.optimizer.loss_scale) if trainer.fp16 else None

    def backward(self, loss: torch.Tensor) -> None:
        engine, head = self.engine, self.trainer.head_optimizer
        self.backwards += 1
        # Reduce (ZeRO-1/2/3: partition) and step after the minibatch's last micro-batch, whatever the count.
        engine.set_gradient_accumulation_boundary(self.backwards == len(self.micro_batches))
        if self.trainer.scales_loss:  # ZeRO-0 fp16: the optimizer unscales a loss the engine did not scale
            loss = loss * self.loss_scale
        # The loss is already normalised by the whole minibatch: no extra 1/accumulation_steps.
        engine.backward(loss, scale_wrt_gas=False)
        if not engine.is_gradient_accumulation_boundary():
            engine.step()  # DeepSpeed only steps the optimizer at the accumulation boundary
            return
        head_finite = head.reduce(self.loss_scale) if head else True
        if engine.zero_optimization_stage() == 0:
            # DeepSpeed reports no norm for plain fp32 without ZeRO (and a scaled one in fp16): take it
            # before it clips.
            params = [p for p in engine.module.parameters() if p.grad is not None
                      and (head is None or p is not head.param)]
            self.own_norm = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in params])).item()
            if self.trainer.scales_loss:
                self.own_norm /= self.loss_scale
        own_finite = self.own_norm is None or math.isfinite(self.own_norm)
        if not head_finite or (not own_finite and not self.trainer.loss_scaled):
            # Plain AdamW has no overflow check (the loss-scaled optimizers skip by themselves), and a
            # non-finite fp32 head must stop the body too (its fp32 gradient never overflows from the scale).
            self.fault = True
            self.booked = skip_optimizer_step(engine)
            return
        engine.step()

    def step(self) -> dict[str, float]:
        engine, head = self.engine, self.trainer.head_optimizer
        self._settled()
        if self.backwards != len(self.micro_batches):
            raise RuntimeError(f"DeepSpeedUpdate: step() after {self.backwards} of the minibatch's "
                               f"{len(self.micro_batches)} micro-batches")
        metrics = {"lr": self.lr}
        if self.loss_scale is not None:
            metrics["loss_scale"] = self.loss_scale
        norm = engine.get_global_grad_norm()
        metrics["grad_norm"] = (self.own_norm if self.own_norm is not None
                                else float(norm) if norm is not None else float("nan"))
        if self.fault and not self.booked:  # a plain optimizer: the engine counted a step it did not take
            engine.skipped_steps += 1
            engine.lr_scheduler.last_epoch -= 1  # a skipped step does not advance the warm-up
            for group in engine.optimizer.param_groups:
                group["lr"] = self.lr
        skipped = engine.skipped_steps > self.skipped_before
        if self.fault:  # rlmm's own skip (fp32, or the fp32 head): a fault, never an overflow of the scale
            metrics.update(skipped=1.0, **({"loss_scale_skipped": 0.0} if self.loss_scale is not None else {}))
        else:
            metrics.update(skip_metrics(skipped, self.loss_scale, self.trainer.min_loss_scale))
        if head:
            metrics["grad_norm"] = math.hypot(metrics["grad_norm"], head.norm)
            head.step(skip=skipped)
        return metrics
