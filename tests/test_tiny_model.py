"""The built-in model: character tokenizer, cache by config hash, warm start."""
import json

import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

import rlmm.schema  # noqa: F401
from rlmm.config import CONF_DIR, to_container
from rlmm.models.tiny import TinyModel, build_char_tokenizer


def _spec(cache_dir, **changes):
    values = dict(hidden_size=64, num_layers=1, num_heads=1, num_kv_heads=1, intermediate_size=64, max_position=64,
                  seed=0, warm_start_steps=40, warm_start_lr=3e-3, warm_start_batch_size=16, cache_dir=str(cache_dir))
    values.update(changes)
    return TinyModel(**values)


def test_tokenizer_is_character_level_with_bos():
    tokenizer = build_char_tokenizer()
    ids = tokenizer("12+3=").input_ids
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 6
    assert tokenizer.decode(ids, skip_special_tokens=True) == "12+3="
    assert tokenizer.decode(tokenizer("Question: A $5 pen?\nAnswer: ").input_ids[1:]) == "Question: A $5 pen?\nAnswer: "


def test_cache_key_follows_every_input(tmp_path):
    base = _spec(tmp_path).cache_key({"task": 1})
    assert base == _spec(tmp_path).cache_key({"task": 1})
    assert base != _spec(tmp_path, hidden_size=128).cache_key({"task": 1})
    assert base != _spec(tmp_path, warm_start_steps=41).cache_key({"task": 1})
    assert base != _spec(tmp_path).cache_key({"task": 2})


def test_build_warm_start_and_reuse(tmp_path, arithmetic_task):
    from transformers import AutoModelForCausalLM

    spec = _spec(tmp_path)
    path = spec.resolve(arithmetic_task, {"t": 1})
    info = json.loads((tmp_path / "models" / path.rsplit("/", 1)[-1] / "rlmm_model.json").read_text())
    assert info["warm_start_loss"] < info["initial_loss"]  # the warm start learned something
    stamp = (tmp_path / "models" / path.rsplit("/", 1)[-1] / "model.safetensors").stat().st_mtime_ns
    assert spec.resolve(arithmetic_task, {"t": 1}) == path  # cached: not rebuilt
    assert (tmp_path / "models" / path.rsplit("/", 1)[-1] / "model.safetensors").stat().st_mtime_ns == stamp
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "qwen2" and not model.config.tie_word_embeddings
    assert not list(tmp_path.glob("models/.building-*"))


def test_builtin_model_is_partially_competent():
    """The default model (built once, cached): better than chance, far from perfect, peaked."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("probe")
    GlobalHydra.instance().clear()
    task = instantiate(cfg.task)
    path = instantiate(cfg.model).resolve(task, to_container(cfg.task))
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert 1e6 < sum(p.numel() for p in model.parameters()) < 1e7
    examples = task.examples("test", 100)
    correct, top_probs = 0, []
    for example in examples:
        ids = torch.tensor([tokenizer(example.prompt).input_ids])
        out = model.generate(ids, do_sample=False, max_new_tokens=5, output_scores=True, return_dict_in_generate=True,
                             pad_token_id=tokenizer.pad_token_id)
        correct += task.reward(example, tokenizer.decode(out.sequences[0, ids.size(1):], skip_special_tokens=True))
        top_probs.append(out.scores[0].softmax(-1).max().item())
    accuracy = correct / len(examples)
    assert 0.05 < accuracy < 0.9, accuracy
    assert sum(top_probs) / len(top_probs) > 0.3  # peaked first-token distribution (uniform: 1/100)
