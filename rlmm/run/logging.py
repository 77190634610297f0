"""Experiment loggers (`logger=` group): W&B, or nothing. The run's local record is always written.

A logger has three calls: `log(metrics, step)`, `summary(metrics)`, `finish()`. `NoOpLogger` has the
same API, so code that logs never checks whether logging is on (nanoGPT's trick), and non-zero ranks
get one too.
"""
from __future__ import annotations

import os
import secrets
import re
from pathlib import Path

# A key that names a credential: api_key, WANDB_API_KEY, hf_token, secret, password (not max_new_tokens).
SECRET_KEY = re.compile(r"(^|_)(api_?key|token|secret|password|passwd)$", re.IGNORECASE)


def redact(config: dict) -> dict:
    """Drop values whose key looks like a credential, at any depth, before a config is saved or sent."""
    out = {}
    for key, value in config.items():
        if SECRET_KEY.search(str(key)):
            out[key] = "<redacted>"
        else:
            out[key] = redact(value) if isinstance(value, dict) else value
    return out


class NoOpLogger:
    def __init__(self, run_config: dict | None = None, run_dir: str | None = None, sweep: str | None = None):
        pass

    def log(self, metrics: dict, step: int | None = None) -> None:
        pass

    def summary(self, metrics: dict) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbLogger:
    """Weights & Biases, offline unless `mode` is online (needs WANDB_API_KEY in the environment).

    Args:
        project: W&B project.
        mode: offline | online | disabled.
        group: W&B group (null: the sweep's name for the jobs of a multirun, none for a single run).
        tags: extra tags; the run is also tagged with each axis choice (sampler=vllm, ...).
    """

    MODES = ("offline", "online", "disabled")

    def __init__(self, run_config: dict, run_dir: str, project: str, mode: str, group: str | None, tags: list[str],
                 sweep: str | None = None):
        if mode not in self.MODES:
            raise ValueError(f"logger.mode: unknown mode '{mode}' (allowed: {', '.join(self.MODES)})")
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        axis_tags = [f"{k}={v}" for k, v in run_config.get("choices", {}).items()]
        # The run id lives in the run directory: a job resumed there (requeued after preemption)
        # continues the same W&B run instead of starting a second one.
        id_file = Path(run_dir) / "wandb-run-id"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
        self.run = wandb.init(project=project, mode=mode, group=group or sweep, dir=str(Path(run_dir)),
                              config=redact(run_config), tags=[*tags, *axis_tags][:64], reinit="finish_previous",
                              id=run_id, resume="allow")
        id_file.parent.mkdir(parents=True, exist_ok=True)
        id_file.write_text(run_id)

    def log(self, metrics: dict, step: int | None = None) -> None:
        self.run.log(metrics, step=step)

    def summary(self, metrics: dict) -> None:
        self.run.summary.update(metrics)

    def finish(self) -> None:
        self.run.finish()
