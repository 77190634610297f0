"""`trainer=torch`: the training model in plain PyTorch (a baseline to compare DeepSpeed against).

Weights live in the trainer's dtype (no fp32 master copy): in bf16/fp16 this is "pure" low-precision
training, which is what a plain-PyTorch loop does without extra machinery. DeepSpeed keeps fp32
master weights; compare the two with `trainer=torch` vs `trainer=deepspeed`.
"""
from __future__ import annotations

import math

import torch

from rlmm.models.loading import load_causal_lm, model_precision, padding_id
from rlmm.precision import SidePrecision
from rlmm.samplers.base import Rollouts, SamplingOptions
from rlmm.trainers.optim import linear_warmup
from rlmm.trainers.scoring import LossFn, accumulate_gradients, score_rollouts


class TorchTrainer:
    """Args:
        micro_batch_size: rollouts per forward pass (batch shape changes the numerics).
        lr, weight_decay: AdamW.
        warmup_steps: linear learning-rate warm-up over this many optimizer steps (0: none).
        grad_clip: clip the global gradient norm to this (0: off).
    """

    def __init__(self, model_path: str, precision: SidePrecision, sampling: SamplingOptions, micro_batch_size: int,
                 lr: float = 1e-4, weight_decay: float = 0.0, warmup_steps: int = 0, grad_clip: float = 1.0,
                 accumulation_steps: int = 1):
        from transformers import AutoTokenizer

        if micro_batch_size < 1:
            raise ValueError(f"trainer.micro_batch_size: must be >= 1, got {micro_batch_size}")
        if not lr > 0:
            raise ValueError(f"trainer.lr: must be > 0, got {lr}")
        self.sampling = sampling
        self.micro_batch_size = micro_batch_size
        self.grad_clip = grad_clip
        self.dtype = precision.dtype
        self.model = load_causal_lm(model_path, precision, trainable=True)
        self.model.eval()  # no dropout: scoring and training see the same function
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay)
        self.lr_schedule = linear_warmup(self.optimizer, warmup_steps)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = padding_id(tokenizer, model_path)
        self.actual_precision = model_precision(self.model)

    def _forward(self, ids: torch.Tensor, attention: torch.Tensor, keep: int) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=attention, logits_to_keep=keep, use_cache=False).logits

    def logprobs(self, rollouts: Rollouts, micro_batch_size: int | None = None) -> torch.Tensor:
        return score_rollouts(self._forward, rollouts, self.sampling, micro_batch_size or self.micro_batch_size,
                              self.pad_id)

    def update(self, rollouts: Rollouts, rows: list[int], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on the minibatch `rows`: forward/backward per micro-batch, clip, step.
        A non-finite gradient norm skips the step (metrics["skipped"] = 1): weights, optimizer state
        and the LR schedule stay as they were."""
        if self.dtype == "fp16":
            # Seen here: weights and AdamW state in fp16 with no loss scaling reach inf/NaN within two
            # steps (AdamW's eps = 1e-8 is 0 in fp16). Scoring in fp16 is fine.
            raise ValueError("precision: trainer=torch cannot train in fp16 (weights and optimizer state would be "
                             "fp16, no loss scaling); allowed here for training: fp32, bf16")
        self.optimizer.zero_grad(set_to_none=True)
        metrics = accumulate_gradients(self._forward, torch.Tensor.backward, rollouts, rows, self.sampling,
                                       self.pad_id, self.micro_batch_size, loss_fn)
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        metrics["grad_norm"] = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm).item()
        metrics["lr"] = self.lr_schedule.get_last_lr()[0]
        metrics["skipped"] = float(not math.isfinite(metrics["grad_norm"]))
        if metrics["skipped"]:  # a NaN/Inf gradient never reaches the weights or AdamW's moments
            self.optimizer.zero_grad(set_to_none=True)
            return metrics
        self.optimizer.step()
        self.lr_schedule.step()
        return metrics

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def checkpoint_state(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "lr_schedule": self.lr_schedule.state_dict()}

    def load_checkpoint(self, weights: dict[str, torch.Tensor], rank_states: list[dict]) -> None:
        self.model.load_state_dict(weights)
        self.optimizer.load_state_dict(rank_states[0]["optimizer"])
        self.lr_schedule.load_state_dict(rank_states[0]["lr_schedule"])

    @staticmethod
    def safe_checkpoint_types() -> list[type]:
        return []

    def close(self) -> None:
        del self.model, self.optimizer
