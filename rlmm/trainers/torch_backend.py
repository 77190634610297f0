"""`trainer=torch`: the training model in plain PyTorch (a baseline to compare DeepSpeed against)."""
from __future__ import annotations

import torch

from rlmm.models.loading import load_causal_lm, model_precision
from rlmm.precision import SidePrecision
from rlmm.samplers.base import Rollouts, SamplingOptions
from rlmm.trainers.scoring import score_rollouts


class TorchTrainer:
    """Args:
        micro_batch_size: rollouts per forward pass when scoring (batch shape changes the numerics).
    """

    def __init__(self, model_path: str, precision: SidePrecision, sampling: SamplingOptions, micro_batch_size: int):
        from transformers import AutoTokenizer

        if micro_batch_size < 1:
            raise ValueError(f"trainer.micro_batch_size: must be >= 1, got {micro_batch_size}")
        self.sampling = sampling
        self.micro_batch_size = micro_batch_size
        self.model = load_causal_lm(model_path, precision)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.actual_precision = model_precision(self.model)

    def _forward(self, ids: torch.Tensor, attention: torch.Tensor, keep: int) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=attention, logits_to_keep=keep, use_cache=False).logits

    def logprobs(self, rollouts: Rollouts, micro_batch_size: int | None = None) -> torch.Tensor:
        return score_rollouts(self._forward, rollouts, self.sampling, micro_batch_size or self.micro_batch_size,
                              self.pad_id)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def close(self) -> None:
        del self.model
