"""Config schemas and validation: every node is checked before any work starts.

Each group option is one YAML whose `_target_` names a class; the class's constructor signature is
the option's schema (torchtune's rule), so a value lives only in its YAML and the types only in the
code. `validate` turns each node into a structured OmegaConf config built from that signature, which
rejects unknown keys and wrong types, and reports any problem as one line naming the bad key or
value and what is allowed. Arguments that the app passes at build time (the model path, the
precision, the sampling options, the seed) are not part of a node's schema.
"""
from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import math
import types
import typing
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlmm.runtime.errors import ConfigError

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # rlmm/
CONF_DIR = PACKAGE_DIR.parent / "conf"
if not CONF_DIR.is_dir():  # installed without the source tree: configs ship inside the package
    CONF_DIR = PACKAGE_DIR / "conf"

# Constructor arguments each group's components receive from the app rather than from their YAML.
BUILD_TIME_ARGS: dict[str, set[str]] = {
    "model": set(),
    "task": set(),
    "precision": set(),
    "sampler": {"model_path", "precision", "sampling", "seed", "prompt_tokens", "max_rows", "untie_head",
                "capture_routing", "quantization", "calibration_prompts"},
    "trainer": {"model_path", "precision", "sampling", "value_head", "quantization", "row_width"},
    "logger": {"run_config", "run_dir", "sweep"},
    "correction": set(),
    "algo": set(),
    "routing": set(),
    "support": set(),
    "quantization": set(),
    "chat_template": set(),
    "token_path": set(),
}

# Keys of an option's node that became config groups of their own, by the group: `sampler.quantization: int8` (before
# issue 51) is `quantization=int8`. A command line that sets the old key is told the new spelling
# (rlmm/launch/overrides.py); a run directory written before resumes (rlmm/run/resume.py).
KEYS_NOW_GROUPS = {"sampler.quantization": "quantization"}


# Groups whose options overlay one app's whole config (`# @package _global_`, `experiment: null` and
# `debug: null` in conf/train.yaml's and conf/probe.yaml's defaults lists): an option belongs to the app whose
# own section (`train:`, `probe:`) it sets.
OVERLAY_GROUPS = ("experiment", "debug")


def group_options(group: str, app: str | None = None) -> list[str]:
    """The options of conf/<group>/; a file whose name starts with `_` is one the options extend (their
    `defaults: [_base, _self_]`, e.g. conf/trainer/_base.yaml), not an option. Given an app, an overlay
    group's options are that app's."""
    files = sorted(p for p in (CONF_DIR / group).glob("*.yaml") if not p.name.startswith("_"))
    if app is not None and group in OVERLAY_GROUPS:
        files = [p for p in files if app in OmegaConf.load(p)]
    return [p.stem for p in files]


def _target_class(path: str, where: str):
    module_name, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{where}._target_: cannot import '{path}' ({err})") from None


def _omegaconf_type(hint: Any) -> Any:
    """Map a constructor annotation to a type OmegaConf can validate (Any when it cannot). An Enum stays itself:
    OmegaConf takes a member's name (`anchor: sampler`) and refuses any other value in one line naming the allowed
    ones (`Invalid value 'mu', expected one of [sampler, trainer]`); the constructor is still handed the name."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        inner = _omegaconf_type(args[0]) if len(args) == 1 else Any
        return Optional[inner] if type(None) in typing.get_args(hint) else inner
    if origin in (list, tuple, typing.Sequence):
        args = typing.get_args(hint)
        return list[_omegaconf_type(args[0])] if args and args[0] in (str, int, float, bool) else list
    if origin is dict or hint is dict:
        return dict
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint
    return hint if hint in (str, int, float, bool) else Any


def schema_of(cls: type, skip: set[str] = frozenset()) -> type:
    """A dataclass mirroring `cls.__init__` (minus `skip`): required args stay required."""
    hints = typing.get_type_hints(cls.__init__)
    fields = [("_target_", str, dataclasses.field(default=f"{cls.__module__}.{cls.__qualname__}"))]
    for name, param in inspect.signature(cls.__init__).parameters.items():
        if name == "self" or name in skip or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        kind = _omegaconf_type(hints.get(name, Any))
        default = dataclasses.MISSING if param.default is param.empty else param.default
        if isinstance(default, (list, dict)):
            fields.append((name, kind, dataclasses.field(default_factory=lambda d=default: type(d)(d))))
        else:
            fields.append((name, kind, dataclasses.field(default=default)))
    return dataclasses.make_dataclass(f"{cls.__name__}Schema", fields, kw_only=True)


def _one_line(err: OmegaConfBaseException) -> str:
    return str(err).splitlines()[0].strip()


def validate_node(node: DictConfig, where: str, skip: set[str] = frozenset()) -> None:
    """Check one `_target_` node against its class's constructor; raise ConfigError if it does not fit."""
    if "_target_" not in node:
        raise ConfigError(f"{where}: no _target_ (every option names the class that builds it)")
    cls = _target_class(node._target_, where)
    schema = schema_of(cls, skip)
    allowed = [f.name for f in dataclasses.fields(schema) if f.name != "_target_"]
    for key in node:
        if key != "_target_" and key not in allowed:
            raise ConfigError(f"{where}: unknown key '{key}' (allowed: {', '.join(allowed) or 'none'})")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), node)
    except OmegaConfBaseException as err:
        key = f"{err.full_key}: " if getattr(err, "full_key", None) else ""  # the key OmegaConf's own line leaves out
        raise ConfigError(f"{where}: {key}{_one_line(err)}") from None
    missing = [k for k in allowed if OmegaConf.is_missing(merged, k)]
    if missing:
        raise ConfigError(f"{where}: missing required key(s) {', '.join(missing)}")
    for key, value in node.items():  # nested options, each checked against its own class
        if isinstance(value, DictConfig) and "_target_" in value:  # one option held by another (algo.objective)
            validate_node(value, f"{where.split('=')[0]}.{key}")
        elif isinstance(value, DictConfig):  # a dict of them (a stack's stages)
            for name, inner in value.items():
                if isinstance(inner, DictConfig) and "_target_" in inner:
                    validate_node(inner, f"{where.split('=')[0]}.{key}.{name}")


def validate(cfg: DictConfig, choices: dict[str, str] | None = None) -> None:
    """Validate every group node of a composed config (call before any work starts), the keys every trainer shares
    (TRAINER_BOUNDS), and the nodes typed by rlmm/config/schema.py: no key they lack (a `+train.stepz=3` adds one)."""
    for group, skip in BUILD_TIME_ARGS.items():
        if group in cfg and cfg[group] is not None:
            name = f"{group}={choices[group]}" if choices and group in choices else group
            validate_node(cfg[group], name, skip)
    if "trainer" in cfg and cfg.trainer is not None:
        check_trainer_values(cfg.trainer, f"trainer={choices['trainer']}" if choices and "trainer" in choices
                             else "trainer")
    refuse_added_keys(cfg)


# The numeric keys every trainer shares (conf/trainer/_base.yaml) and the least each may be: (least, the least
# allowed too). Checked before any engine starts: `trainer.lr=nan` ran 12 s, then ended in a torch traceback.
TRAINER_BOUNDS = {"lr": (0.0, False), "weight_decay": (0.0, True), "grad_clip": (0.0, False),
                  "initial_loss_scale": (0.0, False)}
TRAINER_COUNTS = {"micro_batch_size": 1, "warmup_steps": 0, "logits_chunk_size": 1, "loss_scale_growth_interval": 1}


def check_trainer_values(node: DictConfig, where: str) -> None:
    """Raise ConfigError for a shared trainer key out of its range, or any of the trainer's numbers not finite."""
    for key, value in node.items():
        if isinstance(value, float) and not math.isfinite(value) and key not in TRAINER_BOUNDS:
            raise ConfigError(f"{where}: {key} must be a finite number, got {value}")
    for key, (least, allowed) in TRAINER_BOUNDS.items():
        value = node.get(key)
        if value is not None and not (math.isfinite(value) and (value >= least if allowed else value > least)):
            raise ConfigError(f"{where}: {key} must be a finite number {'>=' if allowed else '>'} {least:g}, got "
                              f"{value}")
    for key, least in TRAINER_COUNTS.items():
        value = node.get(key)
        if value is not None and value < least:
            raise ConfigError(f"{where}: {key} must be >= {least}, got {value}")


def refuse_added_keys(node: DictConfig, where: str = "") -> None:
    """Raise ConfigError for a key of a schema-typed node (rlmm/config/schema.py's dataclasses) that its dataclass lacks:
    Hydra's `+key=value` adds one to a typed node as to any other, and nothing would read it."""
    kind = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(kind):
        return
    allowed = [f.name for f in dataclasses.fields(kind)]
    for key in node:
        if key not in allowed:
            raise ConfigError(f"{where}{key}: unknown key (allowed: {', '.join(allowed)})")
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            refuse_added_keys(child, f"{where}{key}.")


def to_container(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)


def build(node: DictConfig, **runtime: Any) -> Any:
    """Instantiate a group node, passing run-time objects as they are.

    (Given as instantiate kwargs, Hydra would turn dataclasses into configs.)
    """
    from hydra.utils import instantiate

    return instantiate(node, _partial_=True)(**runtime)


def option_node(group: str, option: str) -> DictConfig:
    """conf/<group>/<option>.yaml as Hydra composes it into the app's config, outside Hydra: the files of the
    same group its `defaults` list names (`[_base, _self_]`: conf/trainer/_base.yaml's shared keys), merged
    in that order around its own values."""
    node = OmegaConf.load(CONF_DIR / group / f"{option}.yaml")
    defaults = list(node.pop("defaults", None) or ["_self_"])
    if "_self_" not in defaults:
        defaults.append("_self_")  # Hydra's rule: a config's own values come after its defaults
    parts = []
    for name in defaults:
        if not isinstance(name, str):
            raise ConfigError(f"{group}={option}: defaults entry {name!r}: only option files of the same group "
                              "(e.g. _base) are read outside Hydra")
        parts.append(node if name == "_self_" else option_node(group, name))
    return OmegaConf.merge(*parts)


def from_yaml(group: str, option: str, **values):
    """The component `conf/<group>/<option>.yaml` builds, outside Hydra (scripts, tests): `values` replace the
    YAML's and give the build-time arguments (`BUILD_TIME_ARGS`). Every value not given comes from the YAML,
    the one place it is written; an interpolation of the app's config (`seed: ${seed}`) must be given. A value that
    is a node with its own `_target_` (an algorithm's `objective`) is built as Hydra builds it."""
    from hydra.utils import get_class, instantiate

    node = {**OmegaConf.to_container(option_node(group, option)), **values}
    unresolved = sorted(k for k, v in node.items() if isinstance(v, str) and v.startswith("${"))
    if unresolved:
        raise ConfigError(f"{group}={option}: give {', '.join(unresolved)} (the YAML takes them from the app's config)")
    node = {k: instantiate(v) if isinstance(v, dict) and "_target_" in v else v for k, v in node.items()}
    return get_class(node.pop("_target_"))(**node)
