"""PPO with a critic: GAE, whitening and the value loss against hand-computed values, a critic that learns
in the RL step, and a resumed run that repeats the uninterrupted one (critic and its warm-up included)."""
from __future__ import annotations

import pytest
import torch

from rlmm.algos.ppo import gae
from rlmm.config.options import from_yaml
from rlmm.policy.precision import SidePrecision
from tests.conftest import build_trainer, sampling

MASK = torch.tensor([[True, True, True], [True, True, False]])
VALUES = torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.1, 123.0]])  # padding holds garbage
REWARDS = torch.tensor([1.0, 0.0])


def test_gae_by_hand():
    """gamma 0.9, lambda 0.8, reward 1 at row 0's last token:
    delta_2 = 1 - 0.7 = 0.3                  A_2 = 0.3
    delta_1 = 0.9 * 0.7 - 0.6 = 0.03         A_1 = 0.03 + 0.72 * 0.3 = 0.246
    delta_0 = 0.9 * 0.6 - 0.5 = 0.04         A_0 = 0.04 + 0.72 * 0.246 = 0.21712
    row 1 (reward 0, 2 tokens): delta_1 = -0.1, A_1 = -0.1; delta_0 = 0.9 * 0.1 - 0.2 = -0.11,
    A_0 = -0.11 + 0.72 * -0.1 = -0.182. Returns R_t = A_t + V_t; padding 0."""
    advantages, returns = gae(REWARDS, VALUES, MASK, gamma=0.9, lam=0.8)
    expected = torch.tensor([[0.21712, 0.246, 0.3], [-0.182, -0.1, 0.0]])
    assert torch.allclose(advantages, expected, atol=1e-6)
    assert torch.allclose(returns, torch.where(MASK, expected + VALUES, 0.0), atol=1e-6)


def test_gae_with_gamma_and_lambda_one_is_the_return_minus_the_value():
    advantages, returns = gae(REWARDS, VALUES, MASK, gamma=1.0, lam=1.0)
    assert torch.allclose(advantages, torch.tensor([[0.5, 0.4, 0.3], [-0.2, -0.1, 0.0]]), atol=1e-6)
    assert torch.equal(returns, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("mask", [[[True, False, True]], [[False, True, True]]], ids=["gap", "left-padded"])
def test_gae_refuses_a_mask_that_is_not_right_padded(mask):
    """GAE puts the reward on a row's last masked token and reads V(s_{t+1}) from the next column: with a gap
    or left padding it would silently compute something else, so it names the problem instead."""
    with pytest.raises(ValueError, match=r"gae: the response mask must be right-padded .*; rows \[0\] are not"):
        gae(torch.tensor([1.0]), torch.tensor([[0.5, 0.6, 0.7]]), torch.tensor(mask), gamma=1.0, lam=0.95)
    gae(torch.tensor([1.0, 0.0]), VALUES, torch.tensor([[True, True, False], [False, False, False]]), 1.0, 0.95)


def test_whitened_advantages_have_mean_zero_and_std_one_on_response_tokens():
    ppo = from_yaml("algo", "ppo", gamma=0.9, lam=0.8)
    advantages = ppo.advantages(REWARDS, MASK, VALUES)
    kept = advantages[MASK].double()
    assert kept.mean().abs() < 1e-6 and (kept.std() - 1).abs() < 1e-6 and advantages[~MASK].eq(0).all()
    raw = from_yaml("algo", "ppo", gamma=0.9, lam=0.8, whiten_advantages=False).advantages(REWARDS, MASK, VALUES)
    assert torch.allclose(raw, gae(REWARDS, VALUES, MASK, 0.9, 0.8)[0])


def test_value_loss_and_gradient_by_hand():
    """value_clip 0.2, normalizer 3:
      v 1.0, old 0.5, R 0: unclipped 1.0, clipped (0.7)^2 = 0.49 -> 0.5 * 1.0,   d/dv = (1.0 - 0) / 3
      v 0.2, old 0.5, R 1: unclipped 0.64, clipped (0.3 - 1)^2 = 0.49 -> 0.32,   d/dv = (0.2 - 1) / 3
      v 0.2, old 0.5, R 0: unclipped 0.04, clipped (0.3)^2 = 0.09 -> 0.045 (clipped: d/dv = 0)"""
    ppo = from_yaml("algo", "ppo")
    values = torch.tensor([[1.0, 0.2, 0.2, 7.0]], requires_grad=True)
    loss, metrics = ppo.value_loss(values, torch.tensor([[0.5, 0.5, 0.5, 0.0]]), torch.tensor([[0.0, 1.0, 0.0, 0.0]]),
                                   torch.tensor([[True, True, True, False]]), normalizer=3.0)
    assert loss.item() == pytest.approx((0.5 + 0.32 + 0.045) / 3, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, values)
    assert torch.allclose(grad, torch.tensor([[1.0 / 3, -0.8 / 3, 0.0, 0.0]]), atol=1e-6)
    assert metrics["value_clipfrac"] == pytest.approx(1 / 3) and metrics["num_tokens"] == 3


def ppo_components(model_path, task, **algo):
    from transformers import AutoTokenizer

    from rlmm.run.components import Components
    from rlmm.run.critic import ValueCritic
    from tests.test_train import ParityTask

    options, fp32 = sampling(max_new_tokens=6), SidePrecision("fp32", False)
    ppo = from_yaml("algo", "ppo", **{"group_size": 4, **algo})
    return Components(task=ParityTask(task), tokenizer=AutoTokenizer.from_pretrained(model_path),
                      sampler=from_yaml("sampler", "hf", model_path=model_path, precision=fp32, sampling=options, seed=0),
                      trainer=build_trainer("torch", model_path, fp32, options, micro_batch_size=8, lr=1e-3),
                      correction=from_yaml("correction", "tis"), algo=ppo, sampling=options,
                      critic=ValueCritic(build_trainer("torch", model_path, fp32, options, micro_batch_size=8,
                                                       value_head=True, lr=ppo.critic["lr"]),
                                         ppo.critic["warmup_steps"]))


def test_the_critic_warms_up_then_both_learn(small_model_path, arithmetic_task):
    """Warm-up steps move the critic alone; then the policy moves too, with token-level advantages."""
    from rlmm.run.step import rl_step

    c = ppo_components(small_model_path, arithmetic_task, critic_warmup_steps=1)
    prompts = arithmetic_task.examples("train", 4)
    try:
        policy = {k: v.clone() for k, v in c.trainer.state_dict().items()}
        critic = {k: v.clone() for k, v in c.critic.state_dict().items()}
        first = rl_step(c, prompts, ratio_cap=2.0, reuse_training_forward=True)
        assert first["critic/warming_up"] == 1 and "loss/loss" not in first
        assert all(torch.equal(policy[k], v) for k, v in c.trainer.state_dict().items())
        assert any(not torch.equal(critic[k], v) for k, v in c.critic.state_dict().items())
        losses = [rl_step(c, prompts, ratio_cap=2.0, reuse_training_forward=True) for _ in range(3)]
        assert all(m["critic/warming_up"] == 0 and m["train/skipped"] == 0 for m in losses)
        assert any(not torch.equal(policy[k], v) for k, v in c.trainer.state_dict().items())
        assert {"critic/value_mean", "critic/explained_variance", "critic/loss"} <= set(losses[-1])
    finally:
        c.close()


def test_critic_steps_fit_the_returns_of_a_batch(small_model_path, arithmetic_task):
    """Critic steps on one batch's returns: the value loss falls and the explained variance rises."""
    from rlmm.run.critic import critic_metrics

    c = ppo_components(small_model_path, arithmetic_task, critic_lr=1e-3, value_clip=0.0)  # the clip would hold V near its start
    try:
        rollouts = c.sampler.generate([c.tokenizer(e.prompt).input_ids for e in arithmetic_task.examples("train", 4)],
                                      n=4)
        _, mask = rollouts.padded_sampler_logprobs()
        # a reward the values can learn from the state: 1 when the response's first token is even
        rewards = torch.tensor([float(r[0] % 2 == 0) for r in rollouts.response_ids])
        step = c.critic.begin_step(c.algo, rollouts, rewards, mask, {})  # the values and returns held fixed
        fits = []
        for _ in range(6):  # each: the values before an optimizer step, and that step's loss
            values = c.critic.values(rollouts)
            step.train(list(range(16)))
            fits.append(critic_metrics(values, step.returns, mask, step.losses[-1:], False))
    finally:
        c.close()
    assert fits[-1]["critic/loss"] < 0.6 * fits[0]["critic/loss"]
    assert fits[-1]["critic/explained_variance"] > fits[0]["critic/explained_variance"]


def test_resume_with_a_critic_repeats_the_uninterrupted_run(small_model_path, arithmetic_task, tmp_path):
    from rlmm.run import checkpoint
    from rlmm.run.step import rl_step

    prompts = arithmetic_task.examples("train", 12)
    steps = [prompts[0:4], prompts[4:8], prompts[8:12]]
    torch.manual_seed(0)
    c = ppo_components(small_model_path, arithmetic_task, critic_warmup_steps=2, minibatches=2)
    try:
        rl_step(c, steps[0], ratio_cap=2.0, reuse_training_forward=True)
        checkpoint.save(tmp_path, 1, c.trainer, c.sampler, c.critic)
        uninterrupted = [rl_step(c, s, ratio_cap=2.0, reuse_training_forward=True) for s in steps[1:]]
        weights = ({k: v.clone() for k, v in c.trainer.state_dict().items()},
                   {k: v.clone() for k, v in c.critic.state_dict().items()})
    finally:
        c.close()
    c = ppo_components(small_model_path, arithmetic_task, critic_warmup_steps=2, minibatches=2)
    try:
        checkpoint.load(checkpoint.latest(tmp_path), c.trainer, c.sampler, c.critic)
        assert c.critic.steps == 1
        resumed = [rl_step(c, s, ratio_cap=2.0, reuse_training_forward=True) for s in steps[1:]]
        for before, after in zip(weights, (c.trainer.state_dict(), c.critic.state_dict())):
            assert all(torch.equal(before[k], v) for k, v in after.items())
    finally:
        c.close()
    assert [m["critic/warming_up"] for m in resumed] == [1, 0]
    for a, b in zip(uninterrupted, resumed):
        assert {k: v for k, v in a.items() if not k.startswith("perf/")} == \
            {k: v for k, v in b.items() if not k.startswith("perf/")}
