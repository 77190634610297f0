"""What the trainers need to know about memory: activations per token, memory free now, dropout off.

Two choices depend on whether a micro-batch's activations fit, and both are made per update from an
estimate (`ActivationBudget`):

- gradient checkpointing (`trainer.gradient_checkpointing: null`, the default): on for an update whose
  largest micro-batch would not fit without it; `true` / `false` force it;
- the one-pass step (`train.reuse_training_forward`) forwards every micro-batch of a minibatch before the
  first backward, so it holds all their activations at once; when they would not fit, the trainer scores
  first (one more no-grad forward) and frees each graph as usual.

Activations a decoder layer keeps per token for the backward pass (Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", counted for a gated MLP and fused attention that
keeps no score matrix):

    bytes/token ≈ Σ_layers (8 h + MLP) x bytes per element       (h hidden size)
      MLP of a dense layer:  4 i                                 (i its intermediate size)
      MLP of a sparse layer: 2 E + k (2 h + 4 i_e) + 4 i_s       (E experts, k of them per token, i_e each
                                                                  one's width, i_s a shared expert's, if any)
    with gradient checkpointing: layers x h x bytes per element  (each layer's input only)

A sparse layer keeps, for each of a token's k experts, the token's gathered input and the expert's output
(the routing weight's gradient needs it) besides the expert's own 4 i_e, and the router's logits and
probabilities (2 E). Counting it as a dense MLP of `intermediate_size` undercounts OLMoE's layers 4x (k = 8
experts of 1024 against one MLP of 1024) and the GPU experiment's micro-batches would have gone unchecked into
an out-of-memory. tests/test_head.py measures the bytes a forward saves for its backward
(`torch.autograd.graph.saved_tensors_hooks`) on dense and MoE layouts of transformers' models; the estimate is
0.8-0.95 of them.

e.g. Qwen2.5-0.5B in bf16: 24 x (8·896 + 4·4864) x 2 = 1.3 MB per token; 32 rows of 650 tokens = 27 GB;
OLMoE-1B-7B in bf16: 16 x (8·2048 + 2·64 + 8 (2·2048 + 4·1024)) x 2 = 2.6 MB per token.
"Fits" means at most half of the memory free now, less what the optimizer has yet to allocate (AdamW's
moments and the gradient buffers appear at the first update: `pending_bytes` until one has completed).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

log = logging.getLogger(__name__)


def activation_bytes_per_token(config, dtype: torch.dtype, gradient_checkpointing: bool) -> int:
    """Estimated bytes of activations one token keeps for the backward pass (see the module docstring)."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    per_element = torch.finfo(dtype).bits // 8
    if gradient_checkpointing:
        return layers * hidden * per_element
    return sum(8 * hidden + mlp_elements_per_token(config, layer) for layer in range(layers)) * per_element


def mlp_elements_per_token(config, layer: int) -> int:
    """The MLP's share of one token's activations in decoder layer `layer` (elements; module docstring).

    Reads the names transformers' MoE configs use: Qwen2/3-MoE (`num_experts`, `moe_intermediate_size`,
    `decoder_sparse_step`, `mlp_only_layers`, `shared_expert_intermediate_size`), Mixtral and OLMoE
    (`num_local_experts` / `num_experts` with `intermediate_size` per expert), DeepSeek (`n_routed_experts`,
    `n_shared_experts`, `first_k_dense_replace`)."""
    hidden = config.hidden_size
    dense = getattr(config, "intermediate_size", None) or 4 * hidden
    experts = next((value for name in ("num_experts", "num_local_experts", "n_routed_experts")
                    if (value := getattr(config, name, None))), 0)
    top_k = getattr(config, "num_experts_per_tok", None) or 0
    sparse = (experts > 0 and top_k > 0 and layer not in (getattr(config, "mlp_only_layers", None) or [])
              and (layer + 1) % (getattr(config, "decoder_sparse_step", None) or 1) == 0
              and layer >= (getattr(config, "first_k_dense_replace", None) or 0))
    if not sparse:
        return 4 * dense
    expert_width = getattr(config, "moe_intermediate_size", None) or dense
    shared = (getattr(config, "shared_expert_intermediate_size", None)
              or (getattr(config, "n_shared_experts", None) or 0) * expert_width)
    return 2 * experts + top_k * (2 * hidden + 4 * expert_width) + 4 * shared


def free_bytes(device: torch.device) -> int:
    """Memory free on `device` now: the GPU's (cudaMemGetInfo), or the machine's available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


class ActivationBudget:
    """Per update: whether to checkpoint, and whether the one-pass step may hold every graph.

    Args:
        config: the model's (hidden_size, num_hidden_layers, its MLP's sizes: `mlp_elements_per_token`).
        dtype: the trainer's body dtype.
        device: where the activations live.
        checkpointing: None (decide per update), True or False (always, never).
        pending_bytes: optimizer state not allocated yet (until `settled()` is called after an update).
        one_pass: whether the trainer may hold several graphs at all (false: always score first).
        share: the part of the free memory activations may take.
    """

    def __init__(self, config, dtype: torch.dtype, device: torch.device, checkpointing: bool | None,
                 pending_bytes: int, one_pass: bool = True, share: float = 0.5):
        self.per_token = {flag: activation_bytes_per_token(config, dtype, flag) for flag in (False, True)}
        self.device, self.mode, self.pending, self.share = device, checkpointing, pending_bytes, share
        self.one_pass = one_pass
        self.said: set[str] = set()

    def for_update(self, model: nn.Module, tokens_per_micro_batch: list[int]) -> Callable[[int], bool]:
        """Set `model`'s gradient checkpointing for this update (from its largest micro-batch) and return
        the `graphs_fit` that `accumulate_gradients` asks before holding every graph."""
        checkpointing = self.checkpointing(max(tokens_per_micro_batch))
        set_gradient_checkpointing(model, checkpointing)
        return self.graphs_fit(checkpointing) if self.one_pass else (lambda tokens: False)

    def room(self) -> float:
        return self.share * max(0, free_bytes(self.device) - self.pending)

    def checkpointing(self, micro_batch_tokens: int) -> bool:
        """Whether this update checkpoints: as configured, or when its largest micro-batch does not fit."""
        if self.mode is not None:
            return self.mode
        needed, room = micro_batch_tokens * self.per_token[False], self.room()
        on = needed > room
        self._say("checkpointing" if on else "", f"gradient checkpointing on: a micro-batch of {micro_batch_tokens} "
                  f"tokens keeps ~{needed / 1e9:.1f} GB of activations, more than the {room / 1e9:.1f} GB it may "
                  f"take (trainer.gradient_checkpointing=false to refuse)")
        return on

    def graphs_fit(self, checkpointing: bool):
        """For `accumulate_gradients(graphs_fit=...)`: whether a minibatch's `tokens` may all be held."""
        def fits(tokens: int) -> bool:
            needed, room = tokens * self.per_token[checkpointing], self.room()
            ok = needed <= room
            self._say("" if ok else "scoring first", f"one-pass step: holding {tokens} tokens' activations "
                      f"(~{needed / 1e9:.1f} GB) would take more than the {room / 1e9:.1f} GB they may; scoring "
                      f"first instead (one more no-grad forward)")
            return ok
        return fits

    def settled(self) -> None:
        """An update has completed: the optimizer's state is allocated and counted in the free memory."""
        self.pending = 0

    def _say(self, key: str, message: str) -> None:
        if key and key not in self.said:
            log.info(message)
            self.said.add(key)


def optimizer_state_bytes(parameters: int, dtype: torch.dtype) -> int:
    """What the first update allocates: AdamW's two fp32 moments, and the gradients (16-bit ones plus an
    fp32 copy under a 16-bit body, fp32 otherwise)."""
    gradients = 4 if dtype == torch.float32 else 2 + 4
    return parameters * (8 + gradients)


def set_gradient_checkpointing(model: nn.Module, on: bool) -> None:
    """transformers' gradient checkpointing: each decoder layer is recomputed in the backward pass instead
    of keeping its activations (it acts only in train mode; see `prepare_for_training`)."""
    if on == bool(getattr(model, "is_gradient_checkpointing", False)):
        return
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def prepare_for_training(model: nn.Module, gradient_checkpointing: bool | None) -> None:
    """Dropout off everywhere, so that scoring and training compute the same function. Gradient
    checkpointing acts only in train mode, so a model that may checkpoint (`true`, or `null`: decided per
    update) is put in train mode, which without dropout computes what eval mode does."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    set_gradient_checkpointing(model, bool(gradient_checkpointing))
    model.train(gradient_checkpointing is not False)
