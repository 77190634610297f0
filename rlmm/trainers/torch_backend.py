"""`trainer=torch`: the training model in plain PyTorch (a baseline to compare DeepSpeed against).

Mixed precision as DeepSpeed does it (Micikevicius et al. 2018, "Mixed Precision Training"): the
model's weights are in the trainer's dtype, so scoring and the training forward/backward run in
bf16/fp16, while AdamW updates an fp32 master copy that is cast back into the model after each step.
Why the master copy: an AdamW step of lr 3e-5 on a weight of 0.05 is a relative change of 6e-4,
below bf16's unit roundoff (3.9e-3), so 16-bit weights would round most updates away.
fp16 also needs loss scaling (its smallest normal is 6.1e-5, so small gradients flush to zero):
`torch.amp.GradScaler` scales the loss, unscales the master gradients, and on an overflow skips the
step and halves the scale (doubling it after `loss_scale_growth_interval` clean steps; never below
`MIN_LOSS_SCALE`, where an overflow is a fault: rlmm/trainers/loss_scale.py).

Gradient accumulation: autograd sums a minibatch's micro-batch gradients in each parameter's `.grad`,
in the parameter's dtype: in bf16 a micro-batch's contribution below half a unit in the last place of
the running sum (2^-9 of it) is lost. `grad_accum_dtype: fp32` adds each micro-batch's 16-bit gradient
to the fp32 master gradient instead (4 bytes a parameter held through the backward passes, not only at
the step), and the ranks average the fp32 sums.
"""
from __future__ import annotations

import torch

from rlmm.models.loading import load_causal_lm, load_value_model, model_precision, padding_id
from rlmm.policy.precision import SidePrecision, dtype_name
from rlmm.policy.quantization import NoQuantization, QuantizationMode
from rlmm.policy.rollouts import Rollouts, SamplingOptions
from rlmm.runtime.collectives import average_over_ranks
from rlmm.runtime.devices import select_device
from rlmm.trainers.fake_quantization import FakeQuantization
from rlmm.trainers.loss_scale import grad_scaler, grad_scaler_step
from rlmm.trainers.memory import ActivationBudget, optimizer_state_bytes, prepare_for_training
from rlmm.trainers.optim import linear_warmup
from rlmm.trainers.packing import Batch, MicroBatching, use_varlen_attention
from rlmm.trainers.scoring import model_scores, score_rollouts, score_with_entropy
from rlmm.trainers.update import MicroBatchedUpdate


GRAD_ACCUM_DTYPES = (None, "fp32")


class TorchTrainer:
    """Args:
        micro_batch_size: rollouts per forward pass (batch shape changes the numerics).
        micro_batch_tokens: null, or micro-batches of at most this many tokens instead (rows longest first;
            rlmm/trainers/packing.py).
        padding_free: each micro-batch's sequences packed into one row without padding (packing.py).
        lr, weight_decay: AdamW.
        warmup_steps: linear learning-rate warm-up over this many optimizer steps (0: none).
        grad_clip: clip the global gradient norm to this (0: off).
        logits_chunk_size: response positions whose full-vocabulary logits exist at once while scoring
            (rlmm/models/head.py).
        gradient_checkpointing: recompute each decoder layer in the backward pass instead of keeping its
            activations (null: for an update whose largest micro-batch would not fit otherwise).
        initial_loss_scale, loss_scale_growth_interval: fp16 dynamic loss scaling (ignored otherwise).
        grad_accum_dtype: what a minibatch's micro-batch gradients are summed in: null, the parameters'
            dtype (autograd's `.grad`); fp32, the fp32 master copy's (16-bit bodies; fp32 is already fp32).
        fake_quantize: the forward multiplies with the weights the sampler serves, `quantization`'s
            dequantize(quantize(W)) (and rounds int8's layer inputs), straight-through gradients to the weights
            (rlmm/trainers/fake_quantization.py). The policy only: a value model is never fake-quantized.
        value_head: a value model instead of the policy (PPO's critic, rlmm/run/critic.py; set by the app).
        quantization: (set by the app from `quantization=`) the mode the sampler serves; what `fake_quantize` uses.
        row_width: (set by the app for `sampler=bitwise`) every micro-batch one row right-padded to this many
            tokens and each head position projected alone (rlmm/trainers/packing.py, rlmm/models/head.py), or None.

    Several ranks (torchrun, SLURM tasks): each holds a full replica on its own device and the gradients
    are averaged over the ranks before each step (`average_over_ranks`), as DDP does.
    """

    def __init__(self, model_path: str, precision: SidePrecision, sampling: SamplingOptions, micro_batch_size: int,
                 lr: float, weight_decay: float, warmup_steps: int, grad_clip: float, logits_chunk_size: int,
                 gradient_checkpointing: bool | None, initial_loss_scale: float, loss_scale_growth_interval: int,
                 grad_accum_dtype: str | None, micro_batch_tokens: int | None, padding_free: bool,
                 fake_quantize: bool, value_head: bool = False, quantization: QuantizationMode = NoQuantization(),
                 row_width: int | None = None):
        from transformers import AutoTokenizer

        self.batching = MicroBatching(micro_batch_size, micro_batch_tokens, padding_free, row_width)
        if not lr > 0:
            raise ValueError(f"trainer.lr: must be > 0, got {lr}")
        if grad_accum_dtype not in GRAD_ACCUM_DTYPES:
            raise ValueError(f"trainer.grad_accum_dtype: unknown dtype '{grad_accum_dtype}' (allowed: null, fp32)")
        self.sampling = sampling
        self.grad_clip = grad_clip
        self.device = select_device()
        if value_head:  # PPO's critic: the policy's body with a scalar head (rlmm/run/critic.py)
            self.model, self.head = load_value_model(model_path, precision, device=self.device), None
        else:
            self.model = load_causal_lm(model_path, precision, trainable=True, logits_chunk_size=logits_chunk_size,
                                        device=self.device)
            self.head = self.model.get_output_embeddings()
        if self.head is not None:  # the bitwise arm: a position's logits whatever is scored beside it
            self.head.positions_alone = row_width is not None
        if padding_free:
            use_varlen_attention(self.model, self.device, precision.dtype)
        prepare_for_training(self.model, gradient_checkpointing)
        self.fake_quantization = FakeQuantization.of(self.model, model_path, quantization,
                                                     fake_quantize and not value_head, type(self), precision)
        params = list(self.model.parameters())
        # fp32 weights are their own master copy; 16-bit ones get one in fp32 for AdamW to update.
        self.master_params = None if all(p.dtype == torch.float32 for p in params) else [
            p.detach().float().clone().requires_grad_(True) for p in params]
        self.optimized_params = self.master_params or params
        # fp32 accumulation: each micro-batch's 16-bit gradients move to the master copy as they are made.
        self.accumulate_in_master = grad_accum_dtype == "fp32" and self.master_params is not None
        self.optimizer = torch.optim.AdamW(self.optimized_params, lr=lr, weight_decay=weight_decay)
        self.grad_scaler = grad_scaler(self.device, precision.dtype, initial_loss_scale, loss_scale_growth_interval)
        self.lr_schedule = linear_warmup(self.optimizer, warmup_steps)
        self.budget = ActivationBudget(self.model.config, precision.dtype, self.device, gradient_checkpointing,
                                       optimizer_state_bytes(sum(p.numel() for p in params), precision.dtype))
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = padding_id(tokenizer, model_path)
        body = model_precision(self.model)
        summed = dtype_name(torch.float32) if self.accumulate_in_master else body["dtype"]
        # grad_accum_dtype: the dtype a minibatch's micro-batch gradients are summed in (an fp32 head's: fp32);
        # reduce_dtype: the dtype the ranks average them in (`average_over_ranks`, before the step).
        self.actual_precision = {**body, "grad_accum_dtype": summed, "reduce_dtype": summed,
                                 **self.fake_quantization.report()}

    def _forward(self, batch: Batch) -> torch.Tensor:
        return model_scores(self.model, batch, self.device, value_model=self.head is None)

    def logprobs(self, rollouts: Rollouts, micro_batch_size: int | None = None, *,
                 layout: MicroBatching | None = None) -> torch.Tensor:
        return score_rollouts(self._forward, self.head, rollouts, self.sampling,
                              (layout or self.batching).sized(micro_batch_size),
                              self.pad_id)

    def logprobs_with_entropy(self, rollouts: Rollouts) -> tuple[torch.Tensor, torch.Tensor]:
        return score_with_entropy(self._forward, self.head, rollouts, self.sampling, self.batching, self.pad_id)

    def begin_update(self, rollouts: Rollouts, rows: list[int]) -> TorchUpdate:
        return TorchUpdate(self, rollouts, rows)

    @property
    def generates_in_place(self) -> bool:
        """Whether `model` can generate the trained policy as it is (the evaluation then needs no copy of it,
        rlmm/run/evaluation.py's `Evaluation`): every rank holds the full weights; not a value model, nor with
        padding-free attention or fake quantization installed."""
        return self.head is not None and not self.batching.padding_free and not self.fake_quantization.installed

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def checkpoint_state(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "lr_schedule": self.lr_schedule.state_dict(),
                "grad_scaler": self.grad_scaler.state_dict(),
                "master_params": [p.detach() for p in self.master_params or []]}

    def load_checkpoint(self, weights: dict[str, torch.Tensor], rank_states: list[dict]) -> None:
        state = rank_states[0]
        self.model.load_state_dict(weights)
        self.optimizer.load_state_dict(state["optimizer"])
        self.lr_schedule.load_state_dict(state["lr_schedule"])
        if self.master_params is not None:
            with torch.no_grad():
                for master, saved in zip(self.master_params, state["master_params"], strict=True):
                    master.copy_(saved)
        if self.grad_scaler.is_enabled():
            self.grad_scaler.load_state_dict(state["grad_scaler"])

    @staticmethod
    def safe_checkpoint_types() -> list[type]:
        return []

    @staticmethod
    def unsupported(precision: SidePrecision) -> str | None:
        """None: torch runs every precision on every device (fp16 and bf16 CPU kernels exist)."""
        return None

    @staticmethod
    def fake_quantize_refusal(quantization: QuantizationMode, precision: SidePrecision) -> str | None:
        """None: the weights it sends are the module weights its forward multiplies with."""
        return None

    def close(self) -> None:
        del self.model, self.optimizer, self.master_params


class TorchUpdate(MicroBatchedUpdate):
    """One optimizer step of `TorchTrainer` (see `MinibatchUpdate`). A non-finite gradient norm (an fp16
    overflow, a NaN) skips the step: weights, optimizer state and the LR schedule stay as they were; in
    fp16 the loss scale halves, and an overflow at a scale above `MIN_LOSS_SCALE` is the scaler's normal
    business (metrics["loss_scale_skipped"] = 1), any other a fault (metrics["skipped"] = 1;
    rlmm/trainers/loss_scale.py)."""

    def __init__(self, trainer: TorchTrainer, rollouts: Rollouts, rows: list[int]):
        trainer.optimizer.zero_grad(set_to_none=True)
        super().__init__(trainer._forward, trainer.head, rollouts, rows, trainer.sampling, trainer.pad_id,
                         trainer.batching, trainer.budget, trainer.model)
        self.trainer = trainer

    def backward(self, loss: torch.Tensor) -> None:
        self.trainer.grad_scaler.scale(loss).backward()
        if self.trainer.accumulate_in_master:
            self._to_master(accumulate=True)

    def _to_master(self, accumulate: bool) -> None:
        """Move the model's 16-bit gradients to the fp32 master copy: added to its sum (fp32 accumulation),
        or as the whole minibatch's (accumulated in 16 bits)."""
        for master, param in zip(self.trainer.master_params, self.trainer.model.parameters()):
            if param.grad is not None:
                if accumulate and master.grad is not None:
                    master.grad.add_(param.grad)
                else:
                    master.grad = param.grad.float()
                param.grad = None

    def step(self) -> dict[str, float]:
        trainer = self.trainer
        self._settled()
        if trainer.accumulate_in_master:
            average_over_ranks([p.grad for p in trainer.master_params if p.grad is not None])
        else:
            average_over_ranks([p.grad for p in trainer.model.parameters() if p.grad is not None])
            if trainer.master_params is not None:  # the 16-bit gradients move to the fp32 master copy
                self._to_master(accumulate=False)
        return grad_scaler_step(trainer.grad_scaler, trainer.optimizer, trainer.lr_schedule, trainer.optimized_params,
                                trainer.grad_clip, self.lr_scale, self._step_master)

    def _step_master(self) -> None:
        """AdamW's step on the fp32 master copy (the weights themselves when they are fp32), cast into the model."""
        trainer = self.trainer
        trainer.optimizer.step()
        if trainer.master_params is not None:
            with torch.no_grad():
                for master, param in zip(trainer.master_params, trainer.model.parameters()):
                    param.copy_(master)
