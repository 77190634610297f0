"""The `rlmm` command: `rlmm train [overrides]` and `rlmm probe [overrides]`.

Every subcommand is a Hydra app, so each axis is an override (`sampler=hf precision=fp16`) and
`-m` sweeps any of them. Before Hydra starts, every override (and every combination of a sweep) is
composed and validated, so a typo fails in one line before any model is loaded or job submitted.
"""
from __future__ import annotations

import os
import sys

APPS = {"train": "train", "probe": "probe"}  # subcommand -> config name under conf/


# glibc's malloc serves blocks below its mmap threshold from its heap and keeps them resident after
# they are freed; the threshold rises (up to 32 MiB) each time a larger block is freed, so a training
# step's many-MiB activations and gradients end up there. Blocks of 1 MiB and more are mmapped instead,
# and go back to the OS when freed: at 0.5B parameters the fp32 train run peaked at 16.9 GiB without this
# and 14.6 GiB with it, in the same time (docs/precision.md#measured-at-real-scale-on-a-cpu).
MMAP_THRESHOLD_BYTES = 1 << 20


def return_freed_blocks_to_the_os() -> None:
    """Fix glibc's mmap threshold (MALLOC_MMAP_THRESHOLD_ if set, else 1 MiB) in this process and in the
    processes it starts (torchrun ranks, SLURM jobs); nothing on a libc other than glibc."""
    import ctypes

    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD_BYTES))
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_mmap_threshold = -3  # <malloc.h> M_MMAP_THRESHOLD
    mallopt(m_mmap_threshold, int(os.environ["MALLOC_MMAP_THRESHOLD_"]))


def set_runtime_env() -> None:
    """Environment that must be in place before torch or vLLM are imported."""
    return_freed_blocks_to_the_os()
    # In-process vLLM otherwise pins torch to one thread, halving the trainer's speed on CPU.
    os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if os.path.exists("/dev/nvidiactl") else "cpu")


def fail(message: str) -> None:
    print(f"rlmm: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def check_overrides(config_name: str, overrides: list[str]) -> None:
    """Compose and validate the config for every combination of the (sweep) overrides."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException, InstantiationException
    from hydra.utils import instantiate
    from omegaconf import open_dict
    from omegaconf.errors import OmegaConfBaseException

    import rlmm.schema  # noqa: F401  (registers the schemas)
    from rlmm.config import ConfigError, group_options, validate

    ours = [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
    try:
        parsed = OverridesParser.create().parse_overrides(ours)
        # Hydra's own groups too (hydra/launcher=...), unless a searchpath adds options only Hydra sees.
        searchpath = any(o.startswith("hydra.searchpath") for o in overrides)
        hydra_groups = [] if searchpath else \
            OverridesParser.create().parse_overrides([o for o in overrides if o.startswith("hydra/")])
    except HydraException as err:
        fail(str(err).splitlines()[0])
    for override in parsed + hydra_groups:  # unknown option of a group: name it and list the choices
        group = override.key_or_group
        options = _hydra_group_options(group) if group.startswith("hydra/") else group_options(group)
        if options and not override.is_delete():
            values = list(override.sweep_string_iterator()) if override.is_sweep_override() else [override.value()]
            for value in values:
                if str(value) not in options:
                    fail(f"unknown {group} '{value}' (allowed: {', '.join(options)})")
    from rlmm.launcher import launcher_target

    elsewhere = runs_on_another_machine(launcher_target(config_name, overrides) or "")
    combinations = [batch for batches in BasicSweeper.split_arguments(parsed, None) for batch in batches]
    combinations = with_config_sweep_params(config_name, combinations)
    from rlmm.config import CONF_DIR

    for combination in combinations:
        GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                cfg = compose(config_name, overrides=combination, return_hydra_config=True)
                choices = dict(cfg.hydra.runtime.choices)
                with open_dict(cfg):
                    del cfg["hydra"]
                validate(cfg, choices)
                # These constructors only check their arguments (paths, dtype names, ranges), so bad
                # values surface here, before a sweep is submitted or an engine starts.
                for group in ("model", "precision", "correction", "algo"):
                    if group in cfg:
                        instantiate(cfg[group])
                if not elsewhere:  # a SLURM job asks its own node's hardware when it starts
                    check_engines_support(cfg)
                if "probe" in cfg:
                    from rlmm.probe import check_micro_batch_sizes

                    check_micro_batch_sizes(cfg.probe.trainer_micro_batch_sizes)
        except (ConfigError, ValueError) as err:
            fail(str(err).splitlines()[0])
        except InstantiationException as err:
            fail(str(err.__cause__ or err).splitlines()[0])
        except (HydraException, OmegaConfBaseException) as err:
            fail(_one_line(err) + _allowed_keys_hint(config_name, combination, err))
        finally:
            GlobalHydra.instance().clear()


def with_config_sweep_params(config_name: str, combinations: list[list[str]]) -> list[list[str]]:
    """Cross each combination with the grid its composed config sets in `hydra.sweeper.params` (an
    experiment file's sweep, `+experiment=NAME`), as Hydra's basic sweeper will under `-m`: the
    file's values first, the command line's replacing the file's for the same key. A combination
    that does not compose is kept as it is, for the caller's checks to report."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    import rlmm.schema  # noqa: F401  (registers the schemas)
    from rlmm.config import CONF_DIR

    expanded = []
    for combination in combinations:
        GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                params = compose(config_name, overrides=combination, return_hydra_config=True).hydra.sweeper.params
            if not params:
                expanded.append(combination)
                continue
            grid = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()] + combination)
            expanded += [batch for batches in BasicSweeper.split_arguments(grid, None) for batch in batches]
        except (HydraException, OmegaConfBaseException):
            expanded.append(combination)
        finally:
            GlobalHydra.instance().clear()
    return expanded


def _hydra_group_options(group: str) -> list[str]:
    """Options of one of Hydra's own groups (hydra/launcher: conf/hydra/launcher/ and plugins' configs)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from rlmm.config import CONF_DIR

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


def check_engines_support(cfg) -> None:
    """Ask each engine class whether it can run its side's precision here (classes that can tell
    define a static `unsupported(side_precision) -> str | None`)."""
    from hydra.utils import get_class, instantiate

    policy = instantiate(cfg.precision)
    for group, side in (("sampler", policy.sampler), ("trainer", policy.trainer)):
        unsupported = getattr(get_class(cfg[group]._target_), "unsupported", None)
        problem = unsupported(side) if unsupported else None
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


def _allowed_keys_hint(config_name: str, combination: list[str], err: BaseException) -> str:
    """For `group.key=value` with an unknown key, list the keys the chosen option has."""
    import re

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from rlmm.config import BUILD_TIME_ARGS, CONF_DIR

    match = re.search(r"Could not override '(\w+)\.([\w.]+)'", str(err))
    if not match or match.group(1) not in BUILD_TIME_ARGS:
        return ""
    group = match.group(1)
    choices_only = [o for o in combination if "." not in o.split("=")[0]]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        node = compose(config_name, overrides=choices_only)[group]
    GlobalHydra.instance().clear()
    return f" (allowed: {', '.join(k for k in node if k != '_target_')})"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "table":  # not a Hydra app: tables from a sweep's run records
        from rlmm.table import main as table_main

        return table_main(argv[1:])
    if argv and argv[0] == "prefetch":  # not a Hydra app: caches a run's model and dataset for offline nodes
        from rlmm.prefetch import main as prefetch_main

        return prefetch_main(argv[1:])
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in APPS:
        if argv and argv[0] not in ("-h", "--help"):
            fail(f"unknown command '{argv[0]}' (allowed: {', '.join([*APPS, 'table', 'prefetch'])})")
        print("usage: rlmm {" + ",".join(APPS) + "} [hydra overrides]   e.g. rlmm probe precision=fp16 sampler=hf\n"
              "       rlmm table SWEEP_DIR [--metric NAME[:final|best|mean]]...   (rlmm table -h for more)\n"
              "       rlmm prefetch [train|probe] [hydra overrides]   (caches a run's hub model and dataset)")
        return
    command, args = argv[0], argv[1:]
    set_runtime_env()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not any(a.startswith("hydra.run.dir=") for a in args):
        # Ranks start at slightly different times: give them one run directory, not one per second.
        import time

        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        run_id = run_id if run_id != "none" else os.environ.get("MASTER_PORT", "0")
        args.append(f"hydra.run.dir=outputs/{command}/{time.strftime('%Y-%m-%d')}/ranks-{run_id}")
    check_overrides(APPS[command], [a for a in args if not a.startswith("-")])
    if "-m" in args or "--multirun" in args:
        from rlmm.launcher import launcher_target, sweep_launcher_warning

        overrides = [a for a in args if not a.startswith("-")]
        warning = sweep_launcher_warning(launcher_target(APPS[command], overrides),
                                         cuda=os.path.exists("/dev/nvidiactl"), config_name=APPS[command])
        if warning:
            print(warning, file=sys.stderr)
    sys.argv = [f"rlmm {command}"] + args
    from rlmm.apps import run_app

    run_app(command, APPS[command])


if __name__ == "__main__":
    main()
