"""Every file under conf/ composes, validates against its class's signature, and builds."""
from pathlib import Path

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

import rlmm.config.schema  # noqa: F401
from rlmm.config.options import BUILD_TIME_ARGS, CONF_DIR, ConfigError, group_options, schema_of, validate, validate_node
from tests.conftest import compose_app

APPS = sorted(p.stem for p in CONF_DIR.glob("*.yaml"))
# Not axes: conf/hydra holds Hydra's own settings and groups (the launchers), conf/experiment whole sweeps
# (tests/test_experiments.py runs them), conf/debug and conf/scale overlays of the whole config without a
# `_target_` (tests/test_config_groups.py).
NOT_AXES = ("hydra", "experiment", "debug", "scale")
OPTIONS = sorted((p.parent.name, p.stem) for p in CONF_DIR.glob("*/*.yaml")
                 if p.parent.name not in NOT_AXES and not p.name.startswith("_"))  # _base.yaml: not an option


def test_every_group_is_an_axis_with_options():
    assert set(BUILD_TIME_ARGS) == {p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name not in NOT_AXES}
    for group in BUILD_TIME_ARGS:
        assert group_options(group), group


@pytest.mark.parametrize("app", APPS)
def test_app_default_composes_and_validates(app):
    cfg, choices = compose_app(app, [])
    validate(cfg, choices)
    assert not OmegaConf.missing_keys(cfg)


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_validates_and_builds(group, option, tmp_path):
    if group not in compose_app("probe", [])[0]:
        # Groups the probe app does not use (correction, algo: for training) are checked on their own
        # until an app composes them.
        node = OmegaConf.load(CONF_DIR / group / f"{option}.yaml")
        validate_node(node, f"{group}={option}", BUILD_TIME_ARGS[group])
        assert instantiate(node) is not None
        return
    overrides = [f"{group}={option}"]
    if (group, option) == ("model", "hf"):  # a real checkpoint directory stands in for a hub id
        (tmp_path / "config.json").write_text("{}")
        overrides.append(f"model.path={tmp_path}")
    if (group, option) in (("task", "gsm8k"), ("task", "gsm8k_tools")):
        overrides.append(f"task.path={Path(__file__).parent / 'data' / 'gsm8k_sample.jsonl'}")
    cfg, choices = compose_app("probe", overrides)
    validate(cfg, choices)
    if group in ("model", "precision", "task"):  # cheap constructors: build them for real
        assert instantiate(cfg[group]) is not None


def test_unknown_key_is_rejected_with_the_allowed_ones():
    cfg, choices = compose_app("probe", ["+sampler.temprature=1"])
    with pytest.raises(ConfigError, match=r"sampler=vllm: unknown key 'temprature' \(allowed: batch_invariant, "):
        validate(cfg, choices)


@pytest.mark.parametrize("override,message", [
    ("+algo.objective.dual_clip=3", "algo.objective: unknown key 'dual_clip' (allowed: clip_low, clip_high)"),
    ("algo.objective.clip_high=wide",
     "algo.objective: clip_high: Value 'wide' of type 'str' could not be converted to Float"),
    ("algo.objective.clip_high=???", "algo.objective: missing required key(s) clip_high"),
])
def test_an_option_nested_in_an_option_is_validated_against_its_own_class(override, message):
    """An option held by another (an algorithm's `objective`, its own `_target_`) is checked as every option is, and
    the one line names the nested node (CISPO has no dual clip)."""
    cfg, choices = compose_app("train", ["algo=cispo", override])
    with pytest.raises(ConfigError) as err:
        validate(cfg, choices)
    assert str(err.value) == message


def test_wrong_type_is_rejected():
    node = OmegaConf.create({"_target_": "rlmm.trainers.torch_backend.TorchTrainer", "micro_batch_size": "big"})
    with pytest.raises(ConfigError, match="^trainer: micro_batch_size: Value 'big' of type 'str' could not be "
                                          "converted to Integer$"):
        validate_node(node, "trainer", BUILD_TIME_ARGS["trainer"])


def test_missing_required_key_is_reported():
    node = OmegaConf.create({"_target_": "rlmm.models.pretrained.PretrainedModel"})
    with pytest.raises(ConfigError, match="missing required key"):
        validate_node(node, "model=hf")


def test_unimportable_target_is_reported():
    node = OmegaConf.create({"_target_": "rlmm.nowhere.Thing"})
    with pytest.raises(ConfigError, match="cannot import 'rlmm.nowhere.Thing'"):
        validate_node(node, "sampler")


def test_schema_mirrors_the_constructor():
    class Component:
        def __init__(self, model_path: str, size: int, name: str | None = None, items: list[str] | None = None):
            pass

    schema = OmegaConf.structured(schema_of(Component, {"model_path"}))
    assert set(schema) == {"_target_", "size", "name", "items"}
    assert OmegaConf.is_missing(schema, "size")
    with pytest.raises(Exception):
        schema.size = "x"


@pytest.mark.parametrize("option,key,bad,allowed", [
    ("kl_rs", "estimator", "k4", "k1, k2, k3"),
    ("kl_rs", "level", "batch", "token, sequence"),
    ("seq_veto", "estimator", "k1", "k2, k3, min_ratio"),
    ("opsm", "anchor", "mu", "sampler, trainer"),
])
def test_an_enum_typed_argument_is_checked_by_the_schema(option, key, bad, allowed):
    """A constructor argument typed by an Enum (rlmm/corrections/base.py `choice`) is validated by OmegaConf from the
    schema: its members' names pass, anything else fails in one line naming the key, the value and the allowed
    names, before the class is built."""
    node = OmegaConf.load(CONF_DIR / "correction" / f"{option}.yaml")
    validate_node(node, f"correction={option}")
    with pytest.raises(ConfigError) as err:
        validate_node(OmegaConf.merge(node, {key: bad}), f"correction={option}")
    assert str(err.value) == f"correction={option}: {key}: Invalid value '{bad}', expected one of [{allowed}]"


def test_top_level_typo_fails_at_composition():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        compose_app("probe", ["sampling.temprature=0.5"])


def test_the_keys_every_trainer_shares_have_one_home(capsys):
    """conf/trainer/_base.yaml holds lr, its schedule, the micro-batching and the loss scaling; each trainer's
    file extends it (`defaults: [_base, _self_]`) with its own keys only, and `_base` is not an option."""
    from rlmm.config.options import option_node
    from rlmm.launch.overrides import check_overrides

    shared = OmegaConf.load(CONF_DIR / "trainer" / "_base.yaml")
    assert {"lr", "weight_decay", "warmup_steps", "grad_clip", "micro_batch_size"} <= set(shared)
    for option in group_options("trainer"):
        own = set(OmegaConf.load(CONF_DIR / "trainer" / f"{option}.yaml")) - {"defaults"}
        assert not own & set(shared), (option, sorted(own & set(shared)))
        composed = compose_app("train", [f"trainer={option}"])[0].trainer
        assert OmegaConf.to_container(composed) == OmegaConf.to_container(option_node("trainer", option))
        assert composed.lr == shared.lr
    assert "_base" not in group_options("trainer")
    with pytest.raises(SystemExit):
        check_overrides("train", ["trainer=_base"])
    assert capsys.readouterr().err.strip() == ("rlmm: error: unknown trainer '_base' (allowed: "
                                               f"{', '.join(group_options('trainer'))})")


def test_a_sweeps_combinations_composed_once_per_group_choice_equal_their_own_composes():
    """check_overrides composes each set of group choices of a sweep once and applies each combination's value
    overrides to a copy: the configs are those of composing every combination on its own."""
    from omegaconf import OmegaConf

    from rlmm.launch.overrides import composed_and_validated

    combinations = [[f"correction={c}", f"seed={s}", "train.steps=3", "++algo.count_rejected=true",
                     "correction.stages.tis.cap=3" if "+" in c else "sampling.temperature=0.7"]
                    for c in ("tis", "seq_veto+tis") for s in (0, 1)]
    shared = {}
    for combination in combinations:
        alone, alone_choices = composed_and_validated("train", combination)
        cached, cached_choices = composed_and_validated("train", combination, shared)
        assert OmegaConf.to_container(cached) == OmegaConf.to_container(alone) and cached_choices == alone_choices
    assert len(shared) == 2  # one compose per correction


def test_a_bad_value_in_a_sweep_fails_as_it_does_alone(capsys):
    from rlmm.launch.overrides import check_overrides

    def message(overrides):
        with pytest.raises(SystemExit) as exit:
            check_overrides("train", overrides)
        assert exit.value.code == 2
        return capsys.readouterr().err

    alone = message(["train.steps=ten"])
    assert "Value 'ten' of type 'str' could not be converted to Integer" in alone
    assert message(["seed=0,1", "train.steps=3,ten"]) == alone
    assert "Key 'temprature'" in message(["correction=tis,icepop", "sampling.temprature=0.7,0.9"])
