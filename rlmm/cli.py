"""The `rlmm` command: `rlmm train [overrides]` and `rlmm probe [overrides]`.

Every subcommand is a Hydra app, so each axis is an override (`sampler=hf precision=fp16`) and
`-m` sweeps any of them. Before Hydra starts, every override (and every combination of a sweep) is
composed and validated, so a typo fails in one line before any model is loaded or job submitted.
"""
from __future__ import annotations

import os
import sys

from rlmm.runtime.errors import MACHINE_FAULT_EXIT, fail
from rlmm.runtime.runtime_env import set_runtime_env

APPS = {"train": "train", "probe": "probe"}  # subcommand -> config name under conf/
# Hydra's command-line flags that take a value (`--cfg job`, `-p PACKAGE`...): the value is not an override.
HYDRA_FLAGS_WITH_A_VALUE = {"--cfg", "-c", "--package", "-p", "--info", "-i", "--config-path", "-cp",
                            "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun"}


def overrides_of(args: list[str]) -> list[str]:
    """The overrides among an app's arguments: not a flag, nor the value of one (`--cfg job`)."""
    overrides, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg.startswith("-"):
            skip = arg in HYDRA_FLAGS_WITH_A_VALUE
        else:
            overrides.append(arg)
    return overrides


# Characters that make an override's value more than one plain string in Hydra's grammar (quotes, an escape, a
# list, a dict, a sweep function, an interpolation): such a value is left as it was written.
GRAMMAR = set("'\"\\[]{}()$")


def quoted_outside_ascii(args: list[str]) -> list[str]:
    """The app's arguments with every override value that holds a character outside ASCII quoted for Hydra, whose
    grammar takes such characters only in quotes (`hydra.run.dir=/tmp/rün` ended in Hydra's
    LexerNoViableAltException); a comma-separated sweep (`task.path=/a/ü.jsonl,/b/ö.jsonl`) is quoted element by
    element. A value holding one of GRAMMAR is left as written: Hydra reads it, or refuses it (check_overrides)."""
    quoted, skip = [], False
    for arg in args:
        if skip or arg.startswith("-"):
            skip = not skip and arg in HYDRA_FLAGS_WITH_A_VALUE
            quoted.append(arg)
            continue
        key, equals, value = arg.partition("=")
        if equals and not value.isascii() and not GRAMMAR & set(value):
            value = ",".join(f"'{part.strip()}'" for part in value.split(","))
        quoted.append(f"{key}{equals}{value}")
    return quoted


def named_run_dir(args: list[str]) -> tuple[str, str | None, object]:
    """The key that places this command's run (hydra.sweep.dir under -m, else hydra.run.dir), its value as written
    on the command line (None when not set), and that value as Hydra reads it (quotes removed; a sweep is a Sweep)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    key = "hydra.sweep.dir" if "-m" in args or "--multirun" in args else "hydra.run.dir"
    named = [arg for arg in overrides_of(args) if arg.startswith(f"{key}=")]
    if not named:
        return key, None, None
    try:
        return key, named[-1].removeprefix(f"{key}="), OverridesParser.create().parse_override(named[-1]).value()
    except HydraException as err:
        fail(str(err).splitlines()[0])


def bad_run_dir(command: str, args: list[str]) -> str | None:
    """Why the run directory the command line names is no directory: empty (`hydra.run.dir=`, an unset variable in a
    script), which Hydra takes for the working directory, null, or several (a sweep of them); None otherwise."""
    key, written, value = named_run_dir(args)
    root = "multirun" if key == "hydra.sweep.dir" else "outputs"
    instead = f"give a directory, or leave {key} out for {root}/{APPS[command]}/<date>/<time>"
    if written is None or isinstance(value, (int, float)) or (isinstance(value, str) and value.strip()):
        return None
    if isinstance(value, str):
        return f"{key}: empty, which would put the run's files in the working directory ({instead})"
    if value is None:
        return f"{key}: null is not a directory ({instead})"
    return (f"{key}: {written} is not one directory ({instead}; a sweep's jobs each get one below hydra.sweep.dir, "
            "with -m)")


def unwritable_run_dir(args: list[str]) -> str | None:
    """Why the run directory (an explicit hydra.run.dir / hydra.sweep.dir, else outputs/ or multirun/ here, the
    roots of Hydra's default ones) cannot be made, or None once it is there. Hydra makes it before rlmm's code
    runs, and its failure there would be Hydra's traceback; writing into one that exists is rlmm's, and its
    faults are rlmm's one line (rlmm/launch/apps.py::machine_fault)."""
    from pathlib import Path

    sweep = "-m" in args or "--multirun" in args
    _, written, value = named_run_dir(args)  # one that is no directory was refused (bad_run_dir)
    if written is not None and "${" in str(value):  # an interpolation (${now:...}): Hydra's to resolve
        return None
    directory = Path(str(value) if written is not None else ("multirun" if sweep else "outputs"))
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return (f"cannot make the run directory {directory}: {err.strerror}; choose another "
                f"hydra.{'sweep' if sweep else 'run'}.dir")
    return None


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "table":  # not a Hydra app: tables from a sweep's run records
        from rlmm.table import main as table_main

        return table_main(argv[1:])
    if argv and argv[0] == "prefetch":  # not a Hydra app: caches a run's model and dataset for offline nodes
        from rlmm.launch.prefetch import main as prefetch_main

        return prefetch_main(argv[1:])
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in APPS:
        if argv and argv[0] not in ("-h", "--help"):
            fail(f"unknown command '{argv[0]}' (allowed: {', '.join([*APPS, 'table', 'prefetch'])})")
        print("usage: rlmm {" + ",".join(APPS) + "} [hydra overrides]   e.g. rlmm probe precision=fp16 sampler=hf\n"
              "       rlmm table SWEEP_DIR [--metric NAME[:final|best|mean]]...   (rlmm table -h for more)\n"
              "       rlmm prefetch [train|probe] [hydra overrides]   (caches a run's hub model and dataset)")
        return
    command, args = argv[0], quoted_outside_ascii(argv[1:])
    set_runtime_env()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not any(a.startswith("hydra.run.dir=") for a in args):
        # Ranks start at slightly different times: give them one run directory, not one per second.
        import time

        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        run_id = run_id if run_id != "none" else os.environ.get("MASTER_PORT", "0")
        args.append(f"hydra.run.dir=outputs/{command}/{time.strftime('%Y-%m-%d')}/ranks-{run_id}")
    from rlmm.launch.overrides import check_overrides

    check_overrides(APPS[command], overrides_of(args))
    no_directory = bad_run_dir(command, args)
    if no_directory:
        fail(no_directory)
    unwritable = unwritable_run_dir(args)  # after the overrides: a typo makes no directory
    if unwritable:
        print(f"rlmm: machine fault: {unwritable}", file=sys.stderr)
        raise SystemExit(MACHINE_FAULT_EXIT)
    if "-m" in args or "--multirun" in args:
        from rlmm.launch.launcher import launcher_target, sweep_launcher_warning

        overrides = overrides_of(args)
        warning = sweep_launcher_warning(launcher_target(APPS[command], overrides),
                                         cuda=os.path.exists("/dev/nvidiactl"), config_name=APPS[command])
        if warning:
            print(warning, file=sys.stderr)
    sys.argv = [f"rlmm {command}"] + args
    from rlmm.launch.apps import run_app

    run_app(command, APPS[command])


if __name__ == "__main__":
    main()
