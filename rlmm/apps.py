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


def build_logger(cfg: DictConfig, choices: dict[str, str], run_dir: Path):
    """The run's logger on rank 0 (a no-op elsewhere); the jobs of one sweep share a W&B group."""
    from hydra.types import RunMode

    if int(os.environ.get("RANK", "0")) != 0:
        return NoOpLogger()
    hydra_cfg = HydraConfig.get()
    sweep = Path(hydra_cfg.sweep.dir).as_posix().replace("/", "_") if hydra_cfg.mode == RunMode.MULTIRUN else None
    return build(cfg.logger, run_config={"choices": choices, **to_container(cfg)}, run_dir=str(run_dir), sweep=sweep)


def _probe(cfg: DictConfig) -> None:
    from rlmm.probe import run_probe

    runtime = HydraConfig.get().runtime
    choices = {k: v for k, v in runtime.choices.items() if k in BUILD_TIME_ARGS}
    validate(cfg, choices)
    run_dir = Path(runtime.output_dir)
    logger = build_logger(cfg, choices, run_dir)
    record = run_probe(cfg, run_dir, choices)
    logger.summary({f"mismatch/{k}": v for k, v in record["sampler_vs_trainer"].items()})
    logger.finish()
    log.info("wrote %s", run_dir / "probe.json")


def _train(cfg: DictConfig) -> None:
    from rlmm.train import run_train

    runtime = HydraConfig.get().runtime
    choices = {k: v for k, v in runtime.choices.items() if k in BUILD_TIME_ARGS}
    validate(cfg, choices)
    run_dir = Path(runtime.output_dir)
    logger = build_logger(cfg, choices, run_dir)
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
