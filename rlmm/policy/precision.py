"""Precision policies: which floating-point format each side of RL runs in.

The sampler (rollout engine) and the trainer are set independently, and each may keep its LM head
in fp32 while the body runs in 16 bits. The head matters because the final projection's rounding
lands directly on the log-probs: MiniMax-M1 (2025) raised the train/inference token-probability
correlation from 0.987 to 0.997 by computing the head in fp32. Qi et al. (2025, "Defeating the
Training-Inference Mismatch via FP16") argue for fp16 over bf16: 10 vs 7 mantissa bits, so about 8x
smaller rounding error per operation.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

# The config's spelling of each dtype (conf/precision/*.yaml, `precision.*_dtype=` overrides) and back. Past the
# config's edge a dtype is a `torch.dtype`: `to_dtype` reads a name once, where a precision object is built, and
# `dtype_name` writes one wherever a report, record or message shows it.
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def to_dtype(name: str | torch.dtype, what: str = "dtype") -> torch.dtype:
    """Map 'fp32' | 'bf16' | 'fp16' to a torch dtype (one of those three torch dtypes passes as it is), with a
    one-line error naming `what`, the bad value and the choices."""
    if isinstance(name, torch.dtype) and name in DTYPE_NAMES:
        return name
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        shown = dtype_name(name) if isinstance(name, torch.dtype) else name
        raise ValueError(f"{what}: unknown precision '{shown}' (allowed: {', '.join(DTYPES)})") from None


def dtype_name(dtype: torch.dtype) -> str:
    """The name a report, record or message writes for `dtype`: the config's ('fp32', 'bf16', 'fp16'), torch's
    own for any other ('float64', 'float8_e4m3fn')."""
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class SidePrecision:
    """The format one engine computes in: body dtype, and whether the LM head runs in fp32.

    `dtype` may be given by its config name ("bf16"); it is a `torch.dtype` once built, and every comparison
    downstream is on it (`side.dtype == torch.float16`); `name` is what a report writes."""

    dtype: torch.dtype
    fp32_head: bool

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", to_dtype(self.dtype, "precision"))  # frozen: set once, here

    @property
    def name(self) -> str:
        return dtype_name(self.dtype)

    def __str__(self) -> str:
        return self.name + ("+fp32head" if self.fp32_head and self.dtype != torch.float32 else "")


class PrecisionPolicy:
    """Per-side precision for one run (the `precision=` config group).

    Args:
        sampler_dtype: format of the rollout engine's weights and activations.
        trainer_dtype: format the trainer scores (and later trains) in.
        sampler_fp32_head: compute the sampler's LM head (final projection + softmax) in fp32.
        trainer_fp32_head: the same on the trainer side.
        tf32: let fp32 matrix multiplications on NVIDIA GPUs round their inputs to TF32 (10-bit mantissa,
            as bf16's 7 and fp16's 10): faster, but then "fp32" is not the fp32 reference. Off in every
            conf/precision option; `apply()` pins it process-wide and the run's precision report records
            what was in force.
    """

    def __init__(self, sampler_dtype: str, trainer_dtype: str, sampler_fp32_head: bool, trainer_fp32_head: bool,
                 tf32: bool):
        self.sampler = SidePrecision(to_dtype(sampler_dtype, "precision.sampler_dtype"), bool(sampler_fp32_head))
        self.trainer = SidePrecision(to_dtype(trainer_dtype, "precision.trainer_dtype"), bool(trainer_fp32_head))
        self.tf32 = bool(tf32)

    @property
    def fp32_matmul(self) -> str:
        """torch's name for the fp32 matmul precision this policy asks for."""
        return "high" if self.tf32 else "highest"

    def apply(self) -> None:
        """Pin fp32 matmul precision for this process, before any engine starts (torch's default is
        "highest" with TF32 off for matmuls, but a library may change it; cuDNN's TF32 is on by default)."""
        torch.set_float32_matmul_precision(self.fp32_matmul)
        torch.backends.cuda.matmul.allow_tf32 = self.tf32
        torch.backends.cudnn.allow_tf32 = self.tf32

    def __repr__(self) -> str:
        return f"PrecisionPolicy(sampler={self.sampler}, trainer={self.trainer})"


def check_precision(policy, sampler_actual: dict, trainer_actual: dict) -> dict:
    """Compare what each engine runs in with what was asked; warn loudly about silent casts.

    Batch-invariant kernels: vLLM installs its (`sampler.batch_invariant`) for the whole process, as aten
    overrides of mean, softmax, log_softmax and bmm (and matmuls on some GPUs), cuBLAS workspace and NCCL
    channel settings, so the trainer in the same process runs them too: `actual.trainer.batch_invariant`
    follows the sampler's, and a `batch_invariant` arm of an experiment changes both sides."""
    trainer_actual = {**trainer_actual, "batch_invariant": sampler_actual.get("batch_invariant", "false")}
    report = {"requested": {"sampler": str(policy.sampler), "trainer": str(policy.trainer),
                            "fp32_matmul": policy.fp32_matmul},
              "actual": {"sampler": sampler_actual, "trainer": trainer_actual,
                         "fp32_matmul": torch.get_float32_matmul_precision()}, "silent_casts": []}
    if trainer_actual["batch_invariant"] == "true":
        log.warning("vLLM's batch-invariant kernels are installed process-wide: the trainer runs them too")
    if report["actual"]["fp32_matmul"] != policy.fp32_matmul:  # an engine changed it after apply()
        report["silent_casts"].append(f"fp32 matmul precision: asked for {policy.fp32_matmul}, "
                                      f"in force {report['actual']['fp32_matmul']}")
    for side, asked, actual in (("sampler", policy.sampler, sampler_actual), ("trainer", policy.trainer, trainer_actual)):
        # The engines report names (`dtype_name`; a mixed body as "bf16/fp32"), so the asked side is named too.
        if actual["dtype"] != asked.name:
            report["silent_casts"].append(f"{side}: asked for {asked.name}, engine runs {actual['dtype']}")
        if asked.fp32_head and actual["head_dtype"] != dtype_name(torch.float32):
            report["silent_casts"].append(f"{side}: asked for an fp32 LM head, engine computes it in {actual['head_dtype']}")
    for line in report["silent_casts"]:
        log.warning("precision mismatch: %s", line)
    return report


def nonfinite_cause(dtypes) -> str:
    """The known cause of non-finite log-probs when a side runs in fp16 (`dtypes`: the dtypes the engines
    really run), as a clause to append to the error or warning that reports them; "" otherwise. One text for
    the probe's error (rlmm/probe) and the training step's bad-step warning (rlmm/run/step.py); the dtypes are
    the names the precision report holds."""
    return ("; fp16 activations overflow in some models (Qwen2 is known to): use precision=bf16 or fp32"
            if dtype_name(torch.float16) in set(dtypes) else "")
