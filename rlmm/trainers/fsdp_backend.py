"""`trainer=fsdp`: the training model sharded with PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`).

Each decoder layer is one FSDP unit and the root holds the rest (embeddings, final norm, LM head); with
several ranks every parameter is sharded over them, gathered for a unit's forward and backward, and its
gradient reduce-scattered (averaged over the ranks) after the backward. With one rank nothing is
sharded but the code path is the same.

Precision (`MixedPrecisionPolicy`): the parameters are stored in fp32 (they are AdamW's master copy)
and cast to the trainer side's dtype for each unit's forward and backward (`param_dtype`); gradients are
reduced over ranks in `reduce_dtype` (fp32 by default) and land on the fp32 shards. So bf16 and fp16
compute with an fp32 optimizer, as DeepSpeed's and `trainer=torch`'s mixed precision. An fp32 LM head
(`precision=*_fp32head`) is an FSDP unit of its own whose policy keeps fp32 (its input is cast up; a
head tied to the input embedding is untied by the fp32 copy, as on every backend). fp16 scales the loss
(`torch.amp.GradScaler`: an overflow skips the step and halves the scale, never below `MIN_LOSS_SCALE`,
where an overflow is a fault: rlmm/trainers/loss_scale.py).

Gradient accumulation: the gradient is reduced over ranks only after the minibatch's last micro-batch
(`set_requires_gradient_sync`), as DDP's `no_sync`. Until then FSDP2 sums each unit's unsharded
micro-batch gradients in `reduce_dtype` (`FSDPParam.to_accumulated_grad_if_needed` upcasts the first one
when it differs from the compute dtype; checked against torch 2.13), so with the default fp32 a bf16
body's gradients are summed in fp32 (`actual_precision["grad_accum_dtype"]`).
"""
from __future__ import annotations

import torch

from rlmm.models.head import install_output_head
from rlmm.models.loading import load_value_model, padding_id
from rlmm.policy.precision import SidePrecision, dtype_name, to_dtype
from rlmm.policy.quantization import NoQuantization, QuantizationMode
from rlmm.policy.rollouts import Rollouts, SamplingOptions
from rlmm.runtime.devices import init_process_group, select_device
from rlmm.trainers.fake_quantization import FakeQuantization
from rlmm.trainers.loss_scale import grad_scaler, grad_scaler_step
from rlmm.trainers.memory import ActivationBudget, optimizer_state_bytes, prepare_for_training
from rlmm.trainers.optim import linear_warmup
from rlmm.trainers.packing import Batch, MicroBatching, use_varlen_attention
from rlmm.trainers.scoring import model_scores, score_rollouts, score_with_entropy
from rlmm.trainers.update import MicroBatchedUpdate
from rlmm.trainers.weight_sync import GatheredWeights

REDUCE_DTYPES = ("fp32", "bf16", "fp16")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face model (each becomes one FSDP unit)."""
    for owner in (getattr(model, "model", None), getattr(model, "transformer", None)):
        layers = getattr(owner, "layers", None) if owner is not None else None
        if layers is None and owner is not None:
            layers = getattr(owner, "h", None)
        if layers is not None:
            return list(layers)
    raise ValueError(f"trainer=fsdp: cannot find the decoder layers of {type(model).__name__} "
                     "(expected model.layers or transformer.h)")


class FSDPTrainer:
    """Args:
        micro_batch_size: rollouts per forward pass.
        micro_batch_tokens: null, or micro-batches of at most this many tokens instead (rows longest first;
            every rank runs the same count: rlmm/trainers/packing.py).
        padding_free: each micro-batch's sequences packed into one row without padding (packing.py).
        lr, weight_decay: AdamW (on the fp32 shards).
        warmup_steps: linear learning-rate warm-up over this many optimizer steps (0: none).
        grad_clip: clip the global gradient norm to this (0: off).
        logits_chunk_size: response positions whose full-vocabulary logits exist at once while scoring.
        gradient_checkpointing: recompute each decoder layer in the backward pass (null: when an update's
            largest micro-batch would not fit otherwise).
        reduce_dtype: the dtype gradients are reduced over ranks in ("fp32", "bf16", "fp16").
        initial_loss_scale, loss_scale_growth_interval: fp16 dynamic loss scaling (ignored otherwise).
        fake_quantize: the forward multiplies with the weights the sampler serves, `quantization`'s
            dequantize(quantize(W)) (and rounds int8's layer inputs), straight-through gradients to the weights
            (rlmm/trainers/fake_quantization.py); refused where the forward's weights are not what is sent
            (`fake_quantize_refusal`). The policy only: a value model is never fake-quantized.
        value_head: a value model instead of the policy (PPO's critic; set by the app).
        quantization: (set by the app from `quantization=`) the mode the sampler serves; what `fake_quantize` uses.
        row_width: (set by the app for `sampler=bitwise`) every micro-batch one row right-padded to this many
            tokens and each head position projected alone (rlmm/trainers/packing.py, rlmm/models/head.py), or None.
    """

    def __init__(self, model_path: str, precision: SidePrecision, sampling: SamplingOptions, micro_batch_size: int,
                 lr: float, weight_decay: float, warmup_steps: int, grad_clip: float, logits_chunk_size: int,
                 gradient_checkpointing: bool | None, reduce_dtype: str, initial_loss_scale: float,
                 loss_scale_growth_interval: int, micro_batch_tokens: int | None, padding_free: bool,
                 fake_quantize: bool, value_head: bool = False, quantization: QuantizationMode = NoQuantization(),
                 row_width: int | None = None):
        import warnings

        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.batching = MicroBatching(micro_batch_size, micro_batch_tokens, padding_free, row_width)
        if not lr > 0:
            raise ValueError(f"trainer.lr: must be > 0, got {lr}")
        if reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"trainer.reduce_dtype: unknown dtype '{reduce_dtype}' (allowed: "
                             f"{', '.join(REDUCE_DTYPES)})")
        self.sampling, self.grad_clip = sampling, grad_clip
        self.device = select_device()
        init_process_group()
        # rlmm never changes a unit's output in place (it slices it), the case this warning is about.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        world = dist.get_world_size()
        mesh = init_device_mesh(self.device.type, (world,))
        compute = precision.dtype
        if value_head:  # PPO's critic: the policy's body with a scalar head (rlmm/run/critic.py)
            model, self.head = load_value_model(model_path, SidePrecision(torch.float32, False)), None
        else:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
            # An fp32 head is a copy of the checkpoint's (untied from the input embedding, as on every backend).
            fp32_head = model.get_output_embeddings().weight.detach().clone() if precision.fp32_head else None
            self.head = install_output_head(model, fp32=precision.fp32_head, chunk_size=logits_chunk_size,
                                            fp32_weight=fp32_head)
        if self.head is not None:  # the bitwise arm: a position's logits whatever is scored beside it
            self.head.positions_alone = row_width is not None
        if padding_free:
            use_varlen_attention(model, self.device, compute)
        prepare_for_training(model, gradient_checkpointing)
        reduce = to_dtype(reduce_dtype, "trainer.reduce_dtype")
        policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce)
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        if self.head is not None and self.head.fp32:
            fully_shard(self.head, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32,
                                                                             reduce_dtype=torch.float32))
        fully_shard(model, mesh=mesh, mp_policy=policy)
        self.model = model
        self.fake_quantization = FakeQuantization.of(model, model_path, quantization, fake_quantize and not value_head,
                                                     type(self), precision)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
        self.lr_schedule = linear_warmup(self.optimizer, warmup_steps)
        self.grad_scaler = grad_scaler(self.device, precision.dtype, initial_loss_scale, loss_scale_growth_interval)
        parameters = sum(p.numel() for p in model.parameters())
        self.budget = ActivationBudget(model.config, compute, self.device, gradient_checkpointing,
                                       optimizer_state_bytes(parameters // world, torch.float32))
        self.pad_id = padding_id(AutoTokenizer.from_pretrained(model_path), model_path)
        body = {p.dtype for p in model.parameters()}
        head_dtype = torch.float32 if self.head is not None and self.head.fp32 else compute
        self.actual_precision = {"dtype": dtype_name(compute), "head_dtype": dtype_name(head_dtype),
                                 "master_dtype": "/".join(sorted(dtype_name(d) for d in body)),
                                 "grad_accum_dtype": reduce_dtype, "reduce_dtype": reduce_dtype,
                                 **self.fake_quantization.report()}

    @staticmethod
    def unsupported(precision: SidePrecision) -> str | None:
        """None: FSDP2's mixed precision casts to any of rlmm's dtypes on CPU and GPU."""
        return None

    @staticmethod
    def fake_quantize_refusal(quantization: QuantizationMode, precision: SidePrecision) -> str | None:
        """FSDP sends its fp32 masters (`state_dict()`) but its forward holds them cast to `param_dtype`: the sampler's
        quantization of what is sent is the forward's only where both are one tensor of the source, an fp32 trainer
        or `quantization.source=bf16` with a bf16 trainer (the fp32 master inside the forward would need FSDP2 to
        gather fp32 and cast after the quantization, which its mixed precision does not do)."""
        if precision.dtype == torch.float32 or quantization.source_dtype == precision.dtype:
            return None
        return (f"trainer.fake_quantize=true: trainer=fsdp sends its fp32 masters and multiplies with them cast to "
                f"{precision.name}, so its forward cannot quantize what quantization.source={quantization.source} "
                "quantizes (runs: quantization.source=bf16 with a bf16 trainer, or an fp32 trainer)")

    def _forward(self, batch: Batch) -> torch.Tensor:
        return model_scores(self.model, batch, self.device, value_model=self.head is None)

    def logprobs(self, rollouts: Rollouts, micro_batch_size: int | None = None, *,
                 layout: MicroBatching | None = None) -> torch.Tensor:
        return score_rollouts(self._forward, self.head, rollouts, self.sampling,
                              (layout or self.batching).sized(micro_batch_size),
                              self.pad_id)

    def logprobs_with_entropy(self, rollouts: Rollouts) -> tuple[torch.Tensor, torch.Tensor]:
        return score_with_entropy(self._forward, self.head, rollouts, self.sampling, self.batching, self.pad_id)

    def begin_update(self, rollouts: Rollouts, rows: list[int]) -> FSDPUpdate:
        return FSDPUpdate(self, rollouts, rows)

    @property
    def generates_in_place(self) -> bool:
        """Whether `model` can generate the trained policy as it is (the evaluation then needs no copy of it,
        rlmm/run/evaluation.py's `Evaluation`): over one rank, where each unit's "shard" is the whole parameter and its
        all-gather a local cast to the compute dtype; not over several (a forward on rank 0 alone would wait
        for the others' shards), not a value model, nor with padding-free attention or fake quantization installed."""
        import torch.distributed as dist

        return (dist.get_world_size() == 1 and self.head is not None and not self.batching.padding_free
                and not self.fake_quantization.installed)

    def state_dict(self) -> GatheredWeights:
        """Full Hugging Face-named fp32 weights, each gathered from its shards as it is read (a collective:
        every rank reads them all in one order, as a weight sync does; each rank's sampler casts them to its
        own dtype). One tensor at a time: the sync's extra peak is the largest tensor, not the model."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return GatheredWeights(get_model_state_dict(self.model))

    def checkpoint_state(self) -> dict:
        """The optimizer state as `torch.distributed.checkpoint.state_dict` shards it (each moment a DTensor:
        `rlmm.run.checkpoint` writes those with `torch.distributed.checkpoint`, each rank its own shard), the
        schedule and the loss scaler."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return {"optimizer": get_optimizer_state_dict(self.model, self.optimizer),
                "lr_schedule": self.lr_schedule.state_dict(), "grad_scaler": self.grad_scaler.state_dict()}

    def load_checkpoint(self, weights: dict[str, torch.Tensor], rank_states: list[dict]) -> None:
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        if len(rank_states) != dist.get_world_size():
            raise ValueError(f"train.resume: the checkpoint was written by {len(rank_states)} ranks, this run has "
                             f"{dist.get_world_size()} (resume with the same number of ranks)")
        own = rank_states[dist.get_rank()]
        set_model_state_dict(self.model, weights, options=StateDictOptions(full_state_dict=True))
        set_optimizer_state_dict(self.model, self.optimizer, own["optimizer"])
        self.lr_schedule.load_state_dict(own["lr_schedule"])
        if self.grad_scaler.is_enabled():
            self.grad_scaler.load_state_dict(own["grad_scaler"])

    @staticmethod
    def safe_checkpoint_types() -> list[type]:
        return []

    def close(self) -> None:
        del self.model, self.optimizer


class FSDPUpdate(MicroBatchedUpdate):
    """One optimizer step of `FSDPTrainer` (see `MinibatchUpdate`). The gradient is reduced over ranks
    with the last micro-batch's backward; a non-finite gradient norm skips the step (weights, optimizer
    state and schedule unchanged; fp16 halves its loss scale): metrics["loss_scale_skipped"] = 1 for an
    fp16 overflow at a scale above `MIN_LOSS_SCALE`, else metrics["skipped"] = 1, a fault
    (rlmm/trainers/loss_scale.py)."""

    def __init__(self, trainer: FSDPTrainer, rollouts: Rollouts, rows: list[int]):
        trainer.optimizer.zero_grad(set_to_none=True)
        super().__init__(trainer._forward, trainer.head, rollouts, rows, trainer.sampling, trainer.pad_id,
                         trainer.batching, trainer.budget, trainer.model)
        self.trainer, self.backwards = trainer, 0

    def backward(self, loss: torch.Tensor) -> None:
        self.backwards += 1
        # Reduce-scatter once, after the minibatch's last micro-batch (its gradient is the sum of theirs).
        self.trainer.model.set_requires_gradient_sync(self.backwards == len(self.micro_batches))
        self.trainer.grad_scaler.scale(loss).backward()

    def step(self) -> dict[str, float]:
        trainer = self.trainer
        self._settled()
        scaler, optimizer = trainer.grad_scaler, trainer.optimizer
        return grad_scaler_step(scaler, optimizer, trainer.lr_schedule, trainer.model.parameters(), trainer.grad_clip,
                                self.lr_scale,
                                lambda: scaler.step(optimizer) if scaler.is_enabled() else optimizer.step())
