"""fp16 dynamic loss scaling on every backend (rlmm/trainers/loss_scale.py): an overflow while the scale has
room above its minimum is the scaler's normal business (`loss_scale_skipped`), not a fault (`skipped`),
and DeepSpeed's fp16 optimizers run it as torch's GradScaler does.

DeepSpeed's CPU accelerator says fp16 is unsupported on a CPU without AVX-512 FP16
(`get_accelerator().is_fp16_supported()` is None on this project's AMD EPYC, AVX2), though its fp16
optimizers (ZeRO-0's `FP16_UnfusedOptimizer`, ZeRO-1/2's `DeepSpeedZeroOptimizer`) run on CPU tensors:
the `fp16_deepspeed` fixture says yes, so these tests run DeepSpeed's real fp16 code."""
from __future__ import annotations

import json
import math

import pytest
import torch

from rlmm.config.options import from_yaml
from rlmm.policy.precision import SidePrecision
from rlmm.trainers.update import minibatch_step
from tests.conftest import sampling
from tests.test_checkpoint import fixed_rollouts, loss_fn

FP16 = SidePrecision("fp16", False)
BACKENDS = ["torch", "fsdp", "deepspeed-zero0", "deepspeed-zero2"]


@pytest.fixture
def fp16_deepspeed(monkeypatch):
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: True)


def fp16_trainer(backend: str, model_path: str, **values):
    """An fp16 trainer of `backend` ("deepspeed-zeroN": DeepSpeed at ZeRO stage N), 2 micro-batches of 4 a step."""
    name, _, stage = backend.partition("-zero")
    stage_value = {"zero_stage": int(stage)} if stage else {}
    return from_yaml("trainer", name, model_path=model_path, precision=FP16, sampling=sampling(max_new_tokens=6),
                     micro_batch_size=4, lr=1e-3, **stage_value, **values)


def test_overflows_while_the_scale_has_room_are_normal_and_skip_at_the_same_steps_on_every_backend(
        small_model_path, arithmetic_task, fp16_deepspeed):
    """From 2^20 (this model's fp16 gradients overflow from 2^17 on) every backend skips the first steps as
    normal overflows, halving the scale each time (DeepSpeed's ZeRO-2 too: rlmm sets its hysteresis to 1),
    until a step goes through; no step is a fault. Before: each overflow was metrics["skipped"] = 1 (three
    in a row end a run at train.max_bad_steps=3), ZeRO-0 fp16 never scaled its loss, so it never overflowed,
    and ZeRO-2 skipped its first overflow without lowering the scale."""
    rollouts = fixed_rollouts(small_model_path, arithmetic_task)
    runs = {}
    for backend in BACKENDS:
        trainer = fp16_trainer(backend, small_model_path, initial_loss_scale=2.0 ** 20)
        try:
            runs[backend] = [minibatch_step(trainer, rollouts, list(range(8)), loss_fn) for _ in range(6)]
        finally:
            trainer.close()
    for backend, steps in runs.items():
        assert [m["skipped"] for m in steps] == [0.0] * 6, backend
        normal = [m["loss_scale_skipped"] for m in steps]
        assert normal[0] == 1.0 and 0.0 in normal, (backend, normal)
        scales = [m["loss_scale"] for m in steps]
        assert scales[0] == 2.0 ** 20
        assert all(after == (before / 2 if skip else before)
                   for before, after, skip in zip(scales, scales[1:], normal)), (backend, scales)
        assert all(math.isfinite(m["grad_norm"]) for m, skip in zip(steps, normal) if not skip), backend
    for backend in BACKENDS[1:]:
        for key in ("loss_scale", "loss_scale_skipped"):
            assert [m[key] for m in runs[backend]] == [m[key] for m in runs["torch"]], (backend, key)


def inf_then_clean(chunk, logprobs, entropy, poisoned: list[bool]):
    loss, metrics = loss_fn(chunk, logprobs, entropy)
    return (loss * float("inf") if poisoned[0] else loss), metrics


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_overflow_at_the_minimum_scale_is_a_fault_and_the_scale_stays_there(
        small_model_path, arithmetic_task, fp16_deepspeed, backend):
    """At the scale's floor (1, DeepSpeed's default fp16.min_loss_scale) there is nothing left to lower: two
    poisoned steps (an infinite loss) are faults (skipped = 1, loss_scale_skipped = 0), the scale stays at 1,
    and the next clean step goes through. Before: GradScaler went on halving (0.5, 0.25: below DeepSpeed's
    floor), and DeepSpeed's ZeRO-2 loss scaler raised "Current loss scale already at minimum" at the second."""
    rollouts = fixed_rollouts(small_model_path, arithmetic_task)
    trainer = fp16_trainer(backend, small_model_path, initial_loss_scale=1.0)
    poisoned = [True]
    try:
        steps = []
        for poison in (True, True, False):
            poisoned[0] = poison
            steps.append(minibatch_step(trainer, rollouts, list(range(8)),
                                        lambda *args: inf_then_clean(*args, poisoned=poisoned)))
    finally:
        trainer.close()
    assert [m["skipped"] for m in steps] == [1.0, 1.0, 0.0]
    assert [m["loss_scale_skipped"] for m in steps] == [0.0, 0.0, 0.0]
    assert [m["loss_scale"] for m in steps] == [1.0, 1.0, 1.0]


def test_deepspeed_zero0_fp16_scales_the_loss_its_optimizer_unscales(small_model_path, arithmetic_task, tmp_path,
                                                                     fp16_deepspeed):
    """One SGD step (lr 1, no clipping) in fp16 moves the weights by the same amount at ZeRO-0 as at ZeRO-2
    and on trainer=torch. DeepSpeed 0.19.8's `engine.backward` scales the loss only for a ZeRO optimizer,
    while ZeRO-0's FP16_UnfusedOptimizer divides the gradient by its scale: before rlmm scaled ZeRO-0's loss
    itself, its step was 2^10 (the scale here) times too small (relative error 1.0)."""
    config = tmp_path / "sgd.json"
    config.write_text(json.dumps({"optimizer": {"type": "SGD", "params": {"lr": 1.0}},
                                  "zero_allow_untested_optimizer": True}))
    rollouts = fixed_rollouts(small_model_path, arithmetic_task)
    changes = {}
    for backend in ("deepspeed-zero0", "deepspeed-zero2", "torch"):
        values = {"config_file": str(config)} if backend != "torch" else {}
        trainer = fp16_trainer(backend, small_model_path, initial_loss_scale=2.0 ** 10, grad_clip=0.0, **values)
        if backend == "torch":
            trainer.optimizer = torch.optim.SGD(trainer.optimized_params, lr=1.0)
        try:
            before = {k: v.float().clone() for k, v in trainer.state_dict().items()}
            metrics = minibatch_step(trainer, rollouts, list(range(8)), loss_fn)
            assert metrics["skipped"] == metrics["loss_scale_skipped"] == 0.0 and metrics["loss_scale"] == 2.0 ** 10
            changes[backend] = {k: v.float() - before[k] for k, v in trainer.state_dict().items()}
        finally:
            trainer.close()

    def relative_error(actual, expected):
        difference = sum((actual[k] - expected[k]).double().pow(2).sum() for k in expected)
        return (difference / sum(e.double().pow(2).sum() for e in expected.values())).sqrt().item()

    reference = changes["deepspeed-zero2"]
    assert sum(v.abs().sum() for v in reference.values()) > 0
    assert relative_error(changes["deepspeed-zero0"], reference) < 0.02
    assert relative_error(changes["torch"], reference) < 0.02


def test_deepspeed_initial_loss_scale_is_a_power_of_two(small_model_path, fp16_deepspeed):
    with pytest.raises(ValueError, match=r"^trainer.initial_loss_scale: DeepSpeed starts its loss scale at a power "
                                         r"of two \(fp16.initial_scale_power\), got 3000.0 \(allowed: 2\^k"):
        fp16_trainer("deepspeed-zero0", small_model_path, initial_loss_scale=3000.0)
    trainer = fp16_trainer("deepspeed-zero0", small_model_path, initial_loss_scale=2.0 ** 12,
                           loss_scale_growth_interval=7)
    try:
        assert trainer.engine.optimizer.loss_scale == 2.0 ** 12
        assert trainer.engine.optimizer.loss_scale_config.scale_window == 7
    finally:
        trainer.close()


@pytest.mark.parametrize("stage", [0, 2])
def test_a_non_finite_fp32_head_after_a_normal_overflow_is_one_fault_and_holds_the_schedule(
        small_model_path, arithmetic_task, fp16_deepspeed, stage):
    """fp16 with an fp32 head: a normal overflow (from 2^20), then a poisoned step whose fp32 head gradient is
    non-finite (a fault: an fp32 gradient never overflows from the scale; rlmm skips DeepSpeed's optimizer
    itself). DeepSpeed counts two skipped steps and its warm-up schedule has not moved. Before: the skip
    rlmm forced was booked twice, by the engine (the optimizer's overflow flag still set from the step before)
    and by rlmm, so skipped_steps was 3 and the schedule went one step back."""
    rollouts = fixed_rollouts(small_model_path, arithmetic_task)
    trainer = from_yaml("trainer", "deepspeed", model_path=small_model_path, precision=SidePrecision("fp16", True),
                        sampling=sampling(max_new_tokens=6), micro_batch_size=4, lr=1e-3,
                        warmup_steps=10, zero_stage=stage, initial_loss_scale=2.0 ** 20)
    poisoned = [False]
    try:
        first = minibatch_step(trainer, rollouts, list(range(8)), lambda *a: inf_then_clean(*a, poisoned=poisoned))
        assert (first["skipped"], first["loss_scale_skipped"]) == (0.0, 1.0)
        poisoned[0] = True
        second = minibatch_step(trainer, rollouts, list(range(8)), lambda *a: inf_then_clean(*a, poisoned=poisoned))
        assert (second["skipped"], second["loss_scale_skipped"]) == (1.0, 0.0)
        assert trainer.engine.skipped_steps == 2
        assert trainer.engine.lr_scheduler.last_epoch == 0 and second["lr"] == first["lr"]
        assert trainer.head_optimizer.schedule.last_epoch == 0
    finally:
        trainer.close()
