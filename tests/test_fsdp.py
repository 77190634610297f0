"""trainer=fsdp beyond what every backend is tested for (tests/test_update.py, test_checkpoint.py,
test_train.py, test_reliability.py cover its update, two ranks, resume and corrections): its precision
report, its fp16 loss scaling, and its one-line errors."""
from __future__ import annotations

import pytest

from rlmm.config.options import from_yaml
from rlmm.policy.precision import SidePrecision
from rlmm.trainers.update import minibatch_step
from tests.conftest import build_trainer, sampling
from tests.test_checkpoint import fixed_rollouts, loss_fn


def test_the_precision_report_says_what_is_cast_where(small_model_path):
    trainer = build_trainer("fsdp", small_model_path, SidePrecision("bf16", True), sampling())
    try:
        assert trainer.actual_precision == {"dtype": "bf16", "head_dtype": "fp32", "master_dtype": "fp32",
                                            "grad_accum_dtype": "fp32", "reduce_dtype": "fp32"}
    finally:
        trainer.close()


def test_fp16_loss_scaling_skips_and_halves_as_the_torch_trainer_does(small_model_path, arithmetic_task):
    """The same fp16 steps on both backends: every overflow skips the step (a normal one, not a fault) and
    halves the scale at the same steps, and the first steps taken have the same gradient norm to within 2%."""
    rollouts = fixed_rollouts(small_model_path, arithmetic_task)
    runs = {}
    for backend in ("torch", "fsdp"):
        trainer = build_trainer(backend, small_model_path, SidePrecision("fp16", False), sampling(),
                                micro_batch_size=4, lr=1e-3, initial_loss_scale=2.0 ** 20)
        try:
            runs[backend] = [minibatch_step(trainer, rollouts, list(range(8)), loss_fn) for _ in range(6)]
        finally:
            trainer.close()
    for key in ("loss_scale", "loss_scale_skipped", "skipped"):
        assert [m[key] for m in runs["fsdp"]] == [m[key] for m in runs["torch"]], key
    taken = [(f["grad_norm"], t["grad_norm"]) for f, t in zip(runs["fsdp"], runs["torch"])
             if not t["loss_scale_skipped"]]
    assert taken and all(abs(f - t) < 0.02 * t for f, t in taken)
    assert runs["fsdp"][0]["loss_scale_skipped"] == 1 and runs["fsdp"][0]["loss_scale"] == 2.0 ** 20
    assert not any(m["skipped"] for m in runs["fsdp"])


def test_an_unknown_reduce_dtype_is_one_line(small_model_path):
    with pytest.raises(ValueError, match=r"trainer.reduce_dtype: unknown dtype 'fp8' \(allowed: fp32, bf16, fp16\)"):
        from_yaml("trainer", "fsdp", model_path=small_model_path, precision=SidePrecision("fp32", False),
                  sampling=sampling(), reduce_dtype="fp8")


def test_weights_are_gathered_one_tensor_at_a_time_with_the_names_and_values_of_the_full_state_dict(
        small_model_path, arithmetic_task):
    """The weight sync reads `GatheredWeights`: the same names and (after an update) the same values as
    torch.distributed.checkpoint's full state dict, gathered only when read."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    from rlmm.trainers.weight_sync import GatheredWeights

    trainer = build_trainer("fsdp", small_model_path, SidePrecision("bf16", True), sampling(), lr=1e-3)
    try:
        minibatch_step(trainer, fixed_rollouts(small_model_path, arithmetic_task), list(range(8)), loss_fn)
        weights = trainer.state_dict()
        full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
        assert isinstance(weights, GatheredWeights) and all(isinstance(v, DTensor) for v in weights.sharded.values())
        assert list(weights) == list(full)
        for name, value in weights.items():
            assert not isinstance(value, DTensor) and torch.equal(value, full[name]), name
    finally:
        trainer.close()


def test_a_nan_in_a_shard_stops_the_sync_before_anything_is_gathered_or_sent(small_model_path):
    import torch

    from rlmm.runtime.errors import NonFiniteWeights
    from rlmm.trainers.weight_sync import send_weights

    class Recording:
        loaded: list = []

        def load_weights(self, weights):
            self.loaded.extend(weights.items())

    trainer = build_trainer("fsdp", small_model_path, SidePrecision("fp32", False), sampling())
    try:
        sampler = Recording()
        send_weights(trainer.state_dict(), sampler)
        assert len(sampler.loaded) == len(trainer.state_dict())
        sampler.loaded.clear()
        last = list(trainer.model.parameters())[-1]
        with torch.no_grad():
            last.to_local().view(-1)[0] = float("nan")
        with pytest.raises(NonFiniteWeights, match="were not sent to the sampler"):
            send_weights(trainer.state_dict(), sampler)
        assert sampler.loaded == []
    finally:
        trainer.close()
