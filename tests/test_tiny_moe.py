"""The built-in mixture-of-experts model (`model=tiny_moe`): its config, its cache key, the shipped default.

The shipped model is read, never rebuilt, here (a build takes minutes); tests/test_tiny_model.py covers the
machinery both built-in models share (building, caching, rebuild checks).
"""
import json

import pytest
import torch
from hydra.utils import instantiate

import rlmm.models.tiny as tiny
from rlmm.config.options import to_container, validate
from rlmm.models.tiny import BUILTIN_DIR, TinyModel, shipped_digests, verify
from rlmm.models.tiny_moe import TinyMoeModel, balance_loss
from tests.conftest import compose_app


def _compose(*overrides):
    return compose_app("train", ["model=tiny_moe", *overrides])


def _key(cfg) -> str:
    return instantiate(cfg.model).cache_key(to_container(cfg.task))


@pytest.fixture(scope="module")
def shipped():
    """The default tiny_moe configuration's shipped directory."""
    cfg, _ = _compose()
    return BUILTIN_DIR / f"tiny_moe-{_key(cfg)}"


def test_the_config_composes_and_validates():
    cfg, choices = _compose()
    validate(cfg, choices)
    model = instantiate(cfg.model)
    assert isinstance(model, TinyMoeModel) and model.prefix == "tiny_moe"
    assert (model.arch["num_experts"], model.arch["num_experts_per_tok"]) == (8, 2)
    assert model.arch["mlp_only_layers"] == [] and model.arch["decoder_sparse_step"] == 1


def test_the_shipped_default_matches_its_manifest(shipped):
    digests = shipped_digests().get(shipped.name)
    assert digests is not None, f"{shipped.name} is not in {tiny.BUILTIN_SUMS}"
    assert sorted(p.name for p in shipped.iterdir()) == sorted(digests)
    verify(shipped, digests)


def test_the_shipped_config_is_qwen3_moe_with_the_configured_experts(shipped):
    cfg, _ = _compose()
    config = json.loads((shipped / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["model_type"] == "qwen3_moe"
    assert config["num_local_experts"] == cfg.model.num_experts  # transformers' name for num_experts
    assert config["num_experts_per_tok"] == cfg.model.num_experts_per_tok
    assert config["moe_intermediate_size"] == cfg.model.moe_intermediate_size
    assert config["norm_topk_prob"] is cfg.model.norm_topk_prob
    assert (config["decoder_sparse_step"], config["mlp_only_layers"]) == (1, [])
    assert config["output_router_logits"] is False  # the balance loss is the warm start's alone


def test_the_shipped_record_hashes_to_its_name_and_its_experts_all_work(shipped):
    """rlmm_model.json rebuilds the key the directory is named by (editing conf/model/tiny_moe.yaml or the
    task's defaults fails here), and the warm start's balance loss kept every expert of every layer in use."""
    info = json.loads((shipped / "rlmm_model.json").read_text())
    recorded = TinyMoeModel(**info["arch"], seed=info["seed"], warm_start_steps=info["warm_start"]["steps"],
                            warm_start_lr=info["warm_start"]["lr"],
                            warm_start_batch_size=info["warm_start"]["batch_size"], cache_dir=None, rebuild=False)
    assert f"tiny_moe-{recorded.cache_key(info['task'])}" == shipped.name
    assert info["final_loss"] < 0.5 * info["initial_loss"]
    load = torch.tensor(info["expert_load"])
    assert load.shape == (4, 8) and torch.allclose(load.sum(1), torch.ones(4), atol=1e-3)
    assert load.min() > 0.02 and load.max() < 0.4, info["expert_load"]  # balanced: 0.125 each


def test_the_default_resolves_to_the_shipped_model_without_building(shipped, tmp_path, monkeypatch):
    def build(*args, **kwargs):
        raise AssertionError("the model was built instead of taken from rlmm/models/builtin/")
    monkeypatch.setattr(tiny, "warm_start", build)
    monkeypatch.setattr(TinyMoeModel, "_build", build)
    cfg, _ = _compose(f"model.cache_dir={tmp_path}")
    assert instantiate(cfg.model).resolve(instantiate(cfg.task), to_container(cfg.task)) == str(shipped)
    assert not (tmp_path / "models").exists()


def test_the_cache_key_differs_from_the_dense_one_and_follows_the_moe_keys():
    dense, _ = _compose("model=tiny")
    assert _key(dense) == "be1def5768f14fd8"  # the shipped dense model's key, unchanged by its MoE twin
    cfg, _ = _compose()
    keys = {_key(cfg), _key(dense)}
    for change in ("model.num_experts=4", "model.num_experts_per_tok=1", "model.moe_intermediate_size=128",
                   "model.norm_topk_prob=false", "model.router_aux_loss_coef=0.0", "model.mlp_only_layers=[0]"):
        keys.add(_key(_compose(change)[0]))
    assert len(keys) == 8


def test_the_shipped_model_routes_tokens_to_its_top_k(shipped):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(shipped, experts_implementation="eager")
    out = model(input_ids=torch.tensor([[1, 20, 21, 70]]), output_router_logits=True)
    assert len(out.router_logits) == 4 and out.router_logits[0].shape == (4, 8)
    assert out.logits.shape == (1, 4, 100) and torch.isfinite(out.logits).all()


@pytest.mark.parametrize("change,message", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9 must be between 1 and num_experts=8"),
    (dict(mlp_only_layers=[4]), r"mlp_only_layers=\[4\] layer indices below num_layers=4"),
])
def test_bad_moe_values_are_one_line_errors(change, message):
    values = dict(hidden_size=64, num_layers=4, num_heads=1, num_kv_heads=1, intermediate_size=64, max_position=64,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                  router_aux_loss_coef=0.01, decoder_sparse_step=1, mlp_only_layers=[], seed=0, warm_start_steps=1,
                  warm_start_lr=1e-3, warm_start_batch_size=1, cache_dir=None, rebuild=False)
    with pytest.raises(ValueError, match=f"^model: .*{message}"):
        TinyMoeModel(**{**values, **change})


def test_the_dense_warm_start_is_the_lm_loss_alone():
    assert TinyModel.prefix == "tiny" and TinyModel(
        hidden_size=64, num_layers=1, num_heads=1, num_kv_heads=1, intermediate_size=64, max_position=64, seed=0,
        warm_start_steps=1, warm_start_lr=1e-3, warm_start_batch_size=1, cache_dir=None,
        rebuild=False)._warm_start_objective() is tiny.lm_objective


def test_balance_loss_is_one_when_balanced_and_e_when_collapsed_in_any_layer():
    """Per layer, then averaged: a layer that favours expert 0 and one that favours expert 1 do not cancel
    (transformers' pooled loss would call the pair balanced); padded positions do not count."""
    experts, tokens = 4, 8
    uniform = torch.zeros(tokens, experts)
    assert balance_loss((uniform, uniform), torch.ones(tokens), top_k=1).item() == pytest.approx(1.0)
    onto = [torch.full((tokens, experts), -30.0).index_fill_(1, torch.tensor([e]), 30.0) for e in (0, 1)]
    assert balance_loss(tuple(onto), torch.ones(tokens), top_k=1).item() == pytest.approx(experts)
    padded = onto[0].clone()
    padded[tokens // 2:] = torch.zeros(experts)  # padding: whatever its routing, it is not counted
    assert balance_loss((padded,), (torch.arange(tokens) < tokens // 2).float(), top_k=1).item() == pytest.approx(experts)
    spread = torch.eye(experts).repeat(2, 1) * 30  # 8 tokens, 2 on each expert
    assert balance_loss((spread,), torch.ones(tokens), top_k=2).item() == pytest.approx(1.0, abs=1e-6)
