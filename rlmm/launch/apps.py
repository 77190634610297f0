"""Hydra entry points behind the `rlmm` subcommands."""
from __future__ import annotations

import logging
import os
import signal
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from omegaconf import DictConfig

import rlmm.config.schema  # noqa: F401  (registers the schemas with Hydra)
from rlmm.config.options import BUILD_TIME_ARGS, CONF_DIR, build, to_container, validate
from rlmm.run.logging import NoOpLogger, redact
from rlmm.run.resume import FINISHED_JOB, AlreadyFinished, ResumeRefused, check_probe_dir, check_train_dir, resume_point
from rlmm.runtime.disk import disk_fault
from rlmm.runtime.errors import MACHINE_FAULT_EXIT, ConfigError, JobFailed, MachineFault, RunStopped

log = logging.getLogger("rlmm")


def user_error(err: BaseException) -> str | None:
    """The one-line message of an error caused by the user's input, or None for a bug.

    rlmm's components raise ValueError (or ConfigError) with a one-line message for bad input; the
    same type raised inside a library is a bug or an environment problem and keeps its traceback.
    """
    while isinstance(err, InstantiationException) and err.__cause__ is not None:
        err = err.__cause__
    if not isinstance(err, (ConfigError, ValueError, FileNotFoundError)):
        return None
    frame = err.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    raised_in = frame.tb_frame.f_code.co_filename if frame is not None else ""
    if not raised_in.startswith(str(Path(__file__).resolve().parents[1])):  # anywhere in rlmm/
        return None
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def machine_fault(err: BaseException) -> str | None:
    """What failed, in a few words, when `err` (or an error it was raised from or while handling) is a fault of
    the machine: rlmm's `MachineFault` (a dead sampler process), an OSError of the disk (rlmm/runtime/disk.py's
    `DISK_FAULTS`; rlmm's writes name their file), or a collective's peer gone (torch's distributed errors, gloo's
    "Connection reset by peer"): a rank died, named with its node where the error gives its address
    (rlmm/runtime/roster.py); None otherwise."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = str(err).splitlines()[0] if str(err) else type(err).__name__
        if isinstance(err, MachineFault):
            return text
        if (fault := disk_fault(err)) is not None:
            return fault
        # torch.distributed's own errors (torch not imported here), and gloo's, a RuntimeError naming its source:
        # "[.../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:2478: Connection reset by peer"
        if (any(kind.__name__ == "DistError" for kind in type(err).__mro__)
                or ("/gloo/" in text and "peer" in text)):
            said = text.split("] ", 1)[-1].split(". ", 1)[0]  # without gloo's source line and its advice
            from rlmm.runtime.roster import who_is_at  # the peer's address in gloo's text -> its rank and node

            who = who_is_at(said, int(os.environ.get("RANK", "0")))
            return f"{who or 'a rank of the run'} failed or is gone ({type(err).__name__}: {said})"
        err = err.__cause__ or err.__context__
    return None


def what_the_record_holds(run_dir: Path, app: str) -> str:
    """The run's record after a fault, and how to go on: for `rlmm train`, the steps logged and the newest
    checkpoint, from which the same command resumes."""
    if app != "train":
        return "run the same command again once it is fixed"
    from rlmm.run.records import finished, read_steps

    if finished(run_dir):
        return f"the run finished: its record in {run_dir} is complete (summary.json); what came after it is missing"
    rows = read_steps(run_dir)
    if not rows:
        return f"no step was recorded in {run_dir}; run the same command again once it is fixed"
    try:
        point = resume_point(run_dir)
        resumes = f"resumes from its checkpoint of step {point.state['step']}" if point.checkpoint else "starts over"
    except ResumeRefused as refused:
        resumes = f"refuses to resume it ({refused})"
    first, last = rows[0]["step"], rows[-1]["step"]
    held = f"steps {first}-{last}" if last != first else f"step {first}"
    return f"{run_dir}/steps.jsonl holds {held}; once it is fixed the same command {resumes}"


def start_run(cfg: DictConfig, app: str, held: ExitStack) -> tuple[dict[str, str], Path]:
    """What every app does first: the axis choices, a validated config, the run directory locked for the run's
    life (rlmm/run/run_lock.py, on rank 0, held by `held`: another process there is refused) and checked
    (rlmm/run/resume.py: a record there that this run may not continue is refused before anything in it is touched),
    then, on rank 0, Hydra's `.hydra/` files of this run written into it (`hydra.output_subdir: null` keeps
    Hydra from writing them before the check)."""
    from rlmm.run.run_lock import holding
    from rlmm.runtime.devices import world_size

    hydra_cfg = HydraConfig.get()
    choices = {k: v for k, v in hydra_cfg.runtime.choices.items() if k in BUILD_TIME_ARGS}
    validate(cfg, choices)
    run_dir = Path(hydra_cfg.runtime.output_dir)
    if int(os.environ.get("RANK", "0")) == 0:
        held.enter_context(holding(run_dir))
    record_config = redact({"choices": choices, **to_container(cfg)})  # as RunRecord writes config.yaml
    if app == "train":
        check_train_dir(run_dir, record_config, world_size(), cfg.train.resume)
    else:
        check_probe_dir(run_dir, record_config)
    if int(os.environ.get("RANK", "0")) == 0:
        save_hydra_files(run_dir / ".hydra", cfg, hydra_cfg)
    return choices, run_dir


def save_hydra_files(directory: Path, cfg: DictConfig, hydra_cfg: DictConfig) -> None:
    """The three files Hydra's run_job writes (hydra/core/utils.py): the task's config, Hydra's, the overrides."""
    from omegaconf import OmegaConf

    directory.mkdir(parents=True, exist_ok=True)
    for name, content in (("config.yaml", cfg), ("hydra.yaml", OmegaConf.create({"hydra": hydra_cfg})),
                          ("overrides.yaml", hydra_cfg.overrides.task)):
        (directory / name).write_text(OmegaConf.to_yaml(content), encoding="utf-8")


def open_logger(cfg: DictConfig, choices: dict[str, str], run_dir: Path):
    """The run's logger: rank 0 only; the jobs of one sweep share a W&B group."""
    from hydra.types import RunMode

    if int(os.environ.get("RANK", "0")) != 0:
        return NoOpLogger()
    hydra_cfg = HydraConfig.get()
    sweep = Path(hydra_cfg.sweep.dir).as_posix().replace("/", "_") if hydra_cfg.mode == RunMode.MULTIRUN else None
    return build(cfg.logger, run_config={"choices": choices, **to_container(cfg)}, run_dir=str(run_dir), sweep=sweep)


def _probe(cfg: DictConfig, choices: dict[str, str], run_dir: Path) -> None:
    from rlmm.probe import run_probe

    logger = open_logger(cfg, choices, run_dir)
    record = run_probe(cfg, run_dir, choices)
    logger.summary({f"mismatch/{k}": v for k, v in record["sampler_vs_trainer"].items()})
    logger.finish()
    log.info("wrote %s", run_dir / "probe.json")


def _train(cfg: DictConfig, choices: dict[str, str], run_dir: Path) -> None:
    from rlmm.run.train import run_train

    run_train(cfg, run_dir, choices, open_logger(cfg, choices, run_dir))  # finishes the logger, however it ends
    log.info("run record in %s", run_dir)


TASKS = {"probe": _probe, "train": _train}
# Set by torchrun or the deepspeed launcher for one world of ranks; see fit_env_to_submitted_job.
PROCESS_GROUP_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
# Values rlmm.cli.set_runtime_env derives from the machine it runs on.
MACHINE_VARS = ("OMP_NUM_THREADS", "DS_ACCELERATOR")


def submitted_job() -> bool:
    """This process is a job that a launcher started in a process of its own: Hydra's submitit launcher
    (hydra/launcher=local|slurm|<site>) or rlmm's, which runs the plugin's job code in a fresh process
    (hydra/launcher=process, hydra_plugins/rlmm_launcher)."""
    return str(HydraConfig.get().launcher.get("_target_", "")).startswith(
        ("hydra_plugins.hydra_submitit_launcher.", "hydra_plugins.rlmm_launcher."))


def fit_env_to_submitted_job() -> str:
    """In a submitted job, replace what it inherited from the submitting shell but must not keep
    (docs/sweeps.md).

    Such a job runs with that shell's environment (sbatch --export=ALL; local jobs are its children),
    rlmm's runtime environment included, which is right for everything but: process-group variables
    (jobs on one node sharing a MASTER_PORT collide; WORLD_SIZE > 1 waits for ranks that never come),
    dropped so the job starts its own world: of one, or in a SLURM job of several tasks, one rank per
    task; and, in a SLURM job, the values derived from the
    submitting machine (a login node without GPUs, all of its CPUs), derived again on the job's node
    with SLURM's CPUs per task as the thread count.
    """
    from rlmm.runtime.runtime_env import set_runtime_env

    for name in PROCESS_GROUP_VARS:
        os.environ.pop(name, None)
    if os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        for name in MACHINE_VARS:
            os.environ.pop(name, None)
        if os.environ.get("SLURM_CPUS_PER_TASK"):
            os.environ["OMP_NUM_THREADS"] = os.environ["SLURM_CPUS_PER_TASK"]
        set_runtime_env()
        import torch  # already imported (unpickling the job imported rlmm), so resize its thread pool

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
            # One rank per SLURM task (hydra.launcher.tasks_per_node x nodes). submitit derives the
            # world from SLURM: MASTER_ADDR the first node, MASTER_PORT from the job id, RANK, WORLD_SIZE,
            # LOCAL_RANK. Every task keeps all the node's GPUs; a rank picks its own by LOCAL_RANK.
            from submitit.helpers import TorchDistributedEnvironment

            TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    # returned, to be logged once the run directory is checked: the job's log file is in it
    return (f"submitted job: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} DS_ACCELERATOR="
            f"{os.environ.get('DS_ACCELERATOR')} rank {os.environ.get('RANK', '0')} of {os.environ.get('WORLD_SIZE', '1')}")


def end(line: str, code: int, submitted: bool, touch_run_dir: bool = True) -> NoReturn:
    """Print why the run ended on stderr, where every fault's one line goes (rlmm/runtime/errors.py::fail, rlmm/cli.py),
    and exit with `code`; in a submitted job, log it (the job's log then says why) and raise JobFailed instead:
    Hydra keeps a job's exception in the result the sweep command waits for, while an exit leaves none, and
    without sacct (the local cluster) the sweep would wait forever.
    `touch_run_dir=False` (a refused resume: the record is left as it was): no line in the job's log file,
    which is in the run directory; submitit's own log (stderr) and the sweep's error carry it."""
    if not submitted:
        print(line, file=sys.stderr, flush=True)
        raise SystemExit(code)
    if touch_run_dir:
        log.error(line)
    else:
        print(line, file=sys.stderr, flush=True)
    raise JobFailed(line) from None


def run_app(command: str, config_name: str) -> None:
    task = TASKS[command]

    def guarded(cfg: DictConfig) -> str | None:
        submitted = submitted_job()
        environment = fit_env_to_submitted_job() if submitted else None
        try:
            with ExitStack() as held:  # the run directory's lock, until the task returns or raises
                choices, run_dir = start_run(cfg, command, held)
                if environment:
                    log.info(environment)
                task(cfg, choices, run_dir)
        except AlreadyFinished as finished:  # nothing to do, nothing touched; in a sweep, the next job's turn
            print(finished, flush=True)
            return FINISHED_JOB
        except KeyboardInterrupt:  # Ctrl-C before the training loop, or twice in it (rlmm/run/preemption.py)
            run_dir = Path(HydraConfig.get().runtime.output_dir)
            end(f"rlmm: interrupted (SIGINT): {what_the_record_holds(run_dir, command)}", 128 + signal.SIGINT,
                submitted, touch_run_dir=False)
        except Exception as err:
            if isinstance(err, RunStopped):  # the run stopped itself: not a bug
                end(f"rlmm: stopped: {err}", 3, submitted)
            fault = machine_fault(err)
            if fault is not None:  # the disk may be the fault: the line goes to the console, not the run's log
                run_dir = Path(HydraConfig.get().runtime.output_dir)
                end(f"rlmm: machine fault: {fault}; {what_the_record_holds(run_dir, command)}", MACHINE_FAULT_EXIT,
                    submitted, touch_run_dir=False)
            message = user_error(err)
            if message is None and not submitted:
                raise
            if message is None:  # a bug: its traceback in the job's log, its name in the sweep's error
                log.exception("job failed")
                message = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            end(f"rlmm: error: {message}", 2, submitted, touch_run_dir=not isinstance(err, ResumeRefused))

    hydra.main(config_path=str(CONF_DIR), config_name=config_name, version_base="1.3")(guarded)()
