"""The groups that are not ablation axes, composed: Hydra's directories (conf/hydra/default.yaml, one
file for both apps), `debug=<app>` (conf/debug/: shortens any run, an experiment's included) and
`scale=` (conf/scale/: the size of the model and the task; the `*_gpu` experiments select scale=gpu)."""
import copy
import re

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf, open_dict

import rlmm.config.schema  # noqa: F401
from rlmm.config.options import CONF_DIR, validate
from rlmm.launch.overrides import check_overrides

APPS = sorted(p.stem for p in CONF_DIR.glob("*.yaml"))
EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
DEBUG = sorted(p.stem for p in (CONF_DIR / "debug").glob("*.yaml"))
SCALES = sorted(p.stem for p in (CONF_DIR / "scale").glob("*.yaml"))
DATE, TIME = r"\d{4}-\d{2}-\d{2}", r"\d{2}-\d{2}-\d{2}"


def composed(app: str, overrides: list[str]):
    """The config and Hydra's node, as `rlmm <app> OVERRIDES` composes them."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(app, overrides=overrides, return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()
    hydra = cfg.hydra  # still under the whole config, so its interpolations resolve
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, hydra


def app_of(experiment: str) -> str:
    text = (CONF_DIR / "experiment" / f"{experiment}.yaml").read_text()
    return re.search(rf"rlmm (probe|train) -m experiment={experiment}\b", text).group(1)


def debug_app(option: str) -> str:
    """The app a debug option shortens: the one whose own section (probe:, train:) it sets."""
    apps = [app for app in APPS if app in OmegaConf.load(CONF_DIR / "debug" / f"{option}.yaml")]
    assert len(apps) == 1, f"debug={option} sets the sections of {apps or 'no app'}"
    return apps[0]


def leaves(node, prefix=""):
    for key, value in node.items():
        if key == "defaults":
            continue
        if OmegaConf.is_dict(value):
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


# -- hydra: directories and logging, one file for both apps -------------------------------------------

@pytest.mark.parametrize("app", APPS)
def test_each_app_keeps_its_run_and_sweep_directories(app):
    _, hydra = composed(app, [])
    assert re.fullmatch(rf"outputs/{app}/{DATE}/{TIME}", hydra.run.dir), hydra.run.dir
    assert re.fullmatch(rf"multirun/{app}/{DATE}/{TIME}", hydra.sweep.dir), hydra.sweep.dir
    assert OmegaConf.to_container(hydra.sweep)["subdir"] == "${hydra.job.num}"
    assert hydra.job.chdir is False
    assert hydra.job_logging.root.level == "WARNING" and hydra.job_logging.loggers.rlmm.level == "INFO"


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_each_experiment_sweeps_to_its_own_directory(name):
    _, hydra = composed(app_of(name), [f"experiment={name}"])
    assert re.fullmatch(rf"multirun/experiments/{name}/{DATE}_{TIME}", hydra.sweep.dir), hydra.sweep.dir
    assert hydra.run.dir.startswith(f"outputs/{app_of(name)}/")


# -- debug: a run in seconds, for users and the tests --------------------------------------------------

DEBUG_RUNS = [(option, experiment) for option in DEBUG
              for experiment in [None] + [e for e in EXPERIMENTS if app_of(e) == debug_app(option)]]


@pytest.mark.parametrize("option,experiment", DEBUG_RUNS, ids=[f"{o}-{e}" for o, e in DEBUG_RUNS])
def test_debug_shortens_every_run_of_its_app(option, experiment):
    """`debug: null` comes after `experiment: null` in the app's defaults list, so every value the debug option
    sets replaces the experiment's, and the config still validates."""
    app = debug_app(option)
    overrides = ([f"experiment={experiment}"] if experiment else []) + [f"debug={option}"]
    cfg, hydra = composed(app, overrides)
    validate(cfg, dict(hydra.runtime.choices))
    for key, value in leaves(OmegaConf.load(CONF_DIR / "debug" / f"{option}.yaml")):
        assert OmegaConf.select(cfg, key) == value, (key, OmegaConf.select(cfg, key))
    assert hydra.runtime.choices.logger == "none"
    assert cfg.sampling.max_new_tokens <= 16
    if app == "probe":
        assert cfg.probe.num_prompts * cfg.probe.samples_per_prompt <= 16
    else:
        assert cfg.train.steps <= 2 and cfg.train.prompts_per_step * cfg.algo.group_size <= 16
        assert cfg.train.eval_prompts <= 16 and cfg.train.checkpoint_every == 0


@pytest.mark.parametrize("option", DEBUG)
def test_a_debug_option_is_refused_by_the_other_app(option):
    from hydra.errors import ConfigCompositionException

    for app in set(APPS) - {debug_app(option)}:
        with pytest.raises(ConfigCompositionException):
            composed(app, [f"debug={option}"])


def test_an_unknown_debug_or_scale_option_is_one_line_naming_the_allowed_ones(capsys):
    train_debug = [option for option in DEBUG if debug_app(option) == "train"]  # rlmm train's own
    for override, allowed in (("debug=nope", train_debug), ("scale=nope", SCALES)):
        with pytest.raises(SystemExit) as exit_:
            check_overrides("train", [override])
        assert exit_.value.code == 2
        group = override.split("=")[0]
        assert capsys.readouterr().err.strip() == f"rlmm: error: unknown {group} 'nope' (allowed: {', '.join(allowed)})"


# -- scale: cpu (the apps' defaults) and gpu (Qwen2.5-0.5B-Instruct on GSM8K) ------------------------------

@pytest.mark.parametrize("app", APPS)
@pytest.mark.parametrize("scale", SCALES)
def test_every_scale_composes_and_validates_for_every_app(app, scale):
    cfg, hydra = composed(app, [f"scale={scale}"])
    validate(cfg, dict(hydra.runtime.choices))
    if scale == "cpu":
        assert cfg == composed(app, [])[0]  # the default: the app's own values
    else:
        assert (hydra.runtime.choices.model, hydra.runtime.choices.task) == ("hf", "gsm8k")
        assert cfg.model.path == "Qwen/Qwen2.5-0.5B-Instruct" and cfg.sampling.max_new_tokens == 512
        # GSM8K's varied answer lengths train under a token budget that holds several of the longest rows
        # (a row above it is a micro-batch of its own: slower, still correct), whichever trainer is chosen
        for trainer in ("deepspeed", "fsdp", "torch"):
            at_scale, choices = composed(app, [f"scale={scale}", f"trainer={trainer}"])
            validate(at_scale, dict(choices.runtime.choices))
            budget = at_scale.trainer.micro_batch_tokens
            assert budget >= 4 * cfg.sampling.max_new_tokens, (trainer, budget)
            # those micro-batches' gradients are summed and averaged over ranks in fp32 on every trainer
            # (conf/scale/trainer/gpu_<trainer>.yaml where the trainer's default is not fp32; docs/precision.md)
            sums = {"deepspeed": ("zero_stage", "grad_accum_dtype", "reduce_dtype"), "torch": ("grad_accum_dtype",),
                    "fsdp": ("reduce_dtype",)}[trainer]
            expected = {"zero_stage": 1, "grad_accum_dtype": "fp32", "reduce_dtype": "fp32"}
            assert {k: at_scale.trainer[k] for k in sums} == {k: expected[k] for k in sums}, trainer


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_each_gpu_experiment_is_its_cpu_counterpart_at_scale_gpu(name):
    """`NAME_gpu` selects scale=gpu and only adds its own sizes; every other experiment runs at scale=cpu."""
    cfg, hydra = composed(app_of(name), [f"experiment={name}"])
    validate(cfg, dict(hydra.runtime.choices))
    if name.endswith("_gpu"):
        assert name.removesuffix("_gpu") in EXPERIMENTS, f"{name} has no CPU counterpart"
        assert app_of(name) == app_of(name.removesuffix("_gpu"))
        counterpart = composed(app_of(name), [f"experiment={name.removesuffix('_gpu')}"])[1].runtime.choices
        # an MoE experiment (model=tiny_moe on CPU) needs a real MoE checkpoint at scale
        expected = ("allenai/OLMoE-1B-7B-0125-Instruct" if counterpart.model == "tiny_moe"
                    else "Qwen/Qwen2.5-0.5B-Instruct")
        assert hydra.runtime.choices.scale == "gpu" and cfg.model.path == expected
    else:
        assert hydra.runtime.choices.scale == "cpu"


@pytest.mark.parametrize("order", ["experiment first", "debug first"])
def test_the_defaults_list_fixes_the_order_of_experiment_and_debug(order):
    """`experiment: null`, then `debug: null`, in the app's defaults list: debug's sizes win over the
    experiment's whichever the command line writes first (Hydra would merge `+` groups in command-line order)."""
    overrides = ["experiment=collapse_warning", "debug=train"]  # both set train.steps and train.eval_prompts
    cfg, hydra = composed("train", overrides if order == "experiment first" else overrides[::-1])
    assert (hydra.runtime.choices.experiment, hydra.runtime.choices.debug) == ("collapse_warning", "train")
    assert (cfg.train.steps, cfg.train.eval_prompts) == (2, 4)  # debug's, not the experiment's 28 and 50
    assert cfg.train.monitor.enabled  # the experiment's own knob stays
    assert composed("train", [])[1].runtime.choices.experiment is None  # null: no experiment unless chosen


@pytest.mark.parametrize("override", ["+experiment=tis_under_mismatch", "+debug=train"])
def test_the_old_plus_spelling_fails_in_one_line_naming_the_new_one(override, capsys):
    with pytest.raises(SystemExit) as exit_:
        check_overrides("train", [override])
    assert exit_.value.code == 2
    new = override.removeprefix("+")
    assert capsys.readouterr().err.strip() == (f"rlmm: error: {override}: write {new}, no '+' "
                                               f"({new.split('=')[0]}: null is in the app's defaults list)")


@pytest.mark.parametrize("app,override", [("train", "experiment=fp16_vs_bf16"), ("probe", "debug=train")])
def test_an_overlay_of_the_other_app_fails_naming_this_apps_options(app, override, capsys):
    group, value = override.split("=")
    with pytest.raises(SystemExit) as exit_:
        check_overrides(app, [override])
    assert exit_.value.code == 2
    mine = [n for n in (EXPERIMENTS if group == "experiment" else DEBUG)
            if (app_of(n) if group == "experiment" else debug_app(n)) == app]
    other = "probe" if app == "train" else "train"
    assert capsys.readouterr().err.strip() == (f"rlmm: error: {group} '{value}' is not one of rlmm {app}'s but rlmm "
                                               f"{other}'s: run rlmm {other} {override} (rlmm {app}'s: "
                                               f"{', '.join(mine)})")


@pytest.mark.parametrize("app,override", [("train", "+experiment=fp16_vs_bf16"), ("probe", "+debug=train")])
def test_the_plus_spelling_of_the_other_apps_overlay_names_the_app_that_takes_it(app, override, capsys):
    """`rlmm train +experiment=fp16_vs_bf16` once said to write experiment=fp16_vs_bf16, which rlmm train then
    refused as a probe experiment."""
    group, value = override.removeprefix("+").split("=")
    other = "probe" if app == "train" else "train"
    with pytest.raises(SystemExit) as exit_:
        check_overrides(app, [override])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == (f"rlmm: error: {override}: {value} is rlmm {other}'s {group}: run "
                                               f"rlmm {other} {group}={value}")
