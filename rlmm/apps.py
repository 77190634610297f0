"""Hydra entry points behind the `rlmm` subcommands."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from omegaconf import DictConfig

import rlmm.schema  # noqa: F401  (registers the schemas with Hydra)
from rlmm.logging import NoOpLogger
from rlmm.config import BUILD_TIME_ARGS, CONF_DIR, ConfigError, build, to_container, validate

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
    if not raised_in.startswith(str(Path(__file__).resolve().parent)):
        return None
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def start_run(cfg: DictConfig):
    """What every app needs first: the axis choices, a validated config, the run directory, and the
    logger (rank 0 only; the jobs of one sweep share a W&B group)."""
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    choices = {k: v for k, v in hydra_cfg.runtime.choices.items() if k in BUILD_TIME_ARGS}
    validate(cfg, choices)
    run_dir = Path(hydra_cfg.runtime.output_dir)
    if int(os.environ.get("RANK", "0")) != 0:
        return choices, run_dir, NoOpLogger()
    sweep = Path(hydra_cfg.sweep.dir).as_posix().replace("/", "_") if hydra_cfg.mode == RunMode.MULTIRUN else None
    logger = build(cfg.logger, run_config={"choices": choices, **to_container(cfg)}, run_dir=str(run_dir), sweep=sweep)
    return choices, run_dir, logger


def _probe(cfg: DictConfig) -> None:
    from rlmm.probe import run_probe

    choices, run_dir, logger = start_run(cfg)
    record = run_probe(cfg, run_dir, choices)
    logger.summary({f"mismatch/{k}": v for k, v in record["sampler_vs_trainer"].items()})
    logger.finish()
    log.info("wrote %s", run_dir / "probe.json")


def _train(cfg: DictConfig) -> None:
    from rlmm.train import run_train

    choices, run_dir, logger = start_run(cfg)
    run_train(cfg, run_dir, choices, logger)
    logger.finish()
    log.info("run record in %s", run_dir)


TASKS = {"probe": _probe, "train": _train}


def run_app(command: str, config_name: str) -> None:
    task = TASKS[command]

    def guarded(cfg: DictConfig) -> None:
        try:
            task(cfg)
        except Exception as err:
            message = user_error(err)
            if message is None:
                raise
            print(f"rlmm: error: {message}", flush=True)
            raise SystemExit(2) from None

    hydra.main(config_path=str(CONF_DIR), config_name=config_name, version_base="1.3")(guarded)()
