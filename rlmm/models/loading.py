"""Load a Hugging Face causal LM under a side's precision, and report what it really runs in."""
from __future__ import annotations

import torch
from torch import nn

from rlmm.precision import SidePrecision, dtype_name


class FP32Head(nn.Module):
    """LM head whose weight is kept and applied in fp32, whatever the body's dtype.

    The hidden state is upcast before the projection, so the logits carry no 16-bit rounding from
    the head (MiniMax-M1, 2025). The weight is a separate fp32 copy, which also unties a head tied to
    the input embedding; `load_state_dict` updates it through the usual `lm_head.weight` name.
    """

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().to(torch.float32).clone(), requires_grad=weight.requires_grad)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(hidden.to(torch.float32), self.weight)


def install_fp32_head(model: nn.Module, fp32_weight: torch.Tensor | None = None) -> None:
    """Swap `model`'s output projection for an FP32Head (from `fp32_weight` when given: the
    checkpoint's own fp32 values, not a 16-bit copy cast back up)."""
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("fp32 LM head: heads with a bias are not supported")
    model.set_output_embeddings(FP32Head(head.weight if fp32_weight is None else fp32_weight))
    model.config.tie_word_embeddings = False


def load_causal_lm(path: str, side: SidePrecision, *, trainable: bool = False) -> nn.Module:
    from transformers import AutoModelForCausalLM

    dtype = side.torch_dtype
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32 if side.fp32_head else dtype)
    if side.fp32_head:
        fp32_head = model.get_output_embeddings().weight.detach().clone()
        model.to(dtype)
        install_fp32_head(model, fp32_head)
    model.train(trainable)
    model.requires_grad_(trainable)
    return model


def model_precision(model: nn.Module) -> dict[str, str]:
    """The dtypes a loaded model's body and head parameters actually have."""
    head = model.get_output_embeddings()
    head_ids = {id(p) for p in head.parameters()}
    body = {p.dtype for p in model.parameters() if id(p) not in head_ids}
    return {"dtype": "/".join(sorted(dtype_name(d) for d in body)),
            "head_dtype": dtype_name(head.weight.dtype)}


def padding_id(tokenizer, model_path: str) -> int:
    """The id to pad batches with: the tokenizer's pad token, else its end-of-sequence token (the usual
    choice for decoder-only models; padded positions are masked either way)."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return token_id
    raise ValueError(f"model.path: the tokenizer of '{model_path}' has neither a pad token nor an end-of-sequence "
                     f"token (set pad_token or eos_token in its tokenizer_config.json)")
