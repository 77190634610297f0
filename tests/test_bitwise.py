"""The bitwise arm (`sampler=bitwise`, rlmm/samplers/bitwise.py): the sampler's log-probs equal the trainer's to the
bit whatever the batch layout, each step checks it, and a step that is not bitwise fails naming the token."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlmm.config.options import from_yaml
from rlmm.policy.precision import SidePrecision
from rlmm.policy.rollouts import Rollouts, SamplingOptions
from rlmm.run.step import NotBitwise, SampledBatch
from tests.conftest import build_sampler, subprocess_env

ROOT = Path(__file__).parent.parent


def options(**values) -> SamplingOptions:
    fields = dict(temperature=1.0, top_p=0.9, top_k=0, max_new_tokens=8, logprobs="processed",
                  support=from_yaml("support", "sampler")) | values
    return SamplingOptions(**fields)


@pytest.fixture(scope="module")
def bitwise_sampler(small_model_path, prompts):
    sampler = build_sampler("bitwise", small_model_path, SidePrecision("bf16", False), options(), seed=3,
                            prompt_tokens=max(map(len, prompts)))
    yield sampler
    sampler.close()


def test_log_probs_equal_the_trainers_to_the_bit_across_three_batch_layouts(bitwise_sampler, small_model_path,
                                                                            prompts):
    """Three layouts of the same requests: all prompts in one call, scored in micro-batches of 32 rows; two calls of
    three, scored a row at a time; the prompts in reverse order, scored four rows at a time. The sampler draws the same
    tokens with the same log-prob bits in each (a request's stream is its own), and the trainer's recomputation equals
    them to the bit in each, top-p's kept sets and padding included."""
    n, places, call = 2, list(range(len(prompts))), bitwise_sampler.calls

    def generate(rows: slice) -> Rollouts:
        bitwise_sampler.calls = call  # the same sampling call each time: the same streams
        return bitwise_sampler.generate(prompts[rows], n=n, request_ids=places[rows])

    whole = generate(slice(None))
    halves = Rollouts.concat([generate(slice(0, 3)), generate(slice(3, None))])
    backwards = generate(slice(None, None, -1))
    backwards_order = [i * n + j for i in reversed(range(len(prompts))) for j in range(n)]
    assert halves.response_ids == whole.response_ids
    assert [backwards.response_ids[backwards_order.index(r)] for r in range(len(whole))] == whole.response_ids
    assert len({len(r) for r in whole.response_ids}) > 1 and len({len(p) for p in prompts}) > 1  # padding to vary
    assert whole.kept_tokens is not None and (whole.kept_tokens[0].sizes() > 1).any()  # top-p kept sets travel

    width = bitwise_sampler.width
    for rollouts, micro_batch_size in ((whole, 32), (halves, 1), (backwards, 4)):
        trainer = from_yaml("trainer", "torch", model_path=small_model_path, precision=SidePrecision("bf16", False),
                            sampling=options(), micro_batch_size=micro_batch_size, row_width=width)
        scored = trainer.logprobs(rollouts)
        trainer.close()
        sampled, mask = rollouts.padded_sampler_logprobs()
        assert torch.equal(scored[mask], sampled[mask]), (scored - sampled)[mask].abs().max()


def test_a_step_that_is_not_bitwise_fails_naming_the_first_token_that_differs():
    rollouts = Rollouts(prompt_ids=[[1, 2], [3]], response_ids=[[5, 6, 7], [8, 9]],
                        sampler_logprobs=[torch.tensor([-0.5, -1.0, -2.0]), torch.tensor([-0.25, -3.0])],
                        finish_reasons=["stop", "length"])
    sampled, mask = rollouts.padded_sampler_logprobs()
    batch = SampledBatch(rollouts, torch.zeros(2), {}, {})
    assert batch.agreement_metrics(sampled.clone(), mask, bitwise=True) == {
        "agreement/frac_tokens_identical": 1.0, "agreement/bitwise": 1.0}
    trainer = sampled.clone()
    trainer[1, 1] = torch.nextafter(trainer[1, 1], torch.tensor(0.0))  # one token one ulp off
    trainer[0, 2] = float("nan")  # a NaN differs too, and comes first
    assert batch.agreement_metrics(trainer, mask, bitwise=False) == {
        "agreement/frac_tokens_identical": pytest.approx(3 / 5), "agreement/bitwise": 0.0}
    with pytest.raises(NotBitwise, match=r"\(60\.00% of 5 tokens agree\), first at response token 2 of row 0 "
                                         r"\(token id 7\): sampler -2\.0 \(-0x1\.0+p\+1\), trainer nan"):
        batch.agreement_metrics(trainer, mask, bitwise=True)
    # rollouts sampled k updates ago against today's trainer: the gap is also policy lag, nothing is claimed
    assert SampledBatch(rollouts, torch.zeros(2), {}, {}, staleness=2).agreement_metrics(trainer, mask, True) == {}
    stale = SampledBatch(rollouts, torch.zeros(2), {}, {}, staleness=2, stale_logprobs=sampled.clone())
    assert stale.agreement_metrics(trainer, mask, bitwise=True)["agreement/bitwise"] == 1.0  # against the sampling weights


@pytest.mark.parametrize("arm", [
    # the default trainer (DeepSpeed), one pass: pi_old is the update's own forward with grad; OPSM (anchored at the
    # sampler) then sees every ratio exactly 1 and drops nothing (experiments/bitwise_control: OPSM here is the control)
    ["precision=bf16", "correction=opsm"],
    # fp32 on the torch trainer, top-p's kept sets, and one update of staleness scored at the sampling weights
    pytest.param(["precision=fp32", "trainer=torch", "sampling.top_p=0.9", "train.staleness=1",
                  "train.decompose_staleness=true"], marks=pytest.mark.slow),  # the stale reference: also a unit test
    # partial rollouts: each token checked against the trainer at its own version (each chunk scored when sampled)
    ["precision=fp32", "trainer=torch", "sampling.top_p=0.9", "train.staleness=2", "train.decompose_staleness=true",
     "train.partial_rollouts=true", "train.rollout_chunk=1"],
], ids=["bf16-deepspeed", "fp32-torch-top_p-stale", "fp32-torch-top_p-partial"])
def test_a_bitwise_run_trains_with_agreement_exact_at_every_step(tmp_path, arm):
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "rlmm.cli", "train", "debug=train", "sampler=bitwise", *arm,
                             "train.steps=3", f"hydra.run.dir={run_dir}"], capture_output=True, text=True,
                            timeout=600, env=subprocess_env(), cwd=ROOT, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    trained = [s for s in steps if s.get("step", 0) >= 1 and "train/skipped" in s]
    assert len(trained) == 3 and all(s["train/skipped"] == 0 for s in trained)
    assert all(s["agreement/bitwise"] == 1.0 and s["agreement/frac_tokens_identical"] == 1.0 for s in trained)
    # stale arms: the numerical part is the sampler against the trainer at the sampling weights (the rest is lag)
    assert all(s.get("mismatch/numerical/kl_k3", s["mismatch/kl_k3"]) == 0 for s in trained)
    if "correction=opsm" in arm:
        assert all(s["correction/ratio_min"] == s["correction/ratio_max"] == 1.0 for s in trained)
        assert all(s["correction/frac_sequences_dropped"] == 0 for s in trained)
    report = json.loads((run_dir / "summary.json").read_text())
    assert "sampler=bitwise" in json.dumps(report.get("precision", report))


def test_the_trainer_side_computes_each_row_and_each_head_position_alone(small_model_path, prompts):
    """What makes the layout hold on any machine, not only where a GEMM's rows happen not to depend on their count
    (this machine's, where scoring rows together still agrees): one row at the fixed width a forward, one position
    from its own copy a head projection (MKL documents results that depend on row count and alignment)."""
    from rlmm.trainers.packing import MicroBatching

    batching = MicroBatching(32, None, False, row_width=40)
    assert batching.split([10, 12, 9], [4, 7, 9]) == [[4], [7], [9]]
    assert batching.batch([[1, 2, 3]], [[4, 5]], pad_id=0).ids.shape == (1, 40)
    with pytest.raises(ValueError, match="does not fit the fixed width of 40"):
        batching.batch([[1] * 30], [[2] * 11], pad_id=0)

    trainer = from_yaml("trainer", "torch", model_path=small_model_path, precision=SidePrecision("bf16", False),
                        sampling=options(), micro_batch_size=32, row_width=40)
    seen = []
    project = trainer.head.project
    trainer.head.project = lambda hidden: seen.append((tuple(hidden.shape), hidden.storage_offset())) or project(hidden)
    rollouts = Rollouts([prompts[0], prompts[1]], [[5, 6, 7], [8]], [torch.zeros(3), torch.zeros(1)], ["length"] * 2)
    trainer.logprobs(rollouts)
    trainer.close()
    assert seen == [((1, 128), 0)] * 4


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_a_trainer_fake_quantized_scores_the_quantized_samplers_log_probs_to_the_bit(small_model_path, prompts, mode):
    """Quantization both sides share (trainer.fake_quantize): the bitwise sampler serving the mode's weights (and for
    W8A8 rounding each layer's input per token, as transformers' emulation of vLLM's kernel does) and the trainer
    multiplying with the same dequantize(quantize(W)) compute every log-prob alike; the trainer without fake
    quantization does not (its weights are the full-precision ones)."""
    quantization = from_yaml("quantization", mode)
    side = SidePrecision("bf16", False)
    sampler = build_sampler("bitwise", small_model_path, side, options(), seed=5, prompt_tokens=max(map(len, prompts)),
                            quantization=quantization)
    rollouts = sampler.generate(prompts, n=2)
    width = sampler.width
    sampler.close()
    sampled, mask = rollouts.padded_sampler_logprobs()
    scored = {}
    for fake in (True, False):
        trainer = from_yaml("trainer", "torch", model_path=small_model_path, precision=side, sampling=options(),
                            fake_quantize=fake, quantization=quantization, row_width=width)
        scored[fake] = trainer.logprobs(rollouts)
        trainer.close()
    assert torch.equal(scored[True][mask], sampled[mask]), (scored[True] - sampled)[mask].abs().max()
    assert not torch.equal(scored[False][mask], sampled[mask])
