"""A model whose LM head is tied to its input embedding (Qwen2.5-0.5B's is): the weights a trainer sends
name the shared tensor twice (`lm_head.weight` and `model.embed_tokens.weight`), and the transformers
sampler takes both. Found on a GPU: `rlmm train trainer=fsdp sampler=hf` on a tied model failed at its
first weight sync."""
from __future__ import annotations

import torch

from rlmm.precision import SidePrecision
from tests.conftest import build_sampler, build_trainer, sampling


def tied_model(path) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def test_a_trainers_weights_of_a_tied_model_load_into_the_transformers_sampler(small_model_path, tmp_path):
    from transformers import AutoTokenizer

    path = tied_model(tmp_path / "tied")
    AutoTokenizer.from_pretrained(small_model_path).save_pretrained(path)
    fp32 = SidePrecision("fp32", False)
    trainer = build_trainer("fsdp", path, fp32, sampling())
    sampler = build_sampler("hf", path, fp32, sampling(), seed=0)
    try:
        weights = {k: v + 0.01 for k, v in trainer.state_dict().items()}
        assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(weights)
        sampler.load_weights(weights)
        head = sampler.model.get_output_embeddings().weight
        assert torch.equal(head, weights["lm_head.weight"])
        assert head is sampler.model.get_input_embeddings().weight  # still one tensor
    finally:
        trainer.close()
        sampler.close()
