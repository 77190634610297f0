"""Trainers that inject a numeric fault, for the tests (selected with `trainer._target_=tests.faults...`).

Each poisons the logits of its training forward passes (not of scoring) with NaN from optimizer step
`nan_from_update` on, so the loss and every gradient are NaN: exactly what an fp16 overflow or a bad
kernel does to a real run."""
from __future__ import annotations

import torch

from rlmm.policy.precision import SidePrecision
from rlmm.policy.quantization import NoQuantization, QuantizationMode
from rlmm.policy.rollouts import SamplingOptions
from rlmm.trainers.deepspeed_backend import DeepSpeedTrainer
from rlmm.trainers.torch_backend import TorchTrainer


class _NaNUpdates:
    nan_from_update = 1
    updates = 0
    poisoning = False

    def _forward(self, batch):
        logits = super()._forward(batch)
        return logits * torch.nan if self.poisoning else logits

    def begin_update(self, rollouts, rows):
        self.updates += 1
        self.poisoning = self.updates >= self.nan_from_update
        update = super().begin_update(rollouts, rows)
        step = update.step

        def step_then_stop_poisoning():
            try:
                return step()
            finally:
                self.poisoning = False

        update.step = step_then_stop_poisoning
        return update

    def logprobs(self, rollouts, micro_batch_size=None, *, layout=None):
        poisoning, self.poisoning = self.poisoning, False  # scoring is never poisoned
        try:
            return super().logprobs(rollouts, micro_batch_size, layout=layout)
        finally:
            self.poisoning = poisoning


# Explicit signatures: rlmm validates a trainer's config keys against its constructor's.
class NaNTorchTrainer(_NaNUpdates, TorchTrainer):
    def __init__(self, model_path: str, precision: SidePrecision, sampling: SamplingOptions, micro_batch_size: int,
                 lr: float, weight_decay: float, warmup_steps: int, grad_clip: float, logits_chunk_size: int,
                 gradient_checkpointing: bool | None, initial_loss_scale: float, loss_scale_growth_interval: int,
                 grad_accum_dtype: str | None, micro_batch_tokens: int | None, padding_free: bool,
                 fake_quantize: bool, nan_from_update: int = 1, quantization: QuantizationMode = NoQuantization(),
                 row_width: int | None = None):
        TorchTrainer.__init__(self, model_path, precision, sampling, micro_batch_size, lr=lr, weight_decay=weight_decay,
                              warmup_steps=warmup_steps, grad_clip=grad_clip, logits_chunk_size=logits_chunk_size,
                              gradient_checkpointing=gradient_checkpointing,
                              micro_batch_tokens=micro_batch_tokens, padding_free=padding_free,
                              initial_loss_scale=initial_loss_scale,
                              loss_scale_growth_interval=loss_scale_growth_interval, grad_accum_dtype=grad_accum_dtype,
                              fake_quantize=fake_quantize, quantization=quantization, row_width=row_width)
        self.nan_from_update = nan_from_update


class NaNDeepSpeedTrainer(_NaNUpdates, DeepSpeedTrainer):
    def __init__(self, model_path: str, precision: SidePrecision, sampling: SamplingOptions, micro_batch_size: int,
                 zero_stage: int, lr: float, weight_decay: float, warmup_steps: int, grad_clip: float,
                 logits_chunk_size: int, gradient_checkpointing: bool | None, initial_loss_scale: float,
                 loss_scale_growth_interval: int, grad_accum_dtype: str | None, reduce_dtype: str | None,
                 config_file: str | None, micro_batch_tokens: int | None, padding_free: bool, fake_quantize: bool,
                 nan_from_update: int = 1, quantization: QuantizationMode = NoQuantization(),
                 row_width: int | None = None):
        DeepSpeedTrainer.__init__(self, model_path, precision, sampling, micro_batch_size, zero_stage=zero_stage, lr=lr,
                                  weight_decay=weight_decay, warmup_steps=warmup_steps, grad_clip=grad_clip,
                                  logits_chunk_size=logits_chunk_size, gradient_checkpointing=gradient_checkpointing,
                                  initial_loss_scale=initial_loss_scale,
                                  loss_scale_growth_interval=loss_scale_growth_interval,
                                  grad_accum_dtype=grad_accum_dtype, reduce_dtype=reduce_dtype,
                                  config_file=config_file, micro_batch_tokens=micro_batch_tokens,
                                  padding_free=padding_free, fake_quantize=fake_quantize, quantization=quantization,
                                  row_width=row_width)
        self.nan_from_update = nan_from_update
