"""The corrections that act on the step size (`Correction.step_size`): VCPO's effective-sample-size scaling and the
mismatch-triggered decay, each against values worked out by hand; the identity of every other option (a run
without them is bit-identical); stacking; the learning-rate factor applied to one optimizer step; the decay's
state through a checkpoint; the factor agreed over two ranks (tests/ranks_step_size.py).

Through the RL step and the trainers (the update scaled by exactly the factor): tests/test_update.py."""
from __future__ import annotations

import math

import pytest
import torch

from rlmm.config.options import CONF_DIR, from_yaml, group_options
from rlmm.corrections.base import BatchView, Correction, StepSize
from rlmm.corrections.mismatch_decay import MismatchTriggeredDecay
from rlmm.corrections.stack import Stack
from rlmm.corrections.vcpo import EffectiveSampleSizeStep, ess_ratio
from rlmm.trainers.optim import linear_warmup, scaled_lr
from tests.conftest import torchrun

ACTS_ON_THE_STEP = ("mismatch_decay", "vcpo")


def batch(trainer, sampler, mask) -> BatchView:
    trainer = torch.tensor(trainer, dtype=torch.float64)
    return BatchView(trainer_logprobs=trainer, sampler_logprobs=torch.tensor(sampler, dtype=torch.float64),
                     mask=torch.tensor(mask, dtype=torch.bool), advantages=torch.zeros_like(trainer))


# Two responses with S = log 1 and log 3 (w = 1 and 3), padding holding garbage, and an empty row (left out).
TWO = batch([[-1.0, -2.0, math.nan], [-1.0 + math.log(3), -0.5, -math.inf], [math.inf, 0.0, 0.0]],
            [[-1.0, -2.0, 7.0], [-1.0, -0.5, 0.0], [0.0, 0.0, 0.0]],
            [[1, 1, 0], [1, 1, 0], [0, 0, 0]])


# -- VCPO ----------------------------------------------------------------------------------------------------------

def vcpo(rho_target=1.0, power=0.5, cap=None) -> EffectiveSampleSizeStep:
    return EffectiveSampleSizeStep(rho_target=rho_target, power=power, cap=cap)


def test_vcpo_by_hand():
    """w = (1, 3): rho = (1 + 3)^2 / (2 (1 + 9)) = 0.8, the step sqrt(0.8); the linear rule 0.8; a target below rho
    leaves the rate alone; capped at 2, w = (1, 2): rho = 9 / 10."""
    size = vcpo().step_size(TWO)
    assert size.metrics["ess_ratio"] == pytest.approx(0.8, rel=1e-12)
    assert size.scale == size.metrics["lr_scale"] == pytest.approx(math.sqrt(0.8), rel=1e-12)
    assert vcpo(power=1.0).step_size(TWO).scale == pytest.approx(0.8, rel=1e-12)
    assert vcpo(rho_target=0.5).step_size(TWO).scale == 1.0
    assert vcpo(rho_target=0.9, power=1.0).step_size(TWO).scale == pytest.approx(0.8 / 0.9, rel=1e-12)
    assert vcpo(cap=2.0).step_size(TWO).metrics["ess_ratio"] == pytest.approx(0.9, rel=1e-12)


def test_vcpo_is_the_anchors_ess_and_does_not_overflow():
    """mit-han-lab/vcpo's formula written out (ESS = (sum w)^2 / (sum w^2 + 1e-8), over the trajectories) on seeded
    sequences; then S_i far beyond exp's range, where the anchor's exp(S) is inf and the ratio still 1/B-like."""
    generator = torch.Generator().manual_seed(0)
    trainer = torch.randn(16, 12, generator=generator, dtype=torch.float64) * 0.3 - 2
    sampler = trainer + torch.randn(16, 12, generator=generator, dtype=torch.float64) * 0.2
    mask = torch.arange(12)[None, :] < torch.randint(1, 13, (16, 1), generator=generator)
    w = torch.where(mask, trainer - sampler, 0.0).sum(1).exp()
    anchors = (w.sum() ** 2 / (w.square().sum() + 1e-8) / 16).item()
    assert ess_ratio(trainer, sampler, mask) == pytest.approx(anchors, rel=1e-7)
    assert 0.1 < anchors < 0.9  # the seeded ratios are really spread
    huge = ess_ratio(torch.tensor([[0.0], [1000.0]]), torch.zeros(2, 1), torch.ones(2, 1, dtype=torch.bool))
    assert huge == pytest.approx(0.5)  # w = (e^0, e^1000): one sequence carries the batch, ESS 1 of 2


def test_vcpo_identical_policies_and_empty_batch_keep_the_rate():
    same = batch([[-1.0, -2.0]], [[-1.0, -2.0]], [[1, 1]])
    assert vcpo().step_size(same).scale == 1.0
    empty = batch([[0.0]], [[0.0]], [[0]])
    assert vcpo().step_size(empty).scale == 1.0 and vcpo().step_size(empty).metrics["ess_ratio"] == 1.0


@pytest.mark.parametrize("values,key", [({"rho_target": 0.0}, "rho_target"), ({"rho_target": 1.5}, "rho_target"),
                                        ({"power": 0.0}, "power"), ({"cap": 0.5}, "cap")])
def test_vcpo_refuses_bad_values(values, key):
    with pytest.raises(ValueError, match=f"correction.{key}"):
        vcpo(**values)


# -- the mismatch-triggered decay -----------------------------------------------------------------------------------

def k3_batch(delta: float) -> BatchView:
    """One response of two tokens, each with log pi_old - log mu = delta: k3 = e^delta - 1 - delta."""
    return batch([[delta - 1.0, delta - 2.0]], [[-1.0, -2.0]], [[1, 1]])


def k3(delta: float) -> float:
    return math.exp(delta) - 1.0 - delta


def decay(**values) -> MismatchTriggeredDecay:
    return MismatchTriggeredDecay(**{"baseline_steps": 2, "surge": 3.0, "period_factor": 1.8, "factor": 0.5,
                                     "min_scale": 0.1, **values})


def test_decay_by_hand():
    """Baseline over steps 1-2 (delta 0.1: k3 0.005171); step 3 at delta 0.15 (k3 0.01163 < 3 x baseline 0.01551)
    does not trigger, step 4 at 0.2 (0.02140) does: s = 4, P = floor(1.8 x 4) = 7. The rate is the schedule's
    through step 6, then halves at steps 7, 14, 21 and stops at 0.1 from step 28 (0.5^4 = 0.0625 < 0.1), whatever
    the mismatch does after the trigger; a NaN step counts but changes nothing."""
    fix = decay()
    deltas = [0.1, 0.1, 0.15, 0.2] + [0.0, math.nan, 1.0] + [0.0] * 23
    sizes = [fix.step_size(k3_batch(d)) for d in deltas]
    assert k3(0.15) < 3 * k3(0.1) < k3(0.2)  # the hand values straddle the threshold as the docstring says
    expected = [1.0] * 6 + [0.5] * 7 + [0.25] * 7 + [0.125] * 7 + [0.1] * 3
    assert [s.scale for s in sizes] == expected
    assert [s.metrics["lr_scale"] for s in sizes] == expected
    assert math.isnan(sizes[0].metrics["kl_baseline"])
    assert sizes[1].metrics["kl_baseline"] == pytest.approx(k3(0.1), rel=1e-12)
    assert [s.metrics["surge_step"] for s in sizes[2:5]] == [0.0, 4.0, 4.0]
    assert sizes[3].metrics["decay_period"] == 7.0 and sizes[2].metrics["decay_period"] == 0.0


def test_decay_baseline_skips_nonfinite_steps_and_never_triggers_before_it_forms():
    """A NaN step in the baseline's window is not averaged in (the baseline waits for W finite steps); a surge
    before the baseline is formed triggers nothing."""
    fix = decay()
    for d in (1.0, math.nan, 0.1):  # step 1 feeds the baseline with a large value, step 2 is NaN, step 3 the second
        assert fix.step_size(k3_batch(d)).scale == 1.0
    assert fix.baseline() == pytest.approx((k3(1.0) + k3(0.1)) / 2, rel=1e-12)
    assert fix.state_dict() == {"steps": 3, "baseline_sum": pytest.approx(k3(1.0) + k3(0.1)), "baseline_count": 2,
                                "surge_step": 0}


def test_decay_resumed_from_its_state_continues_as_the_uninterrupted_one():
    deltas = [0.1, 0.1, 0.2] + [0.05] * 20
    whole = decay()
    expected = [whole.step_size(k3_batch(d)).scale for d in deltas]
    first = decay()
    for d in deltas[:5]:
        first.step_size(k3_batch(d))
    resumed = decay()
    resumed.load_state_dict(first.state_dict())
    assert [resumed.step_size(k3_batch(d)).scale for d in deltas[5:]] == expected[5:]
    assert min(expected) < 1.0  # the decay really ran in this sequence


@pytest.mark.parametrize("values,key", [({"baseline_steps": 0}, "baseline_steps"), ({"surge": 1.0}, "surge"),
                                        ({"period_factor": 0.0}, "period_factor"), ({"factor": 1.0}, "factor"),
                                        ({"min_scale": 0.0}, "min_scale")])
def test_decay_refuses_bad_values(values, key):
    with pytest.raises(ValueError, match=f"correction.{key}"):
        decay(**values)


# -- every other option, stacks ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("option", [o for o in group_options("correction") if o not in ACTS_ON_THE_STEP])
def test_every_other_correction_leaves_the_step_size_and_has_no_state(option):
    """The identity exactly: scale 1.0 and no metric (a run without a step-size method logs what it always has, and
    its every optimizer step is bit-identical), and nothing for the checkpoint."""
    fix = from_yaml("correction", option)
    assert fix.step_size(TWO) == StepSize() and fix.step_size(TWO).scale == 1.0
    assert fix.state_dict() == {}


def test_the_shipped_yamls_are_the_step_size_options():
    acting = sorted(o for o in group_options("correction")
                    if type(from_yaml("correction", o)).step_size is not Correction.step_size)
    assert acting == sorted(ACTS_ON_THE_STEP)
    assert (CONF_DIR / "correction" / "vcpo.yaml").exists()


def test_a_stack_multiplies_its_stages_factors_and_keeps_their_states():
    """tis+vcpo: VCPO's factor with TIS's weights; vcpo+mismatch_decay (decayed): the product; a stack of stages that
    do not act logs nothing. The stack's state is each stateful stage's, by name, and comes back."""
    tis = from_yaml("correction", "tis")
    assert Stack({"tis": tis, "normalize": from_yaml("correction", "normalize")}).step_size(TWO) == StepSize()
    size = Stack({"tis": tis, "vcpo": vcpo()}).step_size(TWO)
    assert size.scale == pytest.approx(math.sqrt(0.8), rel=1e-12)
    assert size.metrics == {"lr_scale": size.scale, "vcpo/lr_scale": size.scale,
                            "vcpo/ess_ratio": pytest.approx(0.8, rel=1e-12)}
    lowered = decay(baseline_steps=1, period_factor=0.5)  # baseline at step 1, trigger at 2, P = 1: 0.5^t
    stack = Stack({"vcpo": vcpo(), "mismatch_decay": lowered})
    stack.step_size(k3_batch(0.1))
    stack.step_size(k3_batch(0.5))
    state = stack.state_dict()
    assert state == {"mismatch_decay": lowered.state_dict()} and state["mismatch_decay"]["surge_step"] == 2
    again = Stack({"vcpo": vcpo(), "mismatch_decay": decay(baseline_steps=1, period_factor=0.5)})
    again.load_state_dict(state)
    assert again.step_size(TWO).scale == pytest.approx(math.sqrt(0.8) * 0.125, rel=1e-12)  # step 3: 0.5^3
    with pytest.raises(ValueError, match="'gone'"):
        again.load_state_dict({"gone": {}})


def test_bypass_is_refuses_a_stage_that_acts_on_the_step():
    with pytest.raises(ValueError, match="correction.stages.vcpo: acts on the step size"):
        from_yaml("correction", "bypass_is", stages={"vcpo": {}})


# -- the factor on one optimizer step ---------------------------------------------------------------------------------

def test_scaled_lr_scales_one_step_and_leaves_the_schedule():
    """SGD, lr 0.5 warming up over 4 steps: inside the block the step is the schedule's rate x 0.25, after it the
    rate is the schedule's again; with `settled` (DeepSpeed: the schedule steps inside the block) the rate after is
    the schedule's next one; factor 1 leaves the very float."""
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=0.5)
    schedule = linear_warmup(optimizer, 4)
    weight.grad = torch.ones(1)
    with scaled_lr(optimizer.param_groups, 0.25):
        optimizer.step()
    assert weight.item() == pytest.approx(-0.5 * 0.25 * 0.25)
    assert optimizer.param_groups[0]["lr"] == schedule.get_last_lr()[0] == 0.125
    with scaled_lr(optimizer.param_groups, 0.25, settled=schedule.get_last_lr):
        optimizer.step()
        schedule.step()
    assert optimizer.param_groups[0]["lr"] == schedule.get_last_lr()[0] == 0.25  # step 1 of the warm-up: 2/4
    rate = optimizer.param_groups[0]["lr"]
    with scaled_lr(optimizer.param_groups, 1.0):
        assert optimizer.param_groups[0]["lr"] == rate
    assert optimizer.param_groups[0]["lr"] is rate


def test_the_update_refuses_a_factor_that_is_no_rate():
    from rlmm.trainers.update import MicroBatchedUpdate

    update = MicroBatchedUpdate.__new__(MicroBatchedUpdate)
    for bad in (math.nan, math.inf, -0.1):
        with pytest.raises(ValueError, match="step scale must be finite and >= 0"):
            update.scale_lr(bad)


def test_the_factor_is_the_same_on_every_rank():
    """torchrun, 2 gloo ranks, each with its own rows: the step's factor (`OldPolicy.score`) is the whole batch's
    VCPO factor on both, and a correction that answers differently per rank gets the smallest on both."""
    torchrun(["tests/ranks_step_size.py"], timeout=300)


# -- the checkpoint --------------------------------------------------------------------------------------------------

class StateOnlyTrainer:
    """A trainer with no weights: what checkpoint.save / load need of one, for the correction's part alone."""

    def state_dict(self):
        return {"w": torch.zeros(1)}

    def checkpoint_state(self):
        return {}

    def load_checkpoint(self, weights, rank_states):
        self.loaded = weights

    @staticmethod
    def safe_checkpoint_types():
        return []


class Sampler:
    calls = 3

    def load_weights(self, weights):
        pass


def test_the_decays_state_survives_a_checkpoint(tmp_path):
    """checkpoint.save writes the correction's state into rankN.pt, checkpoint.load puts it into a fresh one: the
    resumed decay continues as the uninterrupted one. A correction without state writes no entry."""
    from rlmm.run import checkpoint

    deltas = [0.1, 0.1, 0.2] + [0.05] * 12
    whole = decay()
    expected = [whole.step_size(k3_batch(d)).scale for d in deltas]
    first = decay()
    for d in deltas[:4]:
        first.step_size(k3_batch(d))
    path = checkpoint.save(tmp_path, 4, StateOnlyTrainer(), Sampler(), correction=first)
    assert torch.load(path / "rank0.pt", weights_only=True)["correction"] == first.state_dict()
    resumed = decay()
    checkpoint.load(path, StateOnlyTrainer(), Sampler(), correction=resumed)
    assert [resumed.step_size(k3_batch(d)).scale for d in deltas[4:]] == expected[4:]
    assert min(expected) < 1.0
    plain = checkpoint.save(tmp_path / "plain", 1, StateOnlyTrainer(), Sampler(), correction=from_yaml("correction",
                                                                                                       "tis"))
    assert "correction" not in torch.load(plain / "rank0.pt", weights_only=True)
