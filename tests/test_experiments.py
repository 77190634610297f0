"""The published ablations (conf/experiment/*.yaml): each composes and validates over its whole grid,
and runs for real, shortened by `debug=<app>` (conf/debug/); the mismatch-injection knob
(`sampler.perturb`) they rely on."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

import rlmm.config.schema  # noqa: F401
from rlmm.config.options import CONF_DIR, from_yaml
from rlmm.launch.overrides import check_overrides, with_config_sweep_params
from rlmm.policy.precision import SidePrecision
from tests.conftest import build_trainer, sampling, subprocess_env
from tests.this_cpu import experiment_pins, experiment_refusals

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
REPO = Path(__file__).resolve().parent.parent
GSM8K_SAMPLE = REPO / "tests" / "data" / "gsm8k_sample.jsonl"
GSM8K_SHORT = REPO / "tests" / "data" / "gsm8k_short.jsonl"  # five short word problems
# The built-in model, made small (builds in seconds; head_dim 64 for vLLM's CPU kernels).
SMALL_TINY = ["model.hidden_size=128", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
              "model.intermediate_size=256", "model.warm_start_steps=20", "model.warm_start_batch_size=16"]


def app_of(name: str) -> str:
    """The app an experiment belongs to, from the command its header documents."""
    text = (CONF_DIR / "experiment" / f"{name}.yaml").read_text()
    assert text.startswith("# @package _global_\n"), name
    match = re.search(rf"rlmm (probe|train) -m experiment={name}\b", text)
    assert match, f"{name}.yaml: the header names no `rlmm probe|train -m experiment={name}` command"
    return match.group(1)


def on_this_machine(name: str) -> list[str]:
    """What an experiment's grid is narrowed to on this machine (tests/this_cpu.py `experiment_pins`: what rlmm
    refuses here left out)."""
    app = app_of(name)
    return experiment_pins(name, app, composed(app, [f"experiment={name}"]))


def machine_refusals(name: str) -> list[str]:
    """The grid's rollout modes this machine's sampler refuses, left out (tests/this_cpu.py)."""
    cfg = composed(app_of(name), [f"experiment={name}"])
    return experiment_refusals(cfg.hydra.sweeper.params, cfg.sampler._target_)


def composed(app: str, overrides: list[str]):
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(app, overrides=overrides, return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_validates_over_its_whole_grid(name):
    app = app_of(name)
    overrides = [f"experiment={name}", *on_this_machine(name)]
    grid = composed(app, [f"experiment={name}"]).hydra.sweeper.params
    assert grid and len(with_config_sweep_params(app, [[f"experiment={name}"]])) > 1, "an experiment is a sweep grid"
    check_overrides(app, overrides)  # what `rlmm <app> -m` runs first: every combination (exits 2 on a bad one)


@pytest.mark.parametrize("name", [n for n in EXPERIMENTS if machine_refusals(n)] or
                         [pytest.param(None, marks=pytest.mark.skip("every experiment's grid runs on this machine"))])
def test_a_grid_value_this_machine_cannot_run_is_refused_for_its_reason(name, capsys):
    """Where this CPU cannot run a rollout mode of an experiment's grid (machine_refusals), the whole grid is
    refused before any job in one line naming the value and the CPU, rather than failing some jobs later."""
    overrides = [f"experiment={name}", *(p for p in on_this_machine(name) if p not in machine_refusals(name))]
    with pytest.raises(SystemExit) as stop:
        check_overrides(app_of(name), overrides)
    error = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(error) == 1 and "this CPU" in error[0], error


def test_a_bad_value_in_an_experiment_grid_fails_before_any_job(tmp_path):
    """The grid an experiment file sets is validated, not only the command line's."""
    result = subprocess.run([sys.executable, "-m", "rlmm.cli", "probe", "-m", "experiment=fp16_vs_bf16",
                             "precision.sampler_dtype=bf16,fp61", f"hydra.sweep.dir={tmp_path}"],
                            capture_output=True, text=True, timeout=300, env=subprocess_env(), stdin=subprocess.DEVNULL)
    assert result.returncode == 2 and "fp61" in result.stderr, result.stderr[-2000:]
    assert not list(tmp_path.glob("*/probe.json"))


def shortened(name: str, combinations: int, model_path: str, cache_dir: Path) -> tuple[str, list[str]]:
    """The experiment's command, shrunk: its first grid key keeps `combinations` values, every other key
    its first, and the runs are short (`debug=<app>`: last in the app's defaults list, its sizes win over the
    experiment's). A GPU variant runs on the small test checkpoint and data."""
    app = app_of(name)
    cfg = composed(app, [f"experiment={name}", *on_this_machine(name)])
    pins = [override.split(",")[0] for override in on_this_machine(name)]  # one value each: not swept here
    pinned = {override.split("=", 1)[0] for override in pins}
    keys = [key for key in cfg.hydra.sweeper.params if key not in pinned]
    grid = [f"{key}={','.join(str(cfg.hydra.sweeper.params[key]).split(',')[:combinations if i == 0 else 1])}"
            for i, key in enumerate(keys)]
    choices = cfg.hydra.runtime.choices
    model = {"tiny": SMALL_TINY + [f"model.cache_dir={cache_dir}"],  # tiny_moe, tiny_bpe: the shipped ones
             "tiny_moe": [], "tiny_bpe": []}.get(choices.model, [f"model.path={model_path}"])
    task = [f"task.path={GSM8K_SAMPLE}"] if choices.task == "gsm8k" and not (REPO / cfg.task.path).is_file() else []
    if choices.task == "gsm8k_tools":  # conversations that fit the small checkpoint's 128 positions, a character each
        task = [f"task.path={GSM8K_SHORT}", "task.system_prompt=Solve.", "task.max_context_tokens=120"]
    return app, [f"experiment={name}", *grid, *pins, *model, *task, f"debug={app}"]


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> Path:
    """One cache for the small built-in models of every shortened experiment in this session."""
    return tmp_path_factory.mktemp("rlmm-experiment-cache")


def run_shortened(name, combinations, tmp_path, small_model_path, tiny_cache):
    app, overrides = shortened(name, combinations, small_model_path, tiny_cache)
    sweep = tmp_path / "sweep"
    result = subprocess.run([sys.executable, "-m", "rlmm.cli", app, "-m", *overrides, f"hydra.sweep.dir={sweep}"],
                            capture_output=True, text=True, timeout=1200, env=subprocess_env(),
                            stdin=subprocess.DEVNULL, cwd=REPO)
    assert result.returncode == 0, (" ".join(overrides) + "\n" + result.stdout + result.stderr)[-4000:]
    record = "probe.json" if app == "probe" else "summary.json"
    assert len(list(sweep.glob(f"*/{record}"))) == combinations
    from rlmm.table import main as table

    table([str(sweep)])  # the experiment's table, as its README makes it
    assert (sweep / "table" / "table.md").read_text().startswith("|")
    return sweep


# Experiments whose first combination runs a path the default run already takes elsewhere: their shortened runs
# are `slow`, beside the two combinations of every experiment; their whole grids are validated in the default run.
# The bf16 probe with vLLM or the transformers sampler and its batch-invariance part (tests/test_probe.py,
# tests/test_vllm_precision.py), sampler.perturb with TIS (the perturb tests below, tests/test_train.py), the
# collapse monitor (tests/test_monitor.py), the probe with both attributions (tests/test_probe.py), the train-time
# attribution (tests/test_attribution.py), bf16 rollouts with no correction (quantized_rollouts' first arm: the
# default run, tests/test_train.py), top-p with the sampler's kept set (tests/test_support.py's rlmm train run).
SHORTENED_ONLY_IN_SLOW = {"batch_invariance", "batch_invariance_wide", "fp16_vs_bf16", "fp32_head", "length_growth",
                          "trainer_backends", "tis_under_mismatch", "collapse_warning", "attribution",
                          "attribution_training", "quantized_rollouts", "sampling_truncation",
                          "off_policy_corrections",  # its first arm, tis at staleness 1: test_staleness's rlmm train run
                          "bitwise_control",  # its first arm, vLLM bf16 on both sides without a correction
                          "staleness", "partial_rollouts",  # their first arms, staleness 0 without partial rollouts:
                          # the default run (tests/test_train.py)
                          "routing_replay_training",  # tiny_moe trained with routing=none: tests/test_routing.py's step
                          "multi_turn_tokens"}  # token_path=tokens on the calculator: tests/test_multi_turn.py's runs


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SHORTENED_ONLY_IN_SLOW else n
                                  for n in EXPERIMENTS if not n.endswith("_gpu")])
def test_experiment_runs_shortened(name, tmp_path, small_model_path, tiny_cache):
    """One combination of each CPU experiment, a few prompts (or one training step), for real."""
    run_shortened(name, 1, tmp_path, small_model_path, tiny_cache)


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_runs_two_combinations(name, tmp_path, small_model_path, tiny_cache):
    """Two combinations of every experiment, the GPU variants included (on the small test checkpoint)."""
    sweep = run_shortened(name, 2, tmp_path, small_model_path, tiny_cache)
    overrides = [OmegaConf.load(p) for p in sorted(sweep.glob("*/.hydra/overrides.yaml"))]
    assert overrides[0] != overrides[1]


# -- sampler.perturb -----------------------------------------------------------------------------

def test_weight_noise_has_the_asked_relative_size_and_is_seeded():
    from rlmm.samplers.perturb import WeightNoise

    weights = {"a": torch.randn(256, 256) * 0.02, "b": torch.ones(512), "step": torch.tensor([3])}
    noise = WeightNoise(0.1, seed=7)
    first = dict(noise(weights.items()))
    for name in ("a", "b"):
        rms = weights[name].pow(2).mean().sqrt()
        relative = (first[name] - weights[name]).std() / rms
        assert 0.09 < relative < 0.11, (name, relative)
    assert torch.equal(first["step"], weights["step"])  # integer tensors pass through
    second = dict(noise(weights.items()))  # the next load (sync) draws fresh noise
    assert not torch.equal(first["a"], second["a"])
    again = dict(WeightNoise(0.1, seed=7)(weights.items()))  # same seed, same first load: same noise
    assert torch.equal(first["a"], again["a"])
    assert dict(WeightNoise(0.0, seed=7)(weights.items()))["a"] is weights["a"]  # off: untouched
    with pytest.raises(ValueError, match="sampler.perturb: must be >= 0"):
        WeightNoise(-0.1, seed=0)


def _mismatch(sampler, trainer, prompts) -> float:
    from rlmm.mismatch.metrics import mismatch_metrics

    rollouts = sampler.generate(prompts, n=4)
    sampler_logprobs, mask = rollouts.padded_sampler_logprobs()
    return mismatch_metrics(trainer.logprobs(rollouts), sampler_logprobs, mask)["logprob_abs_diff_mean"]


def test_perturb_mismatch_grows_with_the_knob(small_model_path, prompts):
    """fp32 on both sides, so the only mismatch is the injected one: it grows with the noise, at
    construction and again after a weight sync."""
    fp32 = SidePrecision("fp32", False)
    options = sampling(max_new_tokens=6)
    trainer = build_trainer("torch", small_model_path, fp32, options, micro_batch_size=32)
    levels = [0.0, 0.01, 0.03, 0.1]
    measured = []
    for perturb in levels:
        sampler = from_yaml("sampler", "hf", model_path=small_model_path, precision=fp32, sampling=options, seed=0,
                            perturb=perturb)
        at_start = _mismatch(sampler, trainer, prompts)
        sampler.load_weights(trainer.state_dict())  # a weight sync: noise drawn again
        measured.append((at_start, _mismatch(sampler, trainer, prompts)))
        sampler.close()
    trainer.close()
    assert measured[0][0] < 1e-5 and measured[0][1] < 1e-5  # no noise: fp32 vs fp32 agree
    for when in (0, 1):
        series = [m[when] for m in measured]
        # 10x the noise gives about 10x the mismatch (9.2x after the sync with these draws): 5x leaves room for the draw
        assert series == sorted(series) and series[-1] > 5 * series[1], measured


def test_perturb_in_vllm_at_start_and_at_sync(small_model_path, prompts):
    """vLLM loaded the checkpoint itself: the knob reloads it perturbed, and every sync is perturbed."""
    fp32 = SidePrecision("fp32", False)
    options = sampling(max_new_tokens=6)
    trainer = build_trainer("torch", small_model_path, fp32, options, micro_batch_size=32)
    sampler = from_yaml("sampler", "vllm", model_path=small_model_path, precision=fp32, sampling=options, seed=0,
                        perturb=0.1)
    try:
        at_start = _mismatch(sampler, trainer, prompts)
        sampler.load_weights(trainer.state_dict())
        after_sync = _mismatch(sampler, trainer, prompts)
    finally:
        sampler.close()
        trainer.close()
    assert at_start > 1e-2 and after_sync > 1e-2, (at_start, after_sync)  # unperturbed fp32: ~1e-6 (docs/precision.md)
