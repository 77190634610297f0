"""Every override of a command line, and every combination of a sweep, composed and validated before
Hydra starts: a typo fails in one line (`rlmm: error: ...`, exit 2) before any model is loaded or job
submitted."""
from __future__ import annotations

from rlmm.runtime.errors import fail


def check_overrides(config_name: str, overrides: list[str]) -> None:
    """Compose and validate the config for every combination of the (sweep) overrides."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException, InstantiationException
    from hydra.utils import instantiate
    from omegaconf.errors import OmegaConfBaseException

    from rlmm.policy.rollouts import SamplingOptions
    from rlmm.runtime.errors import ConfigError

    ours = [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
    try:
        parsed = OverridesParser.create().parse_overrides(ours)
        # Hydra's own groups too (hydra/launcher=...), unless a searchpath adds options only Hydra sees.
        searchpath = any(o.startswith("hydra.searchpath") for o in overrides)
        hydra_groups = [] if searchpath else \
            OverridesParser.create().parse_overrides([o for o in overrides if o.startswith("hydra/")])
    except HydraException as err:
        fail(str(err).splitlines()[0])
    fail_on_unknown_options(parsed + hydra_groups, config_name)
    fail_on_keys_now_groups(ours)
    from rlmm.launch.launcher import launcher_target

    elsewhere = runs_on_another_machine(launcher_target(config_name, overrides) or "")
    combinations = [batch for batches in BasicSweeper.split_arguments(parsed, None) for batch in batches]
    combinations = with_config_sweep_params(config_name, combinations)
    composed_groups = {} if len(combinations) > 1 else None  # a sweep's combinations share their composes
    for combination in combinations:
        fail_on_keys_now_groups(combination)  # an experiment's grid too
        try:
            cfg, _ = composed_and_validated(config_name, combination, composed_groups)
            # These constructors only check their arguments (paths, dtype names, ranges), so bad
            # values surface here, before a sweep is submitted or an engine starts.
            built = {group: instantiate(cfg[group]) for group in ("model", "precision", "correction", "algo", "support",
                                                                  "quantization") if group in cfg}
            sampling = SamplingOptions(**cfg.sampling, support=built["support"])
            sampling.check_vocabulary(built["model"].known_vocab_size())
            if "sampler" in cfg:
                from rlmm.samplers.bitwise import check_bitwise_arm
                from rlmm.samplers.quantize import check_sampler_options

                check_sampler_options(cfg.sampler, built["quantization"], this_machine=not elsewhere)
                check_model_options(cfg, built, this_machine=not elsewhere)
                check_bitwise_arm(cfg, built["precision"], built["quantization"], sampling, instantiate(cfg.routing))
            if "trainer" in cfg:  # trainer.fake_quantize: a mode to share, and one the trainer's forward can hold
                from rlmm.trainers.fake_quantization import check_trainer_options

                check_trainer_options(cfg.trainer, built["quantization"], built["precision"].trainer)
            if not elsewhere:  # a SLURM job asks its own node's hardware when it starts
                check_engines_support(cfg, built["precision"])
            if "probe" in cfg:
                from rlmm.probe import check_options

                check_options(cfg)
            if "train" in cfg:
                from rlmm.run.train import check_options as check_train_options

                check_train_options(cfg.train)
                if cfg.train.attribution.every:
                    from rlmm.mismatch.attribution import check_attribution

                    check_attribution(cfg.precision.sampler_dtype, cfg.precision.trainer_dtype, cfg.trainer,
                                      option="train.attribution")
        except (ConfigError, ValueError) as err:
            fail(str(err).splitlines()[0])
        except InstantiationException as err:
            fail(_named_where_built(err))
        except (HydraException, OmegaConfBaseException) as err:
            fail(_one_line(err) + _allowed_keys_hint(config_name, combination, err))


def check_model_options(cfg, built: dict, this_machine: bool) -> None:
    """What the sampler (on `this_machine`) and the trainer refuse of the model itself, from the config.json values
    the model option knows before it is built or read (`known_config`; a hub id not fetched: checked when the
    engines start): a hybrid's recurrent layers (rlmm/models/hybrid.py)."""
    from hydra.utils import get_class

    from rlmm.models.hybrid import layers_probe_refusal, padding_free_refusal

    config = built["model"].known_config()
    if config is None:
        return
    problem = get_class(cfg.sampler._target_).refused_model(config, built["precision"].sampler.dtype) \
        if this_machine else None
    if not problem and cfg.trainer.padding_free:
        problem = padding_free_refusal(config)
    if not problem and "probe" in cfg and cfg.probe.layers:
        problem = layers_probe_refusal(config)
    if problem:
        raise ValueError(problem)


def fail_on_unknown_options(parsed: list, app: str | None = None) -> None:
    """For parsed overrides of config groups (rlmm's, and Hydra's own `hydra/...`): an option the group does
    not have (for `experiment` and `debug`, one of another app: `app`'s) fails in one line naming the group's
    options. `experiment=NAME` (`debug=`), the spelling from before both groups were in the apps' defaults
    lists, fails naming the one that works."""
    from hydra_plugins.rlmm_stack.stack_source import GROUP as STACKED_GROUP
    from hydra_plugins.rlmm_stack.stack_source import stack_problem, stage_names

    from rlmm.config.options import OVERLAY_GROUPS, group_options

    for override in parsed:
        group = override.key_or_group
        if group in OVERLAY_GROUPS and override.is_add():
            value = override.get_value_element_as_str()
            other_app = _other_app_of(group, value, app)
            if other_app:
                fail(f"+{group}={value}: {value} is rlmm {other_app}'s {group}: run rlmm {other_app} {group}={value}")
            fail(f"+{group}={value}: write {group}={value}, no '+' ({group}: null is in the app's defaults list)")
        options = _hydra_group_options(group) if group.startswith("hydra/") else group_options(group, app)
        if options and not override.is_delete():
            values = list(override.sweep_string_iterator()) if override.is_sweep_override() else [override.value()]
            for value in values:
                if str(value) in options:
                    continue
                if group == STACKED_GROUP and stage_names(str(value)) is not None:  # correction=a+b+c
                    problem = stack_problem(str(value), options)
                    if problem:
                        fail(problem)
                    continue
                other_app = _other_app_of(group, str(value), app)
                if other_app:  # an overlay of the other app
                    fail(f"{group} '{value}' is not one of rlmm {app}'s but rlmm {other_app}'s: run rlmm {other_app} "
                         f"{group}={value} (rlmm {app}'s: {', '.join(options)})")
                fail(f"unknown {group} '{value}' (allowed: {', '.join(options)})")


def fail_on_keys_now_groups(overrides: list[str]) -> None:
    """An override of a key that became a config group of its own (KEYS_NOW_GROUPS: `sampler.quantization=int8`, from
    before issue 51) fails in one line naming the spelling that works (`quantization=int8`)."""
    from rlmm.config.options import KEYS_NOW_GROUPS, group_options

    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key in KEYS_NOW_GROUPS:
            group = KEYS_NOW_GROUPS[key]
            fail(f"{key}={value}: {key} is the config group {group} now: write {group}={value} "
                 f"(allowed: {', '.join(group_options(group))})")


def _other_app_of(group: str, value: str, app: str | None) -> str | None:
    """The other app whose `group` (experiment, debug) has option `value` when `app`'s has not; else None."""
    from rlmm.config.options import group_options

    if app is None or value in group_options(group, app):
        return None
    return next((other for other in ("train", "probe") if other != app and value in group_options(group, other)), None)


def composed_and_validated(config_name: str, combination: list[str], composed_groups: dict | None = None):
    """The app's config for one combination of overrides (its `hydra` node dropped) and its group choices,
    validated against the schemas (`rlmm.config.options.validate`). With `composed_groups` (a dict kept across a
    sweep's combinations) the config of each set of group choices is composed once and each combination's value
    overrides (`seed=3`, `train.steps=24`) are applied to a copy by Hydra's own step for them: a compose is
    ~1 s, and a 96-run sweep differs mostly in values."""
    import copy

    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import open_dict

    import rlmm.config.schema  # noqa: F401  (registers the schemas)
    from rlmm.config.options import validate

    if composed_groups is None:
        cfg = _composed(config_name, combination)
    else:
        groups, values = _groups_and_values(combination)
        if tuple(groups) not in composed_groups:
            composed_groups[tuple(groups)] = _composed(config_name, groups)
        cfg = copy.deepcopy(composed_groups[tuple(groups)])
        ConfigLoaderImpl._apply_overrides_to_config(OverridesParser.create().parse_overrides(values), cfg)
    choices = dict(cfg.hydra.runtime.choices)
    with open_dict(cfg):
        del cfg["hydra"]
    validate(cfg, choices)
    return cfg, choices


def _composed(config_name: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from rlmm.config.options import CONF_DIR

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name, overrides=overrides, return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()


def _groups_and_values(combination: list[str]) -> tuple[list[str], list[str]]:
    """The overrides that choose a config group's option (or touch Hydra's config), which the defaults list
    consumes, and the plain value overrides Hydra applies after composing."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from rlmm.config.options import CONF_DIR

    groups, values = [], []
    for text, override in zip(combination, OverridesParser.create().parse_overrides(combination)):
        key = override.key_or_group.split("@")[0]
        is_value = not key.startswith("hydra") and not (CONF_DIR / key).is_dir() and override.package is None
        (values if is_value else groups).append(text)
    return groups, values


def with_config_sweep_params(config_name: str, combinations: list[list[str]]) -> list[list[str]]:
    """Cross each combination with the grid its composed config sets in `hydra.sweeper.params` (an
    experiment file's sweep, `experiment=NAME`), as Hydra's basic sweeper will under `-m`: the
    file's values first, the command line's replacing the file's for the same key. A combination
    that does not compose is kept as it is, for the caller's checks to report."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    import rlmm.config.schema  # noqa: F401  (registers the schemas)

    expanded = []
    for combination in combinations:
        try:
            params = _composed(config_name, combination).hydra.sweeper.params
            if not params:
                expanded.append(combination)
                continue
            grid = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()] + combination)
            expanded += [batch for batches in BasicSweeper.split_arguments(grid, None) for batch in batches]
        except (HydraException, OmegaConfBaseException):
            expanded.append(combination)
    return expanded


def _hydra_group_options(group: str) -> list[str]:
    """Options of one of Hydra's own groups (hydra/launcher: conf/hydra/launcher/ and plugins' configs)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from rlmm.config.options import CONF_DIR

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return sorted(GlobalHydra.instance().config_loader().get_group_options(group))
    finally:
        GlobalHydra.instance().clear()


def runs_on_another_machine(launcher_target: str) -> bool:
    """Whether the jobs of this launcher run on other nodes (SLURM), whose hardware this one (a login node
    without GPUs, say) cannot speak for."""
    return launcher_target.endswith("SlurmLauncher")


def check_engines_support(cfg, policy) -> None:
    """Ask each engine class whether it can run `policy` (cfg.precision, as built by the caller) on its side
    here (`Sampler.unsupported` and `Trainer.unsupported`, rlmm/run/interfaces.py)."""
    from hydra.utils import get_class

    for group, side in (("sampler", policy.sampler), ("trainer", policy.trainer)):
        problem = get_class(cfg[group]._target_).unsupported(side)
        if problem:
            fail(problem)


def _one_line(err: BaseException) -> str:
    """Hydra's composition errors span several lines; keep the headline and the reason."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    cause = err.__cause__
    reason = str(cause).splitlines()[0].strip() if cause is not None and str(cause) else ""
    if not reason:
        reason = next((line for line in lines[1:] if not line.startswith(("full_key", "object_type", "To append"))), "")
    return " ".join(filter(None, [lines[0] if lines else type(err).__name__, reason]))


def _named_where_built(err) -> str:
    """The first line of what a constructor raised, its `group.key` prefix naming the node Hydra built: a stage of
    a stacked correction says `correction.stages.tis.cap: ...`, not `correction.cap: ...`."""
    import re

    line = str(err.__cause__ or err).splitlines()[0]
    built = re.search(r"full_key: (\S+)", str(err))
    if built and "." in built.group(1) and not line.startswith(f"{built.group(1)}."):  # not if it names it already
        group = built.group(1).split(".")[0]
        line = re.sub(rf"^{group}\.", f"{built.group(1)}.", line)
    return line


def _allowed_keys_hint(config_name: str, combination: list[str], err: BaseException) -> str:
    """For `group.key=value` with an unknown key, list the keys the chosen option has, and name the nested option
    that has the key (`algo.clip_high`: algo.objective.clip_high)."""
    import re

    from omegaconf import OmegaConf

    from rlmm.config.options import BUILD_TIME_ARGS

    match = re.search(r"Could not override '(\w+)\.([\w.]+)'", str(err))
    if not match or match.group(1) not in BUILD_TIME_ARGS:
        return ""
    group, path = match.group(1), match.group(2).split(".")[:-1]  # correction.stages.tis.capp: stages, tis
    node = _composed(config_name, _groups_and_values(combination)[0])[group]
    for key in path:  # a nested option's node: one stage of a stacked correction
        if key not in node:
            return ""
        node = node[key]
    unknown = match.group(2).split(".")[-1]
    holders = [f"{match.group(1)}.{'.'.join([*path, key, unknown])}" for key, value in node.items()
               if OmegaConf.is_dict(value) and unknown in value]
    return (f" (allowed: {', '.join(k for k in node if k != '_target_')}"
            + (f"; {unknown} is {holders[0]}" if holders else "") + ")")
