"""A value a config YAML sets lives in that YAML only: its constructor parameter has no default.

Each option of a `_target_` group (conf/<group>/<option>.yaml) names a class whose constructor is the
option's schema (rlmm/config/options.py). If a YAML key also had a constructor default, the two could drift
apart (a learning rate of 3e-5 in the YAML and 1e-4 in the code), and deleting the YAML line would
silently change the run instead of failing it.

The rule, for a class that several YAMLs share (corrections): a key set by ANY of its YAMLs has no
default, so every YAML of that class must set it. That second half needs no test of its own:
`validate_node` rejects a YAML that leaves a parameter without a default unset (unless the app
passes it at build time, `BUILD_TIME_ARGS`), and tests/test_config.py validates every option.
The other way round, a default that no YAML states (a parameter the app does not pass either) is a
value that lives only in the code: that fails too.
"""
import importlib
import inspect

from omegaconf import OmegaConf

from rlmm.config.options import BUILD_TIME_ARGS, group_options, option_node

OPTIONS = [(group, option) for group in BUILD_TIME_ARGS for option in group_options(group)]


def _load(group: str, option: str) -> tuple[dict, dict[str, inspect.Parameter]]:
    """The option's values as written (`${seed}` stays as is) and its class's constructor parameters."""
    values = OmegaConf.to_container(option_node(group, option), resolve=False)  # with its _base's keys
    module, _, name = values.pop("_target_").rpartition(".")
    params = inspect.signature(getattr(importlib.import_module(module), name).__init__).parameters
    return values, params


def test_every_option_is_checked():
    assert len(OPTIONS) > len(BUILD_TIME_ARGS)  # each group has at least one option, some several


def test_no_yaml_value_has_a_constructor_default_too():
    offenders = []
    for group, option in OPTIONS:
        values, params = _load(group, option)
        for key, value in values.items():
            # An unknown key is validate_node's to report (tests/test_config.py)
            if key in params and params[key].default is not inspect.Parameter.empty:
                offenders.append(f"{group}={option}: {key} (default {params[key].default!r} in the constructor, "
                                 f"{value!r} in the YAML)")
    assert not offenders, (f"{len(offenders)} YAML value(s) also have a constructor default; remove the "
                           "default (the YAML is the one place):\n  " + "\n  ".join(offenders))


def test_no_constructor_default_is_hidden_from_the_yaml():
    offenders = []
    for group, option in OPTIONS:
        values, params = _load(group, option)
        for key, param in params.items():
            if param.default is not inspect.Parameter.empty and key not in values and key not in BUILD_TIME_ARGS[group]:
                offenders.append(f"{group}={option}: {key} (default {param.default!r} in the constructor only)")
    assert not offenders, (f"{len(offenders)} constructor default(s) no YAML states; write the value in the "
                           "YAML and remove the default:\n  " + "\n  ".join(offenders))
