"""Which launcher a `-m` sweep runs with, and the warning when its jobs would share one process on a GPU
machine. (The `process` launcher itself is hydra_plugins/rlmm_launcher/process_launcher.py: Hydra
instantiates launchers only from the `hydra_plugins` package.)

Hydra's basic launcher, the default, runs every job of a sweep in the `rlmm` process. On a machine with
CUDA that leaks from job to job: vLLM keeps the GPU memory of an in-process engine after it is deleted
(vllm-project/vllm#21073), so each job's engine starts beside the last one's weights and KV cache, and
vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT) patches aten kernels for the whole process, so every
job after one that turned it on runs with it. Every `rlmm train` and `rlmm probe` job starts engines.
Without CUDA neither leak applies (vLLM's CPU KV cache is ordinary memory), so no warning there.
"""
from __future__ import annotations

BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
ENGINE_APPS = ("train", "probe")  # config names of the apps whose jobs start a sampler and a trainer


def sweep_launcher_warning(launcher_target: str | None, cuda: bool, config_name: str) -> str | None:
    """The one-line warning for a `-m` sweep of `config_name` whose launcher (`launcher_target`, the
    composed `hydra.launcher._target_`; None: unknown) runs its jobs in this process on a machine with
    CUDA; else None."""
    if launcher_target != BASIC_LAUNCHER or not cuda or config_name not in ENGINE_APPS:
        return None
    return ("rlmm: warning: the jobs of this sweep share one process (hydra/launcher=basic): GPU memory of each "
            "vLLM engine is not freed between jobs; use hydra/launcher=process")


def launcher_target(config_name: str, overrides: list[str]) -> str | None:
    """The `_target_` of the launcher that `rlmm <app> -m OVERRIDES` runs with (an experiment file may
    choose one too), composed from the first combination of the sweep; None when the overrides do not
    compose, which Hydra reports itself."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    import rlmm.config.schema  # noqa: F401  (registers the schemas)
    from rlmm.config.options import CONF_DIR

    GlobalHydra.instance().clear()
    try:
        first = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(overrides), None)[0][0]
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name, overrides=first, return_hydra_config=True)
        return str(cfg.hydra.launcher.get("_target_", ""))
    except (HydraException, OmegaConfBaseException):
        return None
    finally:
        GlobalHydra.instance().clear()
