"""What the trainers need to know about memory: activations per token, memory free now, dropout off.

The one-pass step (`train.reuse_training_forward`) forwards every micro-batch of a minibatch before the
first backward, so it holds every micro-batch's activations at once. `OnePassBudget` decides, per
minibatch, whether that fits; when it does not, the trainer scores first (one more no-grad forward)
and frees each graph as usual. The estimate of activations per token for a decoder layer, saved for the
backward pass (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", counted for a gated MLP and fused attention that keeps no score matrix):

    bytes/token ≈ layers x (8 h + 4 i) x bytes per element      (h hidden, i MLP intermediate size)
    with gradient checkpointing: layers x h x bytes per element  (each layer's input only)

e.g. Qwen2.5-0.5B in bf16: 24 x (8·896 + 4·4864) x 2 = 1.3 MB per token; 32 rows of 650 tokens = 27 GB.
It is an estimate: `train.reuse_training_forward=false` always scores first.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)


def activation_bytes_per_token(config, dtype: torch.dtype, gradient_checkpointing: bool) -> int:
    """Estimated bytes of activations one token keeps for the backward pass (see the module docstring)."""
    hidden = config.hidden_size
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    per_element = torch.finfo(dtype).bits // 8
    per_layer = hidden if gradient_checkpointing else 8 * hidden + 4 * intermediate
    return config.num_hidden_layers * per_layer * per_element


def free_bytes(device: torch.device) -> int:
    """Memory free on `device` now: the GPU's (cudaMemGetInfo), or the machine's available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


class OnePassBudget:
    """`fits(tokens)`: whether holding `tokens` tokens' activations takes at most `share` of the memory
    free now. Says so in the log the first time it answers no."""

    def __init__(self, bytes_per_token: int, device: torch.device, share: float = 0.5):
        self.bytes_per_token, self.device, self.share = bytes_per_token, device, share
        self.warned = False

    def __call__(self, tokens: int) -> bool:
        needed, free = tokens * self.bytes_per_token, free_bytes(self.device)
        fits = needed <= self.share * free
        if not fits and not self.warned:
            log.info("one-pass step: holding %d tokens' activations (~%.1f GB) would take more than %.0f%% of the "
                     "%.1f GB free; scoring first instead (one more no-grad forward)", tokens, needed / 1e9,
                     100 * self.share, free / 1e9)
            self.warned = True
        return fits


def prepare_for_training(model: nn.Module, gradient_checkpointing: bool) -> None:
    """Dropout off everywhere, so that scoring and training compute the same function; with gradient
    checkpointing (transformers recomputes each decoder layer in the backward pass instead of keeping its
    activations; it only acts in train mode) the model is put in train mode, which without dropout
    computes what eval mode does."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    else:
        model.eval()
