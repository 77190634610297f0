"""What a minibatch's micro-batch gradients are summed in, on every backend, and that the precision report
(`trainer.actual_precision["grad_accum_dtype"]`, in the run's precision.actual) says it.

The probe: K + 1 micro-batches of the same rows, the first with weight 1 and the others 2^-10, so each
later micro-batch's gradient is exactly 2^-10 g (a power-of-two factor commutes with rounding). Summed in
fp32, the minibatch's gradient is exactly (1 + K/1024) g; summed in bf16 (8 significant bits), each 2^-10 g
is below half a unit in the last place of g and is lost, leaving exactly g. So the ratio of the step's
gradient norm to the first micro-batch's alone is 1 + K/1024 or 1, and says which dtype did the sums."""
from __future__ import annotations

import pytest
import torch

from rlmm.config.options import from_yaml
from rlmm.policy.precision import SidePrecision
from rlmm.policy.rollouts import Rollouts
from rlmm.trainers.update import minibatch_step
from tests.conftest import sampling

K = 8  # micro-batches after the first
EXACT = 1 + K / 1024

# (trainer, its values, grad_accum_dtype and reduce_dtype the report must give)
CASES = [
    ("deepspeed", {"zero_stage": 0}, "bf16", "bf16"),  # DeepSpeed's default: the module's .grad
    ("deepspeed", {"zero_stage": 2}, "bf16", "bf16"),  # ... and its ZeRO optimizers' buffers
    ("deepspeed", {"zero_stage": 1, "grad_accum_dtype": "fp32", "reduce_dtype": "fp32"}, "fp32", "fp32"),
    ("deepspeed", {"zero_stage": 2, "grad_accum_dtype": "fp32"}, "fp32", "bf16"),
    ("deepspeed", {"zero_stage": 3, "grad_accum_dtype": "fp32"}, "fp32", "bf16"),
    ("torch", {}, "bf16", "bf16"),
    ("torch", {"grad_accum_dtype": "fp32"}, "fp32", "fp32"),
    ("fsdp", {}, "fp32", "fp32"),  # FSDP2 sums in reduce_dtype (fp32 by default)
    ("fsdp", {"reduce_dtype": "bf16"}, "bf16", "bf16"),
]


def repeated_rollouts(rows: int) -> Rollouts:
    return Rollouts(prompt_ids=[[1, 5, 6, 7, 8]] * rows, response_ids=[[8, 9, 10, 11]] * rows,
                    sampler_logprobs=[torch.zeros(4)] * rows, finish_reasons=["stop"] * rows)


def first_heavy(chunk, logprobs, entropy):
    """Micro-batch 0 (rows 0, 1) with weight 1, every later one with 2^-10."""
    weight = 1.0 if chunk[0] == 0 else 2.0 ** -10
    return -(logprobs.sum() * weight) / 8, {}


def accumulation_ratio(trainer) -> float:
    """|g_0 + K 2^-10 g_0| / |g_0| as the trainer sums it (lr 1e-30: the weights do not move between steps)."""
    rollouts = repeated_rollouts(2 * (K + 1))
    alone = minibatch_step(trainer, rollouts, [0, 1], first_heavy)["grad_norm"]
    summed = minibatch_step(trainer, rollouts, list(range(2 * (K + 1))), first_heavy)["grad_norm"]
    return summed / alone


@pytest.mark.parametrize("backend,values,accum,reduce", CASES,
                         ids=[f"{b}-{'-'.join(f'{k}={v}' for k, v in vs.items()) or 'default'}"
                              for b, vs, _, _ in CASES])
def test_the_reported_accumulation_dtype_is_the_one_the_sums_show(small_model_path, backend, values, accum, reduce):
    trainer = from_yaml("trainer", backend, model_path=small_model_path, precision=SidePrecision("bf16", False),
                        sampling=sampling(), micro_batch_size=2, lr=1e-30, grad_clip=0.0,
                        **values)
    try:
        report = trainer.actual_precision
        assert (report["dtype"], report["grad_accum_dtype"], report["reduce_dtype"]) == ("bf16", accum, reduce)
        ratio = accumulation_ratio(trainer)
    finally:
        trainer.close()
    if accum == "bf16":
        assert abs(ratio - 1) < 1e-6, ratio  # every 2^-10 g rounded away
    else:
        assert abs(ratio - EXACT) < 1e-6, ratio


def test_deepspeed_zero1_rounds_an_fp32_sum_to_bf16_when_it_reduces_in_bf16(small_model_path):
    """ZeRO-1 reduces the minibatch's summed gradient once, at its end, in `communication_data_type` (bf16 for a
    bf16 body unless `reduce_dtype: fp32`), even on one rank: the fp32 sum keeps most of the 2^-10 parts (a
    bf16 sum keeps none) but not exactly (conf/scale/trainer/gpu_deepspeed.yaml sets both to fp32)."""
    trainer = from_yaml("trainer", "deepspeed", model_path=small_model_path, precision=SidePrecision("bf16", False),
                        sampling=sampling(), micro_batch_size=2, lr=1e-30, grad_clip=0.0,
                        zero_stage=1, grad_accum_dtype="fp32")
    try:
        assert (trainer.actual_precision["grad_accum_dtype"], trainer.actual_precision["reduce_dtype"]) == ("fp32",
                                                                                                           "bf16")
        ratio = accumulation_ratio(trainer)
    finally:
        trainer.close()
    assert 1 + K / 2048 < ratio < EXACT + K / 2048 and abs(ratio - EXACT) > 1e-5, ratio


def test_fp32_accumulation_options_are_one_line_errors(small_model_path):
    bf16 = SidePrecision("bf16", False)
    build = dict(model_path=small_model_path, sampling=sampling())
    with pytest.raises(ValueError, match=r"^trainer.grad_accum_dtype: unknown dtype 'fp64' \(allowed: null, fp32\)$"):
        from_yaml("trainer", "deepspeed", precision=bf16, grad_accum_dtype="fp64", **build)
    with pytest.raises(ValueError, match=r"^trainer.grad_accum_dtype: fp32 with a bf16 body needs zero_stage 1, 2 or "
                                         r"3, got 0 \(DeepSpeed's ZeRO-0 sums gradients in the module's dtype only"):
        from_yaml("trainer", "deepspeed", precision=bf16, zero_stage=0, grad_accum_dtype="fp32", **build)
    with pytest.raises(ValueError, match=r"^trainer.reduce_dtype: unknown dtype 'fp8' \(allowed: null, fp32, bf16, "):
        from_yaml("trainer", "deepspeed", precision=bf16, zero_stage=1, reduce_dtype="fp8", **build)
    with pytest.raises(ValueError, match=r"^trainer.grad_accum_dtype: unknown dtype 'bf16' \(allowed: null, fp32\)$"):
        from_yaml("trainer", "torch", precision=bf16, grad_accum_dtype="bf16", **build)
    fp32 = from_yaml("trainer", "deepspeed", precision=SidePrecision("fp32", False), zero_stage=0,
                     grad_accum_dtype="fp32", **build)  # fp32 is the module's dtype: ZeRO-0 runs it
    try:
        assert fp32.actual_precision["grad_accum_dtype"] == "fp32"
    finally:
        fp32.close()
