"""What the tests expect of this CPU, each answer asked of rlmm (rlmm/runtime/cpu.py and the checks that read it), never
re-derived here: so a test and rlmm cannot disagree about a machine, and tests/test_cpu.py checks every helper below
under every simulated machine type (`rlmm.runtime.cpu.simulated`)."""
from __future__ import annotations

import torch

from rlmm.runtime import cpu


def fp8_kv_cache_here() -> bool:
    """vLLM keeps an FP8 KV cache on this machine (AVX-512 or AMX on a CPU)."""
    from rlmm.policy.quantization import NoQuantization
    from rlmm.samplers.vllm import VLLMSampler

    return VLLMSampler.refused_here(NoQuantization(), "fp8_e4m3") is None


def fp8_weights_here() -> bool:
    """vLLM runs FP8 weights on this machine, whatever the model's shapes (AMX on a CPU)."""
    from rlmm.policy.quantization import Fp8Blockwise
    from rlmm.samplers.vllm import VLLMSampler

    return VLLMSampler.refused_here(Fp8Blockwise(source="sent"), "auto") is None


def deepspeed_runs(dtype: str) -> bool:
    from rlmm.policy.precision import SidePrecision
    from rlmm.trainers.deepspeed_backend import DeepSpeedTrainer

    return DeepSpeedTrainer.unsupported(SidePrecision(dtype, False)) is None


def aten_vectorized() -> bool:
    """ATen's CPU kernels run vectorized (AVX2 or AVX-512), not the scalar `DEFAULT` ones, whose one reduction order
    at every shape zeroes some bf16 gaps."""
    return cpu.aten_capability() != "DEFAULT"


def experiment_pins(name: str, app: str, cfg) -> list[str]:
    """What an experiment's grid (`cfg`: the experiment composed with its `hydra` node) is narrowed to on this
    machine, as overrides:
    a GPU variant's probe scores with plain torch where DeepSpeed cannot run fp16 here (`trainer=torch`), and the
    grid's rollout modes the chosen sampler refuses on this machine (`experiment_refusals`) are left out."""
    pins = ["trainer=torch"] if name.endswith("_gpu") and app == "probe" and not torch.cuda.is_available() \
        and not deepspeed_runs("fp16") else []
    return pins + experiment_refusals(cfg.hydra.sweeper.params, cfg.sampler._target_)


def experiment_refusals(grid, sampler_target: str) -> list[str]:
    """The grid's values of `quantization` and `sampler.kv_cache_dtype` that the sampler refuses on this machine (its
    `refused_here`, the check `rlmm <app> -m` runs), as overrides of the grid without them (empty where it runs every
    value)."""
    from hydra.utils import get_class

    from rlmm.config.options import from_yaml

    engine = get_class(sampler_target)
    refused = {"quantization": lambda option: engine.refused_here(from_yaml("quantization", option), "auto"),
               "sampler.kv_cache_dtype": lambda dtype: engine.refused_here(from_yaml("quantization", "none"), dtype)}
    narrowed = []
    for key, refusal in refused.items():
        values = str(grid[key]).split(",") if key in grid else []
        kept = [v for v in values if refusal(v) is None]
        if kept != values:
            narrowed.append(f"{key}={','.join(kept)}")
    return narrowed
