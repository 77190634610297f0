"""Shared fixtures. Engines are real (vLLM CPU build, transformers, DeepSpeed's CPU accelerator);
the model is a small tiny-Qwen2 built once per test session into a temporary cache."""
from __future__ import annotations

import os

from rlmm.runtime_env import set_runtime_env  # imports neither torch nor vLLM

# Before torch/vLLM are imported anywhere: the same environment the `rlmm` command sets.
set_runtime_env()
os.environ.setdefault("WANDB_MODE", "offline")

import pytest  # noqa: E402

from rlmm.config import from_yaml  # noqa: E402
from rlmm.samplers.base import SamplingOptions  # noqa: E402


def sampling(**overrides) -> SamplingOptions:
    values = dict(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8, logprobs="processed")
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
