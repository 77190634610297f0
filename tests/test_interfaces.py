"""Every option of every component group satisfies the interface the RL step, the checkpoint and the CLI
use (rlmm/run/interfaces.py): a new option that misses a method fails here, not in the middle of a run."""
from __future__ import annotations

import inspect

import pytest
from hydra.utils import get_class
from omegaconf import OmegaConf

from rlmm.config.options import CONF_DIR, from_yaml, group_options
from rlmm.run.interfaces import (Algorithm, Correction, Critic, CriticStep, MinibatchUpdate, PromptFormat, Sampler,
                                 TokenPath, Trainer, ValueLoss)

# Engines take minutes to start: their classes are checked for the protocol's methods; the cheap groups
# are built from their YAML and checked whole (attributes too) with isinstance.
ENGINE_GROUPS = {"sampler": Sampler, "trainer": Trainer}
BUILT_GROUPS = {"correction": Correction, "algo": Algorithm, "token_path": TokenPath, "chat_template": PromptFormat}


def protocol_methods(protocol) -> set[str]:
    return {name for name, member in vars(protocol).items()
            if not name.startswith("_") and (inspect.isfunction(member) or isinstance(member, (staticmethod, property)))}


@pytest.mark.parametrize("group,option", [(g, o) for g in ENGINE_GROUPS for o in group_options(g)])
def test_every_engine_has_its_interfaces_methods(group, option):
    cls = get_class(OmegaConf.load(CONF_DIR / group / f"{option}.yaml")._target_)
    missing = sorted(name for name in protocol_methods(ENGINE_GROUPS[group]) if not hasattr(cls, name))
    assert not missing, f"{group}={option} ({cls.__name__}) lacks {missing}"


@pytest.mark.parametrize("group,option", [(g, o) for g in BUILT_GROUPS for o in group_options(g)])
def test_every_correction_and_algorithm_satisfies_its_interface(group, option):
    assert isinstance(from_yaml(group, option), BUILT_GROUPS[group]), f"{group}={option}"


def test_each_trainers_update_has_the_update_interface():
    from rlmm.trainers.deepspeed_backend import DeepSpeedUpdate
    from rlmm.trainers.torch_backend import TorchUpdate

    for update in (TorchUpdate, DeepSpeedUpdate):
        missing = sorted(name for name in protocol_methods(MinibatchUpdate) if not hasattr(update, name))
        assert not missing, f"{update.__name__} lacks {missing}"


def test_the_critic_and_the_null_critic_have_the_critic_interface():
    """`ValueCritic` (a trainer inside: its class is checked) and `NoCritic` (built: checked whole) satisfy
    `Critic`, their steps `CriticStep`; an algorithm with `critic` set is a `ValueLoss`, and the null critic's
    step checks, trains and logs nothing (a run without a critic logs no critic/ key)."""
    import torch

    from rlmm.run.critic import NoCritic, NoCriticStep, ValueCritic, ValueCriticStep

    for cls, protocol in ((ValueCritic, Critic), (ValueCriticStep, CriticStep), (NoCriticStep, CriticStep)):
        missing = sorted(name for name in protocol_methods(protocol) if not hasattr(cls, name))
        assert not missing, f"{cls.__name__} lacks {missing}"
    null = NoCritic()
    assert isinstance(null, Critic) and not null.warming_up
    step = null.begin_step(None, None, torch.zeros(4), torch.ones(4, 3, dtype=torch.bool), seconds := {})
    assert isinstance(step, CriticStep) and step.values is None
    step.train([0, 1])
    assert (step.checked(), step.fault(), step.metrics(), seconds) == ({}, None, {}, {})
    assert (dict(null.state_dict()), null.checkpoint_state(), null.safe_checkpoint_types()) == ({}, {}, [])
    for option in group_options("algo"):
        algo = from_yaml("algo", option)
        assert isinstance(algo, ValueLoss) == bool(algo.critic), f"algo={option}"


def test_a_class_missing_a_method_is_caught():
    class NoClose:
        def generate(self, prompt_ids, *, n=1, greedy=False): ...

    assert "close" in protocol_methods(Sampler) - {n for n in dir(NoClose)}
