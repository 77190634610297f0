"""Trainer-side weight names to the checkpoint's: what an engine that loads checkpoints (vLLM) expects.

transformers 5 loads some architectures into other tensors than their checkpoints store: an MoE model's
experts `experts.{e}.gate_proj.weight`, `experts.{e}.up_proj.weight`, `experts.{e}.down_proj.weight` (Mixtral:
`block_sparse_moe.experts.{e}.w1/w3/w2`) become two fused `[E, ...]` parameters per layer,
`mlp.experts.gate_up_proj` and `mlp.experts.down_proj` (transformers/conversion_mapping.py). A trainer's
`state_dict()` therefore names them as the fused module does, and vLLM's loader, written for checkpoints,
would not find them: the weight sync converts each tensor back with transformers' own reverse mapping
(`core_model_loading.revert_weight_conversion`, the one `save_pretrained` uses), one tensor at a time so a
ZeRO-3 / FSDP gather still holds one tensor at once.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


class CheckpointNames:
    """Converts (name, tensor) pairs named as transformers' model holds them into the checkpoint's names and
    layouts; the identity for an architecture transformers loads as it is stored (no conversion mapping)."""

    def __init__(self, model_path: str):
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.conversion_mapping import get_model_conversion_mapping

        with torch.device("meta"):  # the module tree the mapping is looked up on, without weights
            self.meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
        self.converts = bool(get_model_conversion_mapping(self.meta, add_legacy=False))

    def __call__(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        from transformers.core_model_loading import revert_weight_conversion

        for name, tensor in named:
            if not self.converts:
                yield name, tensor
                continue
            converted = revert_weight_conversion(self.meta, {name: tensor})
            if not converted:
                raise ValueError(f"weight sync: transformers' reverse mapping gave nothing for '{name}'")
            yield from converted.items()
