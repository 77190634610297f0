"""Load a Hugging Face causal LM under a side's precision, and report what it really runs in."""
from __future__ import annotations

import torch
from torch import nn

from rlmm.models.head import install_output_head
from rlmm.policy.precision import SidePrecision, dtype_name


def load_tokenizer(model_path: str):
    """The checkpoint's tokenizer as it encodes text. A built-in model (rlmm wrote it: `rlmm_model.json` beside it) is
    read as its tokenizer.json says, through `PreTrainedTokenizerFast`: transformers' AutoTokenizer gives every Qwen2
    checkpoint its `Qwen2Tokenizer`, which rebuilds a BPE tokenizer's pipeline as Qwen's byte-level one (read in
    transformers 5.19, models/auto/tokenization_auto.py: MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS), so the built-in
    BPE model's text would encode to other ids (its special tokens keep theirs: an engine that only reads the
    end-of-sequence id, vLLM's, may load it its own way). Any other checkpoint: AutoTokenizer's choice."""
    from pathlib import Path

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if (Path(model_path) / "rlmm_model.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(model_path)
    return AutoTokenizer.from_pretrained(model_path)


def checkpoint_ties_head(model_path: str) -> bool:
    """Whether the checkpoint's config ties its LM head to the input embedding (Qwen2.5-0.5B's does)."""
    from transformers import AutoConfig

    return bool(getattr(AutoConfig.from_pretrained(model_path).get_text_config(), "tie_word_embeddings", False))


def checkpoint_positions(model_path: str) -> int | None:
    """The checkpoint's positions (config.json's `max_position_embeddings`, a multimodal model's text one; None
    where it names none)."""
    from transformers import AutoConfig

    positions = getattr(AutoConfig.from_pretrained(model_path).get_text_config(), "max_position_embeddings", None)
    return None if positions is None else int(positions)


def checkpoint_vocab_size(model_path: str) -> int:
    """The checkpoint's vocabulary: its LM head's rows (config.json's `vocab_size`, a multimodal model's text one)."""
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model_path).get_text_config().vocab_size)


def load_causal_lm(path: str, side: SidePrecision, *, trainable: bool = False, logits_chunk_size: int = 512,
                   device: torch.device | str = "cpu", untie_head: bool = False) -> nn.Module:
    """The checkpoint at `path` in `side`'s precision on `device`, its head an `OutputHead` (fp32 when
    the side asks for it: the checkpoint's own fp32 values, not a 16-bit copy cast back up; a parameter of
    its own, untied from the input embedding, with `untie_head` or an fp32 head)."""
    from transformers import AutoModelForCausalLM

    dtype = side.dtype
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32 if side.fp32_head else dtype)
    fp32_head = model.get_output_embeddings().weight.detach().clone() if side.fp32_head else None
    cast_parameters(model, dtype)
    install_output_head(model, fp32=side.fp32_head, chunk_size=logits_chunk_size, fp32_weight=fp32_head,
                        untie=untie_head)
    model.to(device)
    model.train(trainable)
    model.requires_grad_(trainable)
    return model


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """The parameters in `dtype`, the buffers as they are. `model.to(dtype)` would also round RoPE's
    inverse frequencies to 16 bits, an angle error that grows with the position (0.2% of position x
    frequency in bf16), which neither transformers' `from_pretrained(dtype=)` nor DeepSpeed, FSDP2 or
    vLLM (fp32 cos/sin cache, rounded once) has: a mismatch of rlmm's own making, not of the precision."""
    for parameter in model.parameters():  # tied weights are one Parameter: cast once
        if parameter.dtype != dtype:
            parameter.data = parameter.data.to(dtype)


def load_value_model(path: str, side: SidePrecision, *, device: torch.device | str = "cpu") -> nn.Module:
    """A value model (PPO's critic) from the causal LM checkpoint at `path`: the same body with a scalar
    head (transformers' *ForTokenClassification with one label, the head newly initialised, no dropout),
    trainable, in `side`'s dtype on `device`."""
    import transformers
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0  # transformers' default 0.1 would make every value a random draw in training
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the LM head left out and the new value head are expected
    try:
        model = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=side.dtype)
    finally:
        transformers.logging.set_verbosity(verbosity)
    model.to(device)
    model.train(True)
    return model


def value_head(model: nn.Module) -> nn.Module:
    """The scalar head of a value model (transformers names it `score` or `classifier`)."""
    return getattr(model, "score", None) or model.classifier


def model_precision(model: nn.Module) -> dict[str, str]:
    """The dtypes a loaded model's body and head (the LM head, or a value model's scalar head) have."""
    head = model.get_output_embeddings() or value_head(model)
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
