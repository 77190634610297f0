"""rlmm/models/checkpoint_names.py: a trainer's weights renamed as the checkpoint stores them (what vLLM loads)."""
from __future__ import annotations

import torch
from safetensors.torch import load_file

from rlmm.models.checkpoint_names import CheckpointNames


def test_an_moe_trainers_fused_experts_become_the_checkpoints_tensors(moe_model_path):
    """The runtime state dict (fused `experts.gate_up_proj` [E, 2I, H], `experts.down_proj`) converted one
    tensor at a time gives exactly the saved file's names and values."""
    from transformers import AutoModelForCausalLM

    held = AutoModelForCausalLM.from_pretrained(moe_model_path).state_dict()
    assert any(name.endswith("experts.gate_up_proj") for name in held)
    converted = dict(CheckpointNames(moe_model_path)(held.items()))
    saved = load_file(f"{moe_model_path}/model.safetensors")
    assert set(converted) == set(saved)
    assert all(torch.equal(converted[name], saved[name]) for name in saved)


def test_a_dense_models_names_pass_through(small_model_path):
    from transformers import AutoModelForCausalLM

    held = AutoModelForCausalLM.from_pretrained(small_model_path).state_dict()
    names = CheckpointNames(small_model_path)
    assert not names.converts
    assert [name for name, _ in names(held.items())] == list(held)
