"""Quantization both sides share (issue 52): the trainer's forward fake-quantized with the run's `quantization=` mode
(`trainer.fake_quantize: true`, rlmm/trainers/fake_quantization.py) and the tensor the quantizer reads
(`quantization.source`). The fake-quantized linear layer is the emulation's forward with a straight-through gradient;
the trainer then scores to the bit what `sampler=hf`'s emulation computes, multiplies with exactly the weights the
sampler holds after a sync, still trains every weight, and says so in the precision report."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from rlmm.config.options import from_yaml
from rlmm.policy import quantization as modes
from rlmm.policy.precision import PrecisionPolicy, SidePrecision, check_precision
from rlmm.samplers.quantize import Emulation
from rlmm.trainers import fake_quantization
from rlmm.trainers.update import minibatch_step
from tests.conftest import build_sampler, build_trainer, sampling, subprocess_env
from tests.test_checkpoint import fixed_rollouts, loss_fn

BF16, FP32 = SidePrecision("bf16", False), SidePrecision("fp32", False)


def mode(option: str, **values):
    return from_yaml("quantization", option, **values)


# -- one layer ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("option", ["int8", "fp8"])
def test_the_fake_quantized_linear_is_the_emulations_forward_with_the_unquantized_gradient(option):
    """y = F.linear(round_input(x), dequantize(quantize(W)), b) to the bit; the gradients are those of that linear
    layer with its rounded input and weight as leaves (the straight-through estimator: d fq(W) / dW = 1)."""
    generator = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(160, 48).to(torch.bfloat16)  # 160: a partial fp8 block
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 160, generator=generator) * torch.logspace(-3, 0, 48)[:, None])
    x = (torch.randn(2, 5, 160, generator=generator) * torch.logspace(-2, 2, 5)[:, None]).to(torch.bfloat16)
    x.requires_grad_(True)
    quantization = mode(option)
    installed = fake_quantization.FakeQuantization(torch.nn.Sequential(layer), quantization, {"0"})
    y = layer(x)
    rounded = quantization.round_input(x.detach()).requires_grad_(True)
    weight = quantization.dequantize(*quantization.quantize(layer.weight)).to(torch.bfloat16).requires_grad_(True)
    bias = layer.bias.detach().clone().requires_grad_(True)
    expected = F.linear(rounded, weight, bias)
    assert torch.equal(y, expected)
    assert not torch.equal(weight, layer.weight) and (option == "fp8" or not torch.equal(rounded, x))
    upstream = torch.randn(y.shape, generator=generator).to(torch.bfloat16)
    y.backward(upstream)
    expected.backward(upstream)
    assert torch.equal(layer.weight.grad, weight.grad) and torch.equal(x.grad, rounded.grad)
    assert torch.equal(layer.bias.grad, bias.grad)
    assert layer.weight.grad.abs().sum() > 0 and x.grad.abs().sum() > 0
    installed.remove()
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


# -- the source ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("option,quantizer", [("int8", modes.int8_per_channel), ("fp8", modes.fp8_blockwise)])
def test_the_source_is_the_tensor_quantized(option, quantizer):
    """source=sent quantizes the weight as the trainer sends it; source=bf16 its bf16 rounding (xtuner #2044)."""
    weight = torch.randn(200, 300, generator=torch.Generator().manual_seed(1))  # fp32, as an FSDP trainer sends
    sent, bf16 = mode(option, source="sent"), mode(option, source="bf16")
    for got, want in ((sent.quantize(weight), quantizer(weight)),
                      (bf16.quantize(weight), quantizer(weight.to(torch.bfloat16)))):
        assert all(torch.equal(a.float(), b.float()) for a, b in zip(got, want))
    assert not torch.equal(sent.quantize(weight)[1], bf16.quantize(weight)[1])  # fp32 and bf16 maxima differ
    rounded = weight.to(torch.bfloat16)
    assert torch.equal(sent.fake_quantize_weight(rounded), bf16.fake_quantize_weight(rounded))
    assert sent.fake_quantize_weight(weight).dtype == torch.float32
    assert torch.equal(bf16.fake_quantize_weight(weight), modes.dequantize(*quantizer(rounded)))


def test_a_bad_source_is_one_line():
    with pytest.raises(ValueError, match=r"^quantization.source: unknown source 'fp32' \(allowed: sent, bf16\)$"):
        mode("int8", source="fp32")


# -- the trainer computes what sampler=hf's emulation computes -----------------------------------------------------
@pytest.fixture(scope="module")
def rollouts(small_model_path, prompts):
    sampler = build_sampler("hf", small_model_path, BF16, sampling(max_new_tokens=8), seed=0,
                            quantization=mode("int8"))
    try:
        return sampler.generate(prompts, n=2)
    finally:
        sampler.close()


def emulated(trainer, quantization, model_path: str) -> Emulation:
    """`trainer`'s weights replaced by the emulation's (`Emulation.fake_quantize`) and its input-rounding hooks
    installed on the trainer's module: what `sampler=hf` does to the weights it is sent."""
    emulation = Emulation(trainer.model, quantization, modes.quantized_modules(model_path))
    params = dict(trainer.model.named_parameters())
    with torch.no_grad():
        for name, tensor in emulation.fake_quantize(list(trainer.state_dict().items())):
            params[name].copy_(tensor)
    return emulation


@pytest.mark.parametrize("backend,values", [("torch", {}), ("deepspeed", {"zero_stage": 0}),
                                            ("deepspeed", {"zero_stage": 3})], ids=["torch", "zero0", "zero3"])
def test_the_fake_quantized_trainer_scores_to_the_bit_what_the_emulation_computes(backend, values, small_model_path,
                                                                                   rollouts):
    """Against the same backend (ZeRO-0 for ZeRO-3, whose partitioned weights cannot be replaced in place) holding the
    emulation's weights and hooks."""
    int8 = mode("int8")
    trainer = build_trainer(backend, small_model_path, BF16, sampling(max_new_tokens=8), micro_batch_size=4,
                            fake_quantize=True, quantization=int8, **values)
    try:
        logprobs, entropy = trainer.logprobs_with_entropy(rollouts)
        alone = trainer.logprobs(rollouts)
    finally:
        trainer.close()
    reference = build_trainer(backend, small_model_path, BF16, sampling(max_new_tokens=8), micro_batch_size=4,
                              **{key: 0 for key in values})
    try:
        plain = reference.logprobs(rollouts)
        emulated(reference, int8, small_model_path)
        expected, expected_entropy = reference.logprobs_with_entropy(rollouts)
    finally:
        reference.close()
    assert torch.equal(logprobs, expected) and torch.equal(alone, expected) and torch.equal(entropy, expected_entropy)
    _, mask = rollouts.padded_sampler_logprobs()
    assert (plain - expected)[mask].abs().max() > 0  # the quantization changes the scores it shares


@pytest.mark.parametrize("backend,precision,source,values", [
    ("torch", "bf16", "sent", {}), ("deepspeed", "bf16", "sent", {"zero_stage": 0}),
    ("deepspeed", "bf16", "sent", {"zero_stage": 3}), ("torch", "fp32", "bf16", {}), ("fsdp", "fp32", "sent", {}),
    ("fsdp", "bf16", "bf16", {})], ids=["torch", "zero0", "zero3", "torch-fp32-bf16source", "fsdp-fp32",
                                        "fsdp-bf16-bf16source"])
def test_the_trainer_multiplies_with_exactly_the_weights_the_sampler_holds(backend, precision, source, values,
                                                                           small_model_path, rollouts):
    """The weights each fake-quantized layer multiplies with in the trainer's forward, against what `sampler=hf`
    holds after a sync of the trainer's weights (`state_dict()`: torch's and DeepSpeed's module weights, FSDP's fp32
    masters), both sides in the same dtype."""
    quantization = mode("int8", source=source)
    side = SidePrecision(precision, False)
    trainer = build_trainer(backend, small_model_path, side, sampling(max_new_tokens=8), micro_batch_size=4,
                            fake_quantize=True, quantization=quantization, **values)
    seen = []
    own = type(quantization).fake_quantize_weight
    quantization.fake_quantize_weight = lambda weight: seen.append(own(quantization, weight)) or seen[-1]
    try:
        minibatch_step(trainer, rollouts, [0, 1], lambda micro, lp, _: ((lp.sum() * 1e-3), {}))  # weights move
        trainer.logprobs(rollouts, 1)
        sampler = build_sampler("hf", small_model_path, side, sampling(max_new_tokens=8), seed=0,
                                quantization=quantization)
        seen.clear()
        trainer.logprobs(rollouts, len(rollouts))  # one forward: each layer's weight once, in the model's order
        multiplied = list(seen)
        sampler.load_weights(trainer.state_dict())  # the sampler's emulation asks the same mode object
    finally:
        trainer.close()
    modules = modes.quantized_modules(small_model_path)
    held = [module.weight for name, module in sampler.model.named_modules() if name in modules]
    sampler.close()
    assert len(multiplied) == len(held) == len(modules)
    assert all(torch.equal(a, b) for a, b in zip(multiplied, held))


def test_fsdp_refuses_a_source_its_forward_does_not_hold(small_model_path):
    """FSDP sends its fp32 masters and computes with their bf16 cast: fake quantization of the weight as sent
    would need the fp32 master inside the forward, which FSDP2 gathers already cast."""
    with pytest.raises(ValueError) as refused:
        build_trainer("fsdp", small_model_path, BF16, sampling(), fake_quantize=True, quantization=mode("int8"))
    assert str(refused.value) == (
        "trainer.fake_quantize=true: trainer=fsdp sends its fp32 masters and multiplies with them cast to bf16, so its "
        "forward cannot quantize what quantization.source=sent quantizes (runs: quantization.source=bf16 with a bf16 "
        "trainer, or an fp32 trainer)")


# -- training ------------------------------------------------------------------------------------------------------
def test_the_straight_through_gradient_is_the_emulated_models_gradient(small_model_path, arithmetic_task):
    """FP8 (weights only, as vLLM-CPU's W8A16): the fake-quantized trainer's gradient of every weight, the LM head's
    and the norms' included, is the gradient of the model holding the fake-quantized weights, to the bit."""
    rows = fixed_rollouts(small_model_path, arithmetic_task)
    fp8 = mode("fp8")
    grads = {}
    for fake in (True, False):
        trainer = build_trainer("torch", small_model_path, BF16, sampling(), micro_batch_size=8, fake_quantize=fake,
                                quantization=fp8)
        try:
            if not fake:
                emulated(trainer, fp8, small_model_path).remove()  # no hooks: fp8 rounds no input
            update = trainer.begin_update(rows, list(range(8)))
            for micro in update.micro_batches:
                update.backward(loss_fn(micro, *update.forward(micro))[0])
            grads[fake] = {name: p.grad.clone() for name, p in trainer.model.named_parameters()}
        finally:
            trainer.close()
    assert grads[True].keys() == grads[False].keys()
    assert all(torch.equal(grads[True][name], grads[False][name]) for name in grads[True])
    assert all(g.abs().sum() > 0 for g in grads[True].values())


def test_a_fake_quantized_step_trains_every_weight_and_the_report_says_so(small_model_path, arithmetic_task):
    rows = fixed_rollouts(small_model_path, arithmetic_task)
    int8 = mode("int8")
    trainer = build_trainer("torch", small_model_path, BF16, sampling(), micro_batch_size=4, lr=1e-3,
                            fake_quantize=True, quantization=int8)
    try:
        before = {name: tensor.clone() for name, tensor in trainer.state_dict().items()}
        metrics = minibatch_step(trainer, rows, list(range(8)), loss_fn)
        after = trainer.state_dict()
        report = check_precision(PrecisionPolicy("bf16", "bf16", False, False, False), {"dtype": "bf16",
                                 "head_dtype": "bf16"}, trainer.actual_precision)
    finally:
        trainer.close()
    assert metrics["skipped"] == 0 and metrics["grad_norm"] > 0
    targeted = {f"{module}.weight" for module in modes.quantized_modules(small_model_path)}
    assert targeted <= before.keys()
    assert [name for name in targeted if torch.equal(before[name], after[name])] == []
    said = report["actual"]["trainer"]["quantization"]["fake_quantize"]
    assert said.startswith(int8.describe()) and "straight-through" in said and "source sent" in said


def test_rlmm_train_records_that_the_trainer_fake_quantizes(tmp_path):
    result = subprocess.run([sys.executable, "-m", "rlmm.cli", "train", "debug=train", "sampler=hf", "trainer=torch",
                             "quantization=int8", "trainer.fake_quantize=true", "train.steps=1", "train.eval_every=0",
                             f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=900,
                            env=subprocess_env(), stdin=subprocess.DEVNULL)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    actual = summary["precision"]["actual"]
    assert actual["trainer"]["quantization"]["fake_quantize"].startswith("int8 W8A8")
    assert "emulated" in actual["sampler"]["quantization"]["weights"]


def test_the_probe_says_whether_the_trainer_fake_quantizes(tmp_path):
    from tests.test_probe import run_probe

    record = run_probe(tmp_path, "sampler=hf", "trainer=torch", "precision=bf16", "quantization=int8",
                       "trainer.fake_quantize=true", "logger=none")
    said = record["precision"]["actual"]["trainer"]["quantization"]["fake_quantize"]
    assert said.startswith("int8 W8A8") and "trainer quantization: fake_quantize int8 W8A8" in record["stdout"]
    assert "engines run: sampler (dtype bf16, head_dtype bf16); trainer (dtype bf16," in record["stdout"]
