"""`trainer=deepspeed`: the training model wrapped in a DeepSpeed engine (CPU accelerator here, CUDA on GPUs).

The engine's pieces live beside this file, one concern each: `deepspeed_config` (the config rlmm derives and
a user's JSON merged over it), `deepspeed_groups` (DeepSpeed's cached process groups kept in step with
torch's), `deepspeed_head` (the fp32 LM head's own optimizer), `deepspeed_checkpoint` (full weights, ZeRO-3
gathered, and trainer checkpoints), `deepspeed_skip` (skipping a bad step). Every reach past DeepSpeed's
public API is one function in `deepspeed_internals`, with the DeepSpeed 0.19.8 source it was checked against.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from rlmm.models.head import install_output_head
from rlmm.models.loading import load_value_model, model_precision, padding_id
from rlmm.policy.precision import SidePrecision, dtype_name, to_dtype
from rlmm.policy.quantization import NoQuantization, QuantizationMode
from rlmm.policy.rollouts import Rollouts, SamplingOptions
from rlmm.runtime import cpu
from rlmm.runtime.devices import init_process_group, select_device
from rlmm.trainers import deepspeed_checkpoint
from rlmm.trainers.deepspeed_config import check_dtypes, engine_config, merge_user_config
from rlmm.trainers.deepspeed_groups import forget_stale_groups, release_groups
from rlmm.trainers.deepspeed_head import FP32HeadOptimizer
from rlmm.trainers.deepspeed_internals import (checkpoint_types, current_loss_scale, grad_accum_dtype_of,
                                               keep_out_of_zero0_reduction, loss_left_unscaled, min_loss_scale,
                                               no_backward_allreduce, skip_at_min_scale)
from rlmm.trainers.deepspeed_ops import prepare_jit_ops
from rlmm.trainers.deepspeed_skip import BadStep
from rlmm.trainers.fake_quantization import FakeQuantization
from rlmm.trainers.memory import ActivationBudget, optimizer_state_bytes, prepare_for_training
from rlmm.trainers.optim import linear_warmup, scaled_lr
from rlmm.trainers.packing import Batch, MicroBatching, use_varlen_attention
from rlmm.trainers.scoring import model_scores, score_rollouts, score_with_entropy
from rlmm.trainers.update import MicroBatchedUpdate


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
        fake_quantize: the forward multiplies with the weights the sampler serves, `quantization`'s
            dequantize(quantize(W)) (and rounds int8's layer inputs), straight-through gradients to the weights
            (rlmm/trainers/fake_quantization.py); on every ZeRO stage (ZeRO-3 gathers a layer's weight before its
            forward). The policy only: a value model is never fake-quantized.
        value_head: a value model instead of the policy (PPO's critic, rlmm/run/critic.py; set by the app).
        quantization: (set by the app from `quantization=`) the mode the sampler serves; what `fake_quantize` uses.
        row_width: (set by the app for `sampler=bitwise`) every micro-batch one row right-padded to this many
            tokens and each head position projected alone (rlmm/trainers/packing.py, rlmm/models/head.py), or None.

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
                 config_file: str | None, micro_batch_tokens: int | None, padding_free: bool, fake_quantize: bool,
                 value_head: bool = False, quantization: QuantizationMode = NoQuantization(),
                 row_width: int | None = None):
        import deepspeed
        import torch.distributed as dist
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.batching = MicroBatching(micro_batch_size, micro_batch_tokens, padding_free, row_width)
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"trainer.zero_stage: unknown stage {zero_stage} (allowed: 0, 1, 2, 3)")
        if precision.fp32_head and zero_stage == 3:
            raise ValueError("precision: an fp32 LM head on trainer=deepspeed needs zero_stage 0, 1 or 2 (ZeRO-3 "
                             "partitions every parameter, the head included, into its 16-bit buffers)")
        problem = self.unsupported(precision)
        if problem:
            raise ValueError(problem)
        config = engine_config(precision, micro_batch_size, zero_stage, lr, weight_decay,
                               grad_clip, initial_loss_scale, loss_scale_growth_interval, grad_accum_dtype,
                               reduce_dtype)
        check_dtypes(precision, zero_stage, grad_accum_dtype, reduce_dtype)
        self.sampling = sampling
        self.device = select_device()
        forget_stale_groups()
        init_process_group()
        prepare_jit_ops()  # its own build folder, no dead process's lock to wait on (deepspeed_ops)
        deepspeed.init_distributed(verbose=False)  # DeepSpeed's handle on the group just made (or vLLM's)
        if value_head:  # PPO's critic: the policy's body with a scalar head (rlmm/run/critic.py)
            model, self.head, fp32_head = load_value_model(model_path, SidePrecision(torch.float32, False)), None, None
        else:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
            fp32_head = model.get_output_embeddings().weight.detach().clone() if precision.fp32_head else None
            self.head = install_output_head(model, fp32=precision.fp32_head, chunk_size=logits_chunk_size,
                                            fp32_weight=fp32_head)
        if self.head is not None:  # the bitwise arm: a position's logits whatever is scored beside it
            self.head.positions_alone = row_width is not None
        if padding_free:
            use_varlen_attention(model, self.device, precision.dtype)
        prepare_for_training(model, gradient_checkpointing)
        if config_file:
            config = merge_user_config(config, config_file)
        body = [p for p in model.parameters() if fp32_head is None or p is not self.head.weight]
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=body, config=config,
                                               lr_scheduler=lambda optimizer: linear_warmup(optimizer, warmup_steps))
        self.fake_quantization = FakeQuantization.of(self.engine.module, model_path, quantization,
                                                     fake_quantize and not value_head, type(self), precision)
        if zero_stage == 0 and dist.get_world_size() == 1:
            no_backward_allreduce(self.engine)  # nothing to average over one rank, and it copies every gradient
        self.head_optimizer = None
        if fp32_head is not None:
            # DeepSpeed cast the whole module to 16 bits: give the head its fp32 values back.
            self.head.weight.data = fp32_head.to(self.engine.device)
            self.head_optimizer = FP32HeadOptimizer(self.head.weight, lr, weight_decay, warmup_steps, grad_clip)
            keep_out_of_zero0_reduction(self.engine, self.head.weight)
        # fp16/bf16 optimizers check for overflow and skip the step themselves (dynamic loss scaling).
        self.loss_scaled = precision.dtype in (torch.float16, torch.bfloat16)
        self.fp16 = precision.dtype == torch.float16
        if self.fp16:
            skip_at_min_scale(self.engine)
        self.scales_loss = self.fp16 and loss_left_unscaled(self.engine)  # ZeRO-0: rlmm scales the loss
        self.min_loss_scale = min_loss_scale(self.engine) if self.fp16 else math.inf
        parameters = sum(p.numel() for p in model.parameters())
        # ZeRO-3 releases each module's parameters after its forward and fetches them again for its
        # backward, in the order of the last forward: several forwards before the first backward gave wrong
        # gradients (relative error 0.65 against the hand-computed step, tests/test_update.py), so under
        # ZeRO-3 the one-pass step always scores first.
        self.budget = ActivationBudget(model.config, precision.dtype, self.engine.device, gradient_checkpointing,
                                       optimizer_state_bytes(parameters // dist.get_world_size() if zero_stage
                                                             else parameters, precision.dtype),
                                       one_pass=zero_stage != 3)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = padding_id(tokenizer, model_path)
        # grad_accum_dtype: the dtype a minibatch's micro-batch gradients are summed in (an fp32 head's: fp32);
        # reduce_dtype: the dtype the ranks average them in (DeepSpeed's communication_data_type).
        self.actual_precision = {**model_precision(self.engine.module),
                                 "grad_accum_dtype": grad_accum_dtype_of(self.engine),
                                 "reduce_dtype": dtype_name(self.engine.communication_data_type),
                                 **self.fake_quantization.report()}

    @staticmethod
    def unsupported(precision: SidePrecision) -> str | None:
        """Why DeepSpeed's accelerator on this machine cannot run `precision` (None when it can)."""
        supported = cpu.deepspeed_dtypes()  # names: rlmm/runtime/ sits below the precision objects
        if precision.dtype not in [to_dtype(name) for name in supported]:
            return (f"precision: trainer=deepspeed cannot run {precision.name} on this machine's "
                    f"{cpu.deepspeed_device_name()} accelerator (allowed here: {', '.join(supported)}; "
                    f"trainer=torch scores in any)")
        return None

    @staticmethod
    def fake_quantize_refusal(quantization: QuantizationMode, precision: SidePrecision) -> str | None:
        """None: the weights it sends (`state_dict()`, ZeRO-3's gathered) are the module weights its forward
        multiplies with, in the engine's dtype (its fp32 masters stay in the optimizer)."""
        return None

    def _forward(self, batch: Batch) -> torch.Tensor:
        return model_scores(self.engine, batch, self.engine.device, value_model=self.head is None)

    def logprobs(self, rollouts: Rollouts, micro_batch_size: int | None = None, *,
                 layout: MicroBatching | None = None) -> torch.Tensor:
        return score_rollouts(self._forward, self.head, rollouts, self.sampling,
                              (layout or self.batching).sized(micro_batch_size),
                              self.pad_id)

    def logprobs_with_entropy(self, rollouts: Rollouts) -> tuple[torch.Tensor, torch.Tensor]:
        return score_with_entropy(self._forward, self.head, rollouts, self.sampling, self.batching, self.pad_id)

    def begin_update(self, rollouts: Rollouts, rows: list[int]) -> DeepSpeedUpdate:
        return DeepSpeedUpdate(self, rollouts, rows)

    @property
    def model(self) -> torch.nn.Module:
        """The transformers model inside the engine (`trainer.model`, as on the torch and FSDP trainers)."""
        return self.engine.module

    @property
    def generates_in_place(self) -> bool:
        """Whether `model` can generate the trained policy as it is (the evaluation then needs no copy of it,
        rlmm/run/evaluation.py's `Evaluation`): ZeRO-0/1/2 keep every full weight on each rank, ZeRO-3 only its
        partitions; not a value model, nor with padding-free attention or fake quantization installed."""
        return (self.engine.zero_optimization_stage() < 3 and self.head is not None and not self.batching.padding_free
                and not self.fake_quantization.installed)

    def state_dict(self) -> Mapping[str, torch.Tensor]:
        """Full Hugging Face-named weights on every rank, ZeRO-3's gathered as they are read (a collective;
        `deepspeed_checkpoint.full_weights`)."""
        return deepspeed_checkpoint.full_weights(self.engine)

    @staticmethod
    def safe_checkpoint_types() -> list[type]:
        return checkpoint_types()

    def checkpoint_state(self) -> dict:
        """This rank's optimizer, LR schedule, step counters (and fp32 head): `deepspeed_checkpoint`."""
        return deepspeed_checkpoint.checkpoint_state(self.engine, self.head_optimizer)

    def load_checkpoint(self, weights: dict[str, torch.Tensor], rank_states: list[dict]) -> None:
        """Restore the state `state_dict()` and every rank's `checkpoint_state()` saved (same world size)."""
        deepspeed_checkpoint.load_checkpoint(self.engine, self.head_optimizer, weights, rank_states)

    def close(self) -> None:
        """Release the engine and DeepSpeed's handle on the process group (which may be the one
        in-process vLLM created and is about to destroy)."""
        self.engine.destroy()
        del self.engine
        release_groups()


class DeepSpeedUpdate(MicroBatchedUpdate):
    """One optimizer step of `DeepSpeedTrainer` (see `MinibatchUpdate`). DeepSpeed steps its optimizer at
    the accumulation boundary, inside the last micro-batch's `backward`; `step()` then reports. The boundary
    is set here (`set_gradient_accumulation_boundary`) at the minibatch's last micro-batch, as
    `MicroBatching.split` cut it (a token budget makes the count vary per minibatch), not counted by the
    engine (its `gradient_accumulation_steps` is 1: rlmm/trainers/deepspeed_config.py). A
    non-finite gradient skips the step: rlmm/trainers/deepspeed_skip.py."""

    def __init__(self, trainer: DeepSpeedTrainer, rollouts: Rollouts, rows: list[int]):
        engine = trainer.engine
        super().__init__(trainer._forward, trainer.head, rollouts, rows, trainer.sampling, trainer.pad_id,
                         trainer.batching, trainer.budget, engine.module)
        self.trainer, self.engine, self.backwards = trainer, engine, 0
        self.own_norm: float | None = None  # ZeRO-0: DeepSpeed reports no norm, rlmm takes it
        self.lr = engine.get_lr()[0]  # the rate this step uses (the schedule advances inside engine.step)
        self.bad_step = BadStep(engine, self.lr, trainer.loss_scaled)
        # The scale this step's backward uses (DeepSpeed's fp16 optimizers, ZeRO or not).
        self.loss_scale = current_loss_scale(engine) if trainer.fp16 else None

    def backward(self, loss: torch.Tensor) -> None:
        engine, head = self.engine, self.trainer.head_optimizer
        self.backwards += 1
        # Reduce (ZeRO-1/2/3: partition) and step after the minibatch's last micro-batch, whatever the count.
        engine.set_gradient_accumulation_boundary(self.backwards == len(self.micro_batches))
        if self.trainer.scales_loss:  # ZeRO-0 fp16: the optimizer unscales a loss the engine did not scale
            loss = loss * self.loss_scale
        # The loss is already normalised by the whole minibatch: no extra 1/(micro-batch count).
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
        if self.bad_step.is_fault(head_finite, self.own_norm):
            self.bad_step.skip()
            return
        # A correction's factor on this step's rate: engine.step() steps the optimizer, then the schedule, which
        # writes the next step's rate (or, on an overflow, leaves this one's): its get_last_lr is put back.
        with scaled_lr(engine.optimizer.param_groups, self.lr_scale, settled=engine.lr_scheduler.get_last_lr):
            engine.step()

    def step(self) -> dict[str, float]:
        engine, head = self.engine, self.trainer.head_optimizer
        self._settled()
        if self.backwards != len(self.micro_batches):
            raise RuntimeError(f"DeepSpeedUpdate: step() after {self.backwards} of the minibatch's "
                               f"{len(self.micro_batches)} micro-batches")
        metrics = {"lr": self.lr * self.lr_scale}
        if self.loss_scale is not None:
            metrics["loss_scale"] = self.loss_scale
        norm = engine.get_global_grad_norm()
        metrics["grad_norm"] = (self.own_norm if self.own_norm is not None
                                else float(norm) if norm is not None else float("nan"))
        skipped = self.bad_step.settle()
        metrics.update(self.bad_step.metrics(skipped, self.loss_scale, self.trainer.min_loss_scale))
        if head:
            metrics["grad_norm"] = math.hypot(metrics["grad_norm"], head.norm)
            with scaled_lr(head.optimizer.param_groups, self.lr_scale, settled=head.schedule.get_last_lr):
                head.step(skip=skipped)
        return metrics
