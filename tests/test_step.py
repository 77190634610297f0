"""The RL step's sampling stage (rlmm/run/step.py::sample_groups) with an algorithm that drops groups (DAPO's
dynamic sampling), on a sampler and a task whose rewards are known in advance."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from rlmm.config.options import from_yaml
from rlmm.conversation.chat import RawPrompts
from rlmm.policy.rollouts import Rollouts
from rlmm.run.episodes import SingleTurn
from rlmm.run.step import sample_groups
from rlmm.tasks import Example

GROUP = 2


class ScriptedSampler:
    """Each prompt's responses say what reward they get: "1" (right) or "0" (wrong), from the prompt's text
    ("a 10" -> one right, one wrong)."""

    def __init__(self):
        self.calls = []

    def generate(self, prompt_ids, *, n=1, greedy=False, request_ids=None):
        self.calls.append(len(prompt_ids))
        responses = [[int(ch)] for ids in prompt_ids for ch in ids[-1][-n:]]
        return Rollouts(prompt_ids=[ids for ids in prompt_ids for _ in range(n)], response_ids=responses,
                        sampler_logprobs=[torch.zeros(1) for _ in responses], finish_reasons=["stop"] * len(responses))


class Tokenizer:
    def __call__(self, text):
        return SimpleNamespace(input_ids=[text])

    def batch_decode(self, ids, skip_special_tokens=True):
        return [str(row[0]) for row in ids]


class RightIsOne:
    def reward(self, example, completion):
        return float(completion == "1")


def components(algo):
    tokenizer, task = Tokenizer(), RightIsOne()
    episodes = SingleTurn(task, RawPrompts(tokenizer, task), tokenizer, max_new_tokens=1)
    return SimpleNamespace(sampler=ScriptedSampler(), tokenizer=tokenizer, task=task, algo=algo, episodes=episodes)


def prompts(*outcomes: str) -> list:
    return [Example(prompt=f"p{i} {o}", answer="") for i, o in enumerate(outcomes)]


def test_dropped_groups_are_replaced_by_refill_groups_in_order():
    c = components(from_yaml("algo", "dapo", group_size=GROUP, max_sampling_rounds=3))
    refills = {1: prompts("11", "01"), 2: prompts("10", "00")}
    rollouts, rewards, metrics = sample_groups(c, prompts("10", "11", "00", "01"), refills.__getitem__, {})
    # kept: "10", "01" from the first round, "01" (p1) from round 1, "10" from round 2; rows grouped
    assert rewards.tolist() == [1, 0, 0, 1, 0, 1, 1, 0]
    assert c.sampler.calls == [4, 2, 2]
    assert metrics == {"groups_dropped": 4.0, "sampling_rounds": 2.0, "groups_filled_with_dropped": 0.0,
                       "sampled_reward_mean": 0.5}  # the first round's 8 responses, dropped groups included
    assert len(rollouts) == 8


def test_a_batch_still_short_after_the_rounds_is_filled_with_dropped_groups():
    c = components(from_yaml("algo", "dapo", group_size=GROUP, max_sampling_rounds=1))
    rollouts, rewards, metrics = sample_groups(c, prompts("11", "10", "00"), lambda r: prompts("00", "11", "00"), {})
    assert rewards.tolist() == [1, 0, 1, 1, 0, 0]  # the kept group, then the first dropped ones
    assert metrics == {"groups_dropped": 5.0, "sampling_rounds": 1.0, "groups_filled_with_dropped": 2.0,
                       "sampled_reward_mean": 0.5}


def test_grpo_keeps_every_group_and_never_refills():
    c = components(from_yaml("algo", "grpo", group_size=GROUP))
    _, rewards, metrics = sample_groups(c, prompts("11", "00"), lambda r: 1 / 0, {})
    assert rewards.tolist() == [1, 1, 0, 0] and metrics == {"sampled_reward_mean": 0.5} and c.sampler.calls == [2]
