"""`rlmm prefetch [train|probe] [overrides]`: cache what a run will read from the Hugging Face hub, so
that it can run where there is no internet (SLURM compute nodes; docs/sweeps.md).

It composes the config the run would (train's by default; the same overrides, every combination of a
`-m` sweep, an experiment's grid included) and, for each distinct model and task:
  - model=hf with a hub id: `snapshot_download` of the files the run loads (what
    `PretrainedModel.resolve` fetches) into the hub cache ($HF_HUB_CACHE, default $HF_HOME/hub); a
    local directory, or the built-in tiny model (which the run builds itself), needs nothing;
  - task=gsm8k with a hub id or a dataset folder: `datasets.load_dataset(path, "main")` of its train and
    test splits, which fills the datasets cache ($HF_DATASETS_CACHE, default $HF_HOME/datasets), by
    building the task as the run will; a local .jsonl needs nothing.
It prints one line per item (what, and where it is cached), then the command that runs from the
caches alone: with HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 huggingface_hub resolves a hub id to its
cached snapshot and datasets reads its cached splits, and what is not cached fails in one line at
once instead of waiting on a network that is not there.

It does not ask whether this machine's engines can run the config's precision (`rlmm train` does, on
the machine that runs it): the machine with internet is often a login node without GPUs.
"""
from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

APPS = ("train", "probe")  # the apps whose config is composed; train when none is named
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
# Where the caches are, when set: the offline run must see the same ones.
CACHE_VARS = ("HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE")
USAGE = ("usage: rlmm prefetch [train|probe] [hydra overrides]   e.g. rlmm prefetch model=hf "
         "model.path=Qwen/Qwen2.5-0.5B-Instruct task=gsm8k")


def main(argv: list[str]) -> None:
    from rlmm.runtime.errors import fail
    from rlmm.runtime.runtime_env import set_runtime_env

    args = list(argv)
    if args and args[0] in ("-h", "--help"):
        print(USAGE)
        return
    set_runtime_env()
    from rlmm.launch.apps import user_error  # after set_runtime_env: it imports torch

    app = args.pop(0) if args and args[0] in APPS else "train"
    models, tasks = {}, {}
    for cfg, choices in composed(app, [a for a in args if not a.startswith("-")]):
        models.setdefault(_key(cfg.model), (cfg.model, choices["model"]))
        tasks.setdefault(_key(cfg.task), (cfg.task, choices["task"]))
    try:
        for node, choice in models.values():
            print(fetch_model(node, choice), flush=True)
        for node, choice in tasks.values():
            print(fetch_task(node, choice), flush=True)
    except Exception as err:  # bad input (a path, a hub id, a record) in one line, as the run says it
        message = user_error(err)
        if message is None:
            raise
        fail(message)
    print("run offline:", offline_command(app, argv))


def composed(app: str, overrides: list[str]) -> list[tuple]:
    """(config, group choices) for every combination of the overrides, as the app composes them,
    each validated against its schemas; a bad value fails in one line."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from rlmm.config.options import ConfigError
    from rlmm.launch.overrides import composed_and_validated, fail_on_unknown_options, with_config_sweep_params
    from rlmm.runtime.errors import fail

    ours = [o for o in overrides if not o.lstrip("+~").startswith("hydra")]  # Hydra's own: launcher, dirs
    try:
        parsed = OverridesParser.create().parse_overrides(ours)
        fail_on_unknown_options(parsed, app)
        combinations = [batch for batches in BasicSweeper.split_arguments(parsed, None) for batch in batches]
        configs = [composed_and_validated(app, combination)
                   for combination in with_config_sweep_params(app, combinations)]
    except ConfigError as err:
        fail(str(err))
    except (HydraException, OmegaConfBaseException) as err:
        fail(_headline(err))
    finally:
        GlobalHydra.instance().clear()
    return configs


def fetch_model(node, choice: str) -> str:
    """Cache the model's checkpoint if it comes from the hub; say where it is."""
    from hydra.utils import instantiate

    from rlmm.models.pretrained import PretrainedModel

    model = instantiate(node)
    if not isinstance(model, PretrainedModel):
        return f"model={choice}: shipped with rlmm or built by the run itself, nothing to fetch"
    if Path(model.path).exists():
        return f"model={choice} {model.path}: a local directory, nothing to fetch"
    return f"model={choice} {model.path}: cached in {model.resolve()}"  # what the run's resolve() will find


def fetch_task(node, choice: str) -> str:
    """Build the task as the run will, which caches a dataset it loads through `datasets`; say where."""
    from hydra.utils import instantiate

    from rlmm.tasks.gsm8k import HUB_CONFIG, Gsm8kTask

    task = instantiate(node)
    if not isinstance(task, Gsm8kTask):
        return f"task={choice}: built by the run itself, nothing to fetch"
    if os.path.isfile(os.path.expanduser(task.path)):
        return f"task={choice} {task.path}: a local file, nothing to fetch"
    import datasets

    # Read back from the cache the task has just filled, for its location.
    files = datasets.load_dataset(task.path, HUB_CONFIG)["train"].cache_files
    return f"task={choice} {task.path} ({HUB_CONFIG}: train, test): cached in {Path(files[0]['filename']).parent}"


def offline_command(app: str, argv: list[str]) -> str:
    """The run's command, with the environment that keeps both libraries on their caches."""
    env = {**{k: os.environ[k] for k in CACHE_VARS if os.environ.get(k)}, **OFFLINE}
    args = argv[1:] if argv and argv[0] == app else argv
    # Quote the values only: a quoted `'NAME=value'` is a command name to the shell, not an assignment.
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(["rlmm", app, *args])])


def _key(node) -> str:
    """A node as written, before interpolation: `seed: ${seed}` is one item for every seed of a sweep."""
    from omegaconf import OmegaConf

    return json.dumps(OmegaConf.to_container(node, resolve=False), sort_keys=True)


def _headline(err: BaseException) -> str:
    """Hydra's composition errors span several lines; keep the first and the cause's first."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    cause = str(err.__cause__).splitlines()[0].strip() if err.__cause__ is not None and str(err.__cause__) else ""
    return " ".join(filter(None, [lines[0] if lines else type(err).__name__, cause]))
