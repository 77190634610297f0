"""The update `rl_step` takes, checked against an independent computation of what it should be.

The formula tests (test_algos, test_corrections, test_metrics) pin each function; these pin how the
step *uses* them: which log-probs go where, which way the weights move, and by how much.
The independent side (`Reference`) shares nothing with the trainers' scoring path: each row is one
plain transformers forward of prompt + response (no micro-batches, no padding, no `logits_to_keep`),
the GRPO advantages and the PPO-clip surrogate are written out below, and the optimizer step is SGD
with lr 1, so the expected update is exactly minus the gradient of that loss.

The sampler is the transformers engine in fp32 with its weights perturbed (`perturb`), so trainer and
sampler disagree by a known, sizeable amount (|δ| ~ 0.1): importance weights far from 1, asymmetric
metrics (`kl_k1`, `ratio_mean`) whose sign shows which side is which, corrections that really mask.
"""
from __future__ import annotations

import copy
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from rlmm.config.options import CONF_DIR, from_yaml
from rlmm.corrections.base import Correction
from rlmm.mismatch.metrics import mismatch_metrics
from rlmm.policy.precision import SidePrecision
from rlmm.policy.rollouts import Rollouts
from rlmm.run.components import Components
from rlmm.run.step import SampledBatch, rl_step, rl_update
from tests.conftest import sampling, torchrun
from tests.test_corrections import mixed_staleness

FP32 = SidePrecision("fp32", False)
OPTIONS = sampling(max_new_tokens=6, temperature=0.9)  # T != 1: the trainer must score under T too
GROUP = 4
PERTURB = 0.05
CORRECTIONS = sorted(p.stem for p in (CONF_DIR / "correction").glob("*.yaml"))
# Bands and caps set inside this test's spread of ratios (0.91 to 1.09 per token, up to 1.14 per sequence),
# so that each masking correction keeps some tokens and drops others.
TEST_SETTINGS = {"icepop": {"low": 0.97, "high": 1.03}, "mis": {"high": 1.03}, "seq_mis": {"cap": 1.05},
                 "geo_rs": {"low": 0.97, "high": 1.03}, "token_rs": {"low": 0.97, "high": 1.03},
                 "seq_veto": {"threshold": 0.002}, "m2po": {"threshold": 0.001}, "tv_trust": {"eps": 0.01},
                 "vcpo": {"power": 100.0},  # ESS/B is ~0.9987 here: raised to the 100th, a step ~0.87 of the rate
                 "prox_loglinear": {"cap": 1.0}}  # drops the stale tokens whose approximated pi_prox is above mu
# The options that drop no token by design: weights, rescalings, step sizes, and verl's trust region around π_old,
# which this test's single optimizer step never leaves (π_θ = π_old at its only forward). Every other option must drop
# some tokens of this test's batch under its TEST_SETTINGS, so that the checks of what it drops bite: which options
# mask is found by running them, not listed by hand (a new masking method without settings fails, naming itself).
NEVER_DROPS = ("none", "tis", "seq_tis", "normalize", "seq_normalize", "bypass", "bypass_is", "vcpo",
               "mismatch_decay", "dppo_tv")


def algo(clip_low=0.2, clip_high=0.28, **overrides):
    from rlmm.algos import GRPO, ClippedSurrogate

    values = dict(group_size=GROUP, normalize_std=True, objective=ClippedSurrogate(clip_low, clip_high, None),
                  loss_aggregation="token", kl_coef=0.0, kl_estimator="k3", entropy_coef=0.0, count_rejected=False,
                  epochs=1, minibatches=1)
    return GRPO(**{**values, **overrides})


def correction(name: str):
    return instantiate({**OmegaConf.to_container(OmegaConf.load(CONF_DIR / "correction" / f"{name}.yaml")),
                        **TEST_SETTINGS.get(name, {})})


def stacked_correction(spelled: str):
    """`correction(name)`, or for `a+b` the stack of the stages, each with this test's settings."""
    from rlmm.corrections.stack import Stack

    stages = spelled.split("+")
    return correction(spelled) if len(stages) == 1 else Stack({stage: correction(stage) for stage in stages})


class OddLengthReward:
    """Arithmetic prompts, reward 1 for an odd-length completion: it varies inside every group, so
    every step has advantages of both signs."""

    def __init__(self, task):
        self.task = task

    def examples(self, split, n):
        return self.task.examples(split, n)

    def reward(self, example, completion):
        return float(len(completion) % 2)


class RecordingSampler:
    """A sampler that keeps every batch of rollouts it hands out, for the test to recompute from."""

    def __init__(self, sampler):
        self.inner = sampler
        self.drawn: list[Rollouts] = []

    def generate(self, prompt_ids, **kwargs):
        rollouts = self.inner.generate(prompt_ids, **kwargs)
        self.drawn.append(rollouts)
        return rollouts

    def __getattr__(self, name):
        return getattr(self.inner, name)


def sgd_trainer(backend: str, model_path: str, tmp_path: Path, micro_batch_size: int = 8,
                lr: float = 1.0, **values):
    """A trainer whose optimizer is plain SGD (no clipping), so an update is -lr x the gradient.
    `deepspeed-zero3`: DeepSpeed with its parameters partitioned (ZeRO-3). `values`: other YAML values."""
    if backend.startswith("deepspeed"):
        config = tmp_path / "sgd.json"
        config.write_text(json.dumps({"optimizer": {"type": "SGD", "params": {"lr": lr}},
                                      "zero_allow_untested_optimizer": True}))
        return from_yaml("trainer", "deepspeed", model_path=model_path, precision=FP32, sampling=OPTIONS,
                         micro_batch_size=micro_batch_size, grad_clip=0.0,
                         zero_stage=int(backend[-1]) if backend.startswith("deepspeed-zero") else 0,
                         config_file=str(config), **values)

    if backend == "fsdp":
        trainer = from_yaml("trainer", "fsdp", model_path=model_path, precision=FP32, sampling=OPTIONS,
                            micro_batch_size=micro_batch_size, grad_clip=0.0,
                            **values)
        trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=lr)  # the fp32 shards
        return trainer
    trainer = from_yaml("trainer", "torch", model_path=model_path, precision=FP32, sampling=OPTIONS,
                        micro_batch_size=micro_batch_size, grad_clip=0.0,
                        **values)
    trainer.optimizer = torch.optim.SGD(trainer.optimized_params, lr=lr)
    return trainer


def components(model_path, task, trainer, fix, grpo=None, perturb=PERTURB) -> Components:
    from transformers import AutoTokenizer

    sampler = RecordingSampler(from_yaml("sampler", "hf", model_path=model_path, precision=FP32, sampling=OPTIONS,
                                         seed=0, perturb=perturb))
    return Components(task=OddLengthReward(task), tokenizer=AutoTokenizer.from_pretrained(model_path),
                      sampler=sampler, trainer=trainer, correction=fix, algo=grpo or algo(), sampling=OPTIONS)


def weights_of(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.state_dict().items()}


def forward_each_row(model, rollouts: Rollouts, temperature: float, rows=None) -> torch.Tensor:
    """[len(rows), T] log π(y_t) at `temperature`, each row forwarded alone; differentiable under grad."""
    rows = range(len(rollouts)) if rows is None else rows
    out = torch.zeros(len(rows), max(len(r) for r in rollouts.response_ids))
    for i, row in enumerate(rows):
        prompt, response = rollouts.prompt_ids[row], rollouts.response_ids[row]
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0]
        predicting = logits[len(prompt) - 1:len(prompt) - 1 + len(response)].float() / temperature
        out[i, :len(response)] = predicting.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0]
    return out


class Reference:
    """The step recomputed by hand from the checkpoint and the rollouts the sampler drew."""

    def __init__(self, model_path: str, c: Components, rollouts: Rollouts, examples: list):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model.eval()
        self.rollouts = rollouts
        texts = c.tokenizer.batch_decode(rollouts.response_ids, skip_special_tokens=True)
        rewards = torch.tensor([c.task.reward(examples[i // GROUP], t) for i, t in enumerate(texts)],
                               dtype=torch.float64).view(-1, GROUP)
        # GRPO: A_i = (r_i - mean(group)) / (std(group) + 1e-6), Bessel-corrected std
        self.advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
                           ).view(-1).float()
        self.sampler_logprobs, self.mask = rollouts.padded_sampler_logprobs()
        with torch.no_grad():
            self.train_logprobs = self.logprobs()

    def logprobs(self, rows=None) -> torch.Tensor:
        return forward_each_row(self.model, self.rollouts, OPTIONS.temperature, rows)

    def surrogate(self, rows, old, weights, keep, clip_low=0.2, clip_high=0.28, counted=None,
                  penalty=None) -> torch.Tensor:
        """-Σ_kept w_t min(r_t A, clip(r_t, 1 - ε_low, 1 + ε_high) A) / (kept tokens): DAPO's token-level loss;
        `counted`: the tokens the divisor counts (default `keep`); `penalty`: a correction's per-token term of
        log π_θ, summed and divided by the same divisor."""
        logprobs = self.logprobs(rows)
        ratio = torch.exp(logprobs - old[rows])
        advantage = self.advantages[rows][:, None]
        per_token = -weights[rows] * torch.minimum(ratio * advantage,
                                                   ratio.clamp(1 - clip_low, 1 + clip_high) * advantage)
        kept = keep[rows]
        divisor = (kept if counted is None else counted[rows]).sum().clamp_min(1)
        loss = torch.where(kept, per_token, 0.0).sum() / divisor
        return loss if penalty is None else loss + penalty(logprobs).sum() / divisor

    def sgd_step(self, loss: torch.Tensor, lr: float = 1.0) -> dict[str, torch.Tensor]:
        """Take one SGD step on the reference model; returns the change of each weight."""
        self.model.zero_grad(set_to_none=True)
        loss.backward()
        change = {}
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                change[name] = -lr * (param.grad if param.grad is not None else torch.zeros_like(param))
                param.add_(change[name])
        return change


def relative_error(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """||actual - expected|| / ||expected|| over every weight."""
    difference = sum((actual[k] - expected[k]).double().pow(2).sum() for k in expected)
    return math.sqrt(difference / sum(e.double().pow(2).sum() for e in expected.values()))


def check_step(model_path, arithmetic_task, tmp_path, backend, fix, reuse_training_forward, prompts=4):
    """Run one `rl_step` with an SGD trainer; return its metrics, the weight change it made, and the reference.
    A correction that reads each token's staleness (`needs_versions`) gets the batch `rl_step` samples with
    `mixed_staleness` as its versions: a stand-in for those partial rollouts give (the tokens are sampled now; the
    correction reads only the numbers)."""
    trainer = sgd_trainer(backend, model_path, tmp_path)
    c = components(model_path, arithmetic_task, trainer, fix)
    examples = arithmetic_task.examples("train", prompts)
    try:
        before = weights_of(trainer)
        if fix.needs_versions:
            batch = SampledBatch.now(c, examples, None)
            batch = replace(batch, token_staleness=mixed_staleness(batch.rollouts.padded_sampler_logprobs()[1]))
            metrics = rl_update(c, batch, ratio_cap=2.0, reuse_training_forward=reuse_training_forward)
        else:
            metrics = rl_step(c, examples, ratio_cap=2.0, reuse_training_forward=reuse_training_forward)
        change = {k: v - before[k] for k, v in weights_of(trainer).items()}
    finally:
        trainer.close()
        c.sampler.close()
    return metrics, change, Reference(model_path, c, c.sampler.drawn[0], examples)


@pytest.mark.parametrize("reuse_training_forward", [False, True], ids=["scored_first", "one_pass"])
@pytest.mark.parametrize("backend", ["torch", "deepspeed", "deepspeed-zero2", "deepspeed-zero3", "fsdp"])
def test_step_equals_the_hand_computed_sgd_step(small_model_path, arithmetic_task, tmp_path, backend,
                                                reuse_training_forward):
    """One step (two micro-batches of 8 rows, TIS): the logged mismatch and correction figures are those of
    the rollouts' trainer and sampler log-probs, in that order; the loss is the surrogate's; the weights
    move by minus its gradient. Fails on a negated or rescaled loss, swapped arguments, ignored weights."""
    from rlmm.corrections.base import MicroBatchView, drop_split

    fix = correction("tis")
    metrics, change, ref = check_step(small_model_path, arithmetic_task, tmp_path, backend, fix,
                                      reuse_training_forward)
    expected_mismatch = mismatch_metrics(ref.train_logprobs, ref.sampler_logprobs, ref.mask, ratio_cap=2.0)
    assert expected_mismatch["logprob_abs_diff_mean"] > 0.02  # the perturbed sampler really disagrees
    # So the argument order shows in its sign: swapped, k1 would move by 2|k1|, far beyond the tolerance below.
    assert abs(expected_mismatch["kl_k1"]) > 1e-4
    logged = {k.removeprefix("mismatch/"): v for k, v in metrics.items() if k.startswith("mismatch/")}
    assert logged == pytest.approx(expected_mismatch, rel=1e-3, abs=1e-6)
    expected = fix(ref.train_logprobs, ref.sampler_logprobs, ref.mask)
    # Weights far enough from 1, token by token, for a loss that ignored them to move the weights otherwise (their
    # mean is near 1 by design: an importance weight's expectation under the sampler is 1).
    assert (expected.weights[expected.mask] - 1).abs().mean() > 1e-2
    logged = {k.removeprefix("correction/"): v for k, v in metrics.items() if k.startswith("correction/")}
    # prime-rl's kept/dropped split, over the update's forward (pi_theta = pi_old at it): TIS drops nothing
    advantages = torch.where(ref.mask, ref.advantages[:, None], 0.0)
    split = drop_split(MicroBatchView(logprobs=ref.train_logprobs, old_logprobs=expected.old_logprobs,
                                      trainer_logprobs=ref.train_logprobs, sampler_logprobs=ref.sampler_logprobs,
                                      advantages=advantages, mask=expected.mask, weights=expected.weights),
                       ref.mask, expected.mask)
    assert split["kl_k3_kept"][0] > 0 and split["kl_k3_dropped"][0] == 0
    expected_split = {key: numerator / denominator for key, (numerator, denominator) in split.items()}
    assert logged == pytest.approx(expected.metrics | expected_split, rel=1e-3, abs=1e-6)
    rows = list(range(len(ref.rollouts)))
    loss = ref.surrogate(rows, expected.old_logprobs, expected.weights, expected.mask)
    assert metrics["loss/loss"] == pytest.approx(loss.item(), rel=1e-4, abs=1e-7)
    expected_change = ref.sgd_step(loss)
    assert max(v.abs().max().item() for v in expected_change.values()) > 0
    assert relative_error(change, expected_change) < 1e-3


@pytest.mark.parametrize("name", CORRECTIONS)
def test_each_correction_moves_the_weights_as_its_output_implies(small_model_path, arithmetic_task, tmp_path, name):
    """A fresh trainer per correction: the update is the surrogate's SGD step under that correction's own
    old log-probs, weights and mask, and inside the update its own weights, mask and penalty on π_θ (one step on
    one minibatch: π_θ is π_old at the forward), at the learning rate times its step size (a fresh instance's, on
    the same batch) (a correction whose weights or step size never reach the update fails here)."""
    from rlmm.corrections.base import BatchView, MicroBatchView

    fix = correction(name)
    metrics, change, ref = check_step(small_model_path, arithmetic_task, tmp_path, "torch", fix, True)
    advantages = torch.where(ref.mask, ref.advantages[:, None], 0.0)
    staleness = mixed_staleness(ref.mask) if fix.needs_versions else None  # check_step's stand-in versions
    expected = fix(ref.train_logprobs, ref.sampler_logprobs, ref.mask, advantages, staleness)
    inside = fix.in_update(MicroBatchView(logprobs=ref.train_logprobs, old_logprobs=expected.old_logprobs,
                                          trainer_logprobs=ref.train_logprobs, sampler_logprobs=ref.sampler_logprobs,
                                          advantages=advantages, mask=expected.mask, weights=expected.weights,
                                          token_staleness=staleness))
    assert expected.mask.any()  # something is kept, so the step is not trivially zero
    dropped_before = expected.metrics["frac_tokens_masked"] > 0
    dropped_inside = not torch.equal(inside.mask, expected.mask)
    if name in NEVER_DROPS:
        assert not (dropped_before or dropped_inside), f"{name} is in NEVER_DROPS but dropped tokens"
    else:
        assert dropped_before or dropped_inside, (f"{name} dropped no token of this batch: give it TEST_SETTINGS under "
                                                  "which it drops some, or list it in NEVER_DROPS with why")
    if dropped_before:
        assert 0 < expected.metrics["frac_tokens_masked"] < 1, expected.metrics  # the mask is doing something
    if dropped_inside:
        dropped = metrics["correction/frac_tokens_dropped"]
        assert 0 < dropped < 1 and dropped == pytest.approx(1 - (inside.mask.sum() / expected.mask.sum()).item())
    if dropped_before or dropped_inside:  # the split sees what it dropped, wherever it dropped it
        assert metrics["correction/kl_k3_dropped"] > 0, metrics
    size = correction(name).step_size(BatchView(ref.train_logprobs, ref.sampler_logprobs, ref.mask, advantages,
                                                token_staleness=staleness))
    assert metrics.get("correction/lr_scale", 1.0) == pytest.approx(size.scale, rel=1e-6)
    if name == "vcpo":  # VCPO's factor is far enough from 1 for an update that ignored it to fail below
        assert size.scale < 0.95, size
    rows = list(range(len(ref.rollouts)))
    old = expected.old_logprobs if inside.old_logprobs is None else inside.old_logprobs  # prox_loglinear's own
    expected_change = ref.sgd_step(ref.surrogate(rows, old, expected.weights * inside.weights,
                                                 expected.mask & inside.mask, counted=expected.mask,
                                                 penalty=inside.penalty), lr=size.scale)
    assert max(v.abs().max().item() for v in expected_change.values()) > 0
    assert relative_error(change, expected_change) < 1e-3, name


class FixedStepSize(Correction):
    """The identity, but for a step size of `scale`: what the trainers do with a correction's factor alone."""

    def __init__(self, scale: float):
        self.scale = scale

    def step_size(self, batch):
        from rlmm.corrections.base import StepSize

        return StepSize(scale=self.scale, metrics={"lr_scale": self.scale})


@pytest.mark.parametrize("backend,reuse_training_forward", [("torch", True), ("deepspeed", True),
                                                            ("deepspeed", False), ("fsdp", True)],
                         ids=["torch-one_pass", "deepspeed-one_pass", "deepspeed-scored_first", "fsdp-one_pass"])
def test_the_optimizer_step_is_scaled_by_exactly_the_declared_factor(small_model_path, arithmetic_task, tmp_path,
                                                                    backend, reuse_training_forward):
    """SGD at lr 1: a correction declaring a step size of 0.37 moves every weight by 0.37 of the identity's move on
    the same rollouts (DeepSpeed steps inside the last backward: the factor is set before it, the one-pass update
    begun before the correction was asked); `loss/lr` is the rate used, `correction/lr_scale` the factor; the
    schedule's own rate is left for the next step."""
    moves, logged = {}, {}
    for scale in (1.0, 0.37):
        trainer = sgd_trainer(backend, small_model_path, tmp_path)
        c = components(small_model_path, arithmetic_task, trainer, FixedStepSize(scale))
        try:
            before = weights_of(trainer)
            logged[scale] = rl_step(c, arithmetic_task.examples("train", 4), ratio_cap=2.0,
                                    reuse_training_forward=reuse_training_forward)
            moves[scale] = {k: v - before[k] for k, v in weights_of(trainer).items()}
            groups = trainer.engine.optimizer.param_groups if backend == "deepspeed" else trainer.optimizer.param_groups
            assert groups[0]["lr"] == 1.0  # the rate is the schedule's again after the step
        finally:
            trainer.close()
            c.sampler.close()
    assert max(v.abs().max().item() for v in moves[1.0].values()) > 0
    assert relative_error(moves[0.37], {k: 0.37 * v for k, v in moves[1.0].items()}) < 1e-5
    assert logged[0.37]["loss/lr"] == pytest.approx(0.37 * logged[1.0]["loss/lr"], rel=1e-12)
    assert logged[0.37]["correction/lr_scale"] == 0.37


class ScaledAndMasked(Correction):
    """A correction for this test: weight `scale` on every kept token, every third response token masked,
    and (with `poison`) NaN as the old log-prob of each masked token, which must never reach the loss."""

    def __init__(self, scale: float, poison: bool):
        self.scale, self.poison = scale, poison

    def before_update(self, batch):
        out = Correction().before_update(batch)  # the identity: π_old the trainer's, weight 1
        keep = out.mask & (torch.arange(batch.mask.size(1)) % 3 != 2)
        old = torch.where(keep, out.old_logprobs, torch.nan) if self.poison else out.old_logprobs
        return type(out)(old_logprobs=old, weights=torch.where(keep, self.scale, 0.0), mask=keep, metrics=out.metrics)


def test_gradient_scales_with_the_weights_and_ignores_masked_tokens(small_model_path, arithmetic_task, tmp_path):
    """Doubling every token weight doubles the update; masked tokens, even with NaN old log-probs, add
    nothing: the update is the surrogate's gradient over the kept tokens alone."""
    changes = {}
    for scale, poison in ((1.0, False), (2.0, False), (1.0, True)):
        metrics, changes[scale, poison], ref = check_step(small_model_path, arithmetic_task, tmp_path, "torch",
                                                          ScaledAndMasked(scale, poison), False)
        assert metrics["train/skipped"] == 0
    doubled = {k: 2 * v for k, v in changes[1.0, False].items()}
    assert relative_error(changes[2.0, False], doubled) < 1e-5
    assert relative_error(changes[1.0, True], changes[1.0, False]) < 1e-6
    out = ScaledAndMasked(1.0, False)(ref.train_logprobs, ref.sampler_logprobs, ref.mask)
    assert 0 < out.mask.sum() < ref.mask.sum()
    rows = list(range(len(ref.rollouts)))
    expected = ref.sgd_step(ref.surrogate(rows, out.old_logprobs, out.weights, out.mask))
    assert relative_error(changes[1.0, False], expected) < 1e-3


@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
def test_one_update_raises_the_better_responses_and_lowers_the_worse(small_model_path, arithmetic_task, tmp_path,
                                                                     backend):
    """fp32 on both sides, no correction, the configured AdamW: after one step the responses with a positive
    advantage are more likely and those with a negative one less likely (sequence log-probs)."""
    from rlmm.corrections.none import NoCorrection

    if backend == "deepspeed":
        trainer = from_yaml("trainer", "deepspeed", model_path=small_model_path, precision=FP32, sampling=OPTIONS,
                            micro_batch_size=8, lr=1e-3)
    else:
        trainer = from_yaml("trainer", "torch", model_path=small_model_path, precision=FP32, sampling=OPTIONS,
                            micro_batch_size=8, lr=1e-3)
    c = components(small_model_path, arithmetic_task, trainer, NoCorrection(), perturb=0.0)
    examples = arithmetic_task.examples("train", 4)
    try:
        rl_step(c, examples, ratio_cap=2.0, reuse_training_forward=True)
        rollouts = c.sampler.drawn[0]
        ref = Reference(small_model_path, c, rollouts, examples)
        sampler_lp, mask = rollouts.padded_sampler_logprobs()
        change = (trainer.logprobs(rollouts) - ref.train_logprobs).where(mask, 0.0).sum(1)  # Δ log π(y_i)
    finally:
        trainer.close()
        c.sampler.close()
    positive, negative = ref.advantages > 0, ref.advantages < 0
    assert positive.sum() >= 2 and negative.sum() >= 2
    assert change[positive].mean() > 0 > change[negative].mean(), (change, ref.advantages)
    assert (ref.advantages * change).sum() > 0


def test_epochs_and_minibatches_take_the_hand_computed_steps(small_model_path, arithmetic_task, tmp_path):
    """Two epochs of two shuffled minibatches: each epoch's minibatches cover the rows once; every step is
    the surrogate's SGD step on its rows against the fixed old policy, from where the last one left; the
    clip is active (a narrow range), so clipped tokens must stop contributing."""
    from rlmm.corrections.tis import TokenTIS

    grpo = algo(epochs=2, minibatches=2, clip_low=0.02, clip_high=0.02)
    trainer = sgd_trainer("torch", small_model_path, tmp_path, lr=2.0)
    fix = TokenTIS(cap=2.0)
    c = components(small_model_path, arithmetic_task, trainer, fix, grpo=grpo)
    minibatches = []
    begin_update = trainer.begin_update

    def recording_update(rollouts, rows):
        minibatches.append(list(rows))
        return begin_update(rollouts, rows)

    trainer.begin_update = recording_update
    examples = arithmetic_task.examples("train", 4)
    try:
        before = weights_of(trainer)
        metrics = rl_step(c, examples, ratio_cap=2.0, reuse_training_forward=True)
        change = {k: v - before[k] for k, v in weights_of(trainer).items()}
    finally:
        trainer.close()
        c.sampler.close()
    assert len(minibatches) == 4
    for epoch in (minibatches[:2], minibatches[2:]):
        assert sorted(epoch[0] + epoch[1]) == list(range(16)) and len(epoch[0]) == len(epoch[1]) == 8
    assert minibatches[:2] != minibatches[2:]  # reshuffled each epoch
    assert metrics["loss/clipfrac"] > 0
    ref = Reference(small_model_path, c, c.sampler.drawn[0], examples)
    out = fix(ref.train_logprobs, ref.sampler_logprobs, ref.mask)
    total: dict[str, torch.Tensor] = {}
    for rows in minibatches:
        step = ref.sgd_step(ref.surrogate(rows, out.old_logprobs, out.weights, out.mask, 0.02, 0.02), lr=2.0)
        total = {k: total.get(k, 0) + v for k, v in step.items()}
    assert relative_error(change, total) < 1e-3


# -- several ranks, several micro-batches --------------------------------------------------------------------

def recorded_rollouts(model_path, task, prompts: int) -> dict:
    """The perturbed hf sampler's rollouts of `prompts` train prompts (GROUP each), as tests/ranks_step.py replays
    them."""
    c = components(model_path, task, None, None)
    examples = task.examples("train", prompts)
    rollouts = c.sampler.generate([c.tokenizer(e.prompt).input_ids for e in examples], n=GROUP)
    c.sampler.close()
    return {"prompts": [e.prompt for e in examples], "group_size": GROUP, "prompt_ids": rollouts.prompt_ids,
            "response_ids": rollouts.response_ids, "sampler_logprobs": [lp.tolist() for lp in rollouts.sampler_logprobs]}


# The options that can drop tokens inside the update (their class overrides `in_update`) and do so here; not those
# that read each token's staleness (tests/ranks_step.py samples no versions): prox_loglinear is elementwise per token,
# and tests/test_prox_approx.py checks its update over one and two micro-batches against AReaL's loss and gradient.
MASKING_IN_UPDATE = [name for name in CORRECTIONS if name not in NEVER_DROPS
                     and type(correction(name)).in_update is not Correction.in_update
                     and not correction(name).needs_versions]


@pytest.mark.parametrize("name", MASKING_IN_UPDATE)
def test_corrections_inside_the_update_take_the_same_step_at_any_micro_batching(small_model_path, arithmetic_task,
                                                                                tmp_path, name):
    """OPSM and tv_trust act on each micro-batch's π_θ: 1, 2 and 4 micro-batches of the same 24 rows give the same
    update and log the same correction figures (their counts are summed over the micro-batches, not averaged)."""
    from safetensors.torch import load_file

    from tests.ranks_step import step_on_share

    recorded = recorded_rollouts(small_model_path, arithmetic_task, 6)
    initial = load_file(Path(small_model_path) / "model.safetensors")
    changes, logged = {}, {}
    for size in (24, 12, 6):
        logged[size] = {}
        weights = step_on_share(small_model_path, recorded, "torch", tmp_path, metrics=logged[size], correction=name,
                                micro_batch_size=size)
        changes[size] = {k: v - initial[k] for k, v in weights.items()}
    assert 0 < logged[24]["correction/frac_tokens_dropped"] < 1, logged[24]
    for size in (12, 6):
        assert relative_error(changes[size], changes[24]) < 1e-4, size
        figures = [k for k in logged[24] if k.startswith(("correction/", "loss/"))]
        differing = {k: (logged[size][k], logged[24][k]) for k in figures
                     if not math.isclose(logged[size][k], logged[24][k], rel_tol=1e-4, abs_tol=1e-7)}
        assert not differing, (size, differing)


def test_two_ranks_take_the_one_rank_step_on_the_same_rows(small_model_path, arithmetic_task, tmp_path):
    """torchrun, 2 gloo ranks, each with its share of the prompts' rollouts (unequal token counts): the
    averaged update equals one rank's update on all the rows, on every backend (tests/ranks_step.py) and, on the
    torch backend, with OPSM and tv_trust (inside the update), M2PO with self-normalised TIS (over the whole
    batch) and PPO (its advantages whitened over every rank's tokens: 5% apart in pg_loss when per rank), and the
    mismatch, correction and loss metrics logged are the whole batch's, as one rank computes them: averaging
    the ranks' own had logged half the tokens as `num_tokens`, the mean of their maxima as
    `logprob_abs_diff_max` and `ratio_max`, and token means that weight the ranks' tokens unequally."""
    from safetensors.torch import load_file

    from rlmm.run.step import rank_share
    from tests.ranks_step import BACKENDS, CASES, step_on_share

    recorded = recorded_rollouts(small_model_path, arithmetic_task, 6)  # 12 rows a rank: micro-batches of 8 and 4
    tokens = [sum(len(recorded["response_ids"][p * GROUP + j]) for p in rank_share(list(range(6)), rank, 2)
                  for j in range(GROUP)) for rank in (0, 1)]
    assert tokens[0] != tokens[1]  # so a rank's own token count would weight the ranks' tokens unequally
    replay = tmp_path / "rollouts.json"
    replay.write_text(json.dumps(recorded))
    torchrun(["tests/ranks_step.py", small_model_path, str(replay), str(tmp_path)], timeout=600)
    initial = load_file(Path(small_model_path) / "model.safetensors")
    runs = [(backend, backend, "tis", "grpo") for backend in BACKENDS]
    runs += [(f"torch-{name}", "torch", fix, algorithm) for name, fix, algorithm in CASES]
    for name, backend, fix, algorithm in runs:
        one_metrics = {}
        one = {k: v - initial[k] for k, v in step_on_share(small_model_path, recorded, backend, tmp_path,
                                                           metrics=one_metrics, correction=fix,
                                                           algorithm=algorithm).items()}
        two = {k: v - initial[k] for k, v in load_file(tmp_path / f"{name}-2.safetensors").items()}
        assert max(v.abs().max().item() for v in one.values()) > 0
        assert relative_error(two, one) < 1e-4, name
        two_metrics = json.loads((tmp_path / f"{name}-2.json").read_text())
        whole_batch = [k for k in one_metrics if k.startswith(("mismatch/", "correction/", "loss/"))]
        assert {"mismatch/logprob_abs_diff_max", "correction/ratio_max", "loss/ratio_max", "loss/num_tokens"} <= set(
            whole_batch)
        assert one_metrics["mismatch/logprob_abs_diff_max"] > 1e-3  # the sampler's perturbed weights: a max the ranks' mean misses
        differing = {k: (two_metrics[k], one_metrics[k]) for k in whole_batch
                     if not math.isclose(two_metrics[k], one_metrics[k], rel_tol=1e-3, abs_tol=1e-7)}
        assert not differing, (name, differing)
        if name in ("torch-opsm", "torch-tv_trust", "torch-m2po"):  # each really drops something here
            dropped = one_metrics.get("correction/frac_tokens_dropped", one_metrics["correction/frac_tokens_masked"])
            assert 0 < dropped < 1, (name, dropped)


# -- the step learns ----------------------------------------------------------------------------------------

class EvenFirstDigit:
    """Reward 1 when the completion starts with an even digit: rare at first (the test model starts most
    answers with "-" or "1"), and a preference one token carries, so RL can raise it within a few steps."""

    def __init__(self, task):
        self.task = task

    def examples(self, split, n):
        return self.task.examples(split, n)

    def reward(self, example, completion):
        return float(completion[:1] in tuple("02468"))


def test_reward_rises_beyond_binomial_noise(small_model_path, arithmetic_task):
    """The built-in default's engines (vLLM bf16 sampler, DeepSpeed fp32 trainer, TIS): over 12 steps the
    mean reward of the last 3 steps exceeds that of the first 3 by more than 4 standard errors of the
    difference of two binomial proportions (a chance of 3e-5 under no learning at all)."""
    from transformers import AutoTokenizer

    from rlmm.corrections.tis import TokenTIS

    bf16 = SidePrecision("bf16", False)
    options = sampling(max_new_tokens=6)
    prompts_per_step, steps, window = 8, 12, 3
    sampler = from_yaml("sampler", "vllm", model_path=small_model_path, precision=bf16, sampling=options, seed=0)
    try:
        trainer = from_yaml("trainer", "deepspeed", model_path=small_model_path, precision=FP32, sampling=options,
                            micro_batch_size=32, lr=1e-3)
    except BaseException:
        sampler.close()
        raise
    c = Components(task=EvenFirstDigit(arithmetic_task), tokenizer=AutoTokenizer.from_pretrained(small_model_path),
                   sampler=sampler, trainer=trainer, correction=TokenTIS(cap=2.0), algo=algo(), sampling=options)
    examples = arithmetic_task.examples("train", steps * prompts_per_step)
    try:
        rewards = [rl_step(c, examples[s * prompts_per_step:(s + 1) * prompts_per_step], ratio_cap=2.0,
                           reuse_training_forward=True)["rollout/reward_mean"] for s in range(steps)]
    finally:
        trainer.close()
        sampler.close()
    n = window * prompts_per_step * GROUP
    first, last = sum(rewards[:window]) / window, sum(rewards[-window:]) / window
    noise = math.sqrt(first * (1 - first) / n + last * (1 - last) / n)
    assert last - first > 4 * max(noise, 1 / n), rewards


def test_vllm_bf16_sampler_follows_the_trainer_after_a_sync(small_model_path, arithmetic_task):
    """After a large update (one AdamW step of lr 1e-2) is synced into a vLLM bf16 engine, its log-probs of
    fresh rollouts are the new weights' up to bf16 rounding: several times closer to the trainer's than to
    the checkpoint's it started from."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlmm.corrections.none import NoCorrection

    options = sampling(max_new_tokens=6)
    sampler = from_yaml("sampler", "vllm", model_path=small_model_path, precision=SidePrecision("bf16", False),
                        sampling=options, seed=0)
    trainer = from_yaml("trainer", "torch", model_path=small_model_path, precision=FP32, sampling=options,
                        micro_batch_size=16, lr=1e-2)
    c = Components(task=OddLengthReward(arithmetic_task), tokenizer=AutoTokenizer.from_pretrained(small_model_path),
                   sampler=sampler, trainer=trainer, correction=NoCorrection(), algo=algo(), sampling=options)
    prompts = [c.tokenizer(e.prompt).input_ids for e in arithmetic_task.examples("test", 8)]
    try:
        assert rl_step(c, arithmetic_task.examples("train", 4), ratio_cap=2.0,
                       reuse_training_forward=True)["train/skipped"] == 0
        rollouts = sampler.generate(prompts, n=2)
        sampler_logprobs, mask = rollouts.padded_sampler_logprobs()
        synced = (sampler_logprobs - trainer.logprobs(rollouts))[mask].abs().mean().item()
    finally:
        trainer.close()
        sampler.close()
    with torch.no_grad():
        checkpoint = forward_each_row(AutoModelForCausalLM.from_pretrained(small_model_path, dtype=torch.float32),
                                      rollouts, options.temperature)
    stale = (sampler_logprobs - checkpoint)[mask].abs().mean().item()
    assert synced < 0.05 and stale > 5 * synced, (synced, stale)


@pytest.mark.parametrize("aggregation", ["token", "sequence", "constant"])
def test_logged_loss_metrics_do_not_depend_on_the_micro_batch_size(aggregation):
    """A minibatch's loss metrics combined from its micro-batches (`PolicyLossStats`, as its fields declare)
    are those of the whole minibatch in one piece: sums stay sums, token means are token-weighted, min and max
    stay min and max."""
    from rlmm.mismatch.loss_stats import PolicyLossStats, combined_metrics
    from rlmm.trainers.packing import micro_batches

    generator = torch.Generator().manual_seed(0)
    rows, width = 10, 7
    logprobs = -torch.rand(rows, width, generator=generator)
    old = logprobs + 0.3 * torch.randn(rows, width, generator=generator)
    mask = torch.rand(rows, width, generator=generator) > 0.3
    mask[3] = False  # a row with no kept token
    weights = torch.rand(rows, width, generator=generator) + 0.5
    advantages = torch.randn(rows, generator=generator)
    grpo = algo(loss_aggregation=aggregation)
    normalizer = grpo.loss_normalizer(mask, max_length=width)
    _, whole = grpo.policy_loss(logprobs, old, advantages, mask, weights, max_length=width, normalizer=normalizer)
    for size in (1, 3, 4):
        parts = [grpo.policy_loss(logprobs[c], old[c], advantages[c], mask[c], weights[c], max_length=width,
                                  normalizer=normalizer)[1] for c in micro_batches(list(range(rows)), size)]
        assert combined_metrics(PolicyLossStats, parts) == pytest.approx(whole, rel=1e-5, abs=1e-7), size
