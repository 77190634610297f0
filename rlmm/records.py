"""The run's local record: what tables and plots are built from (W&B is optional, this is not).

    <run dir>/config.yaml     resolved config (credentials redacted)
    <run dir>/steps.jsonl     one JSON object per step, flushed and fsynced as it is written
    <run dir>/summary.json    written at the end of a run that finished

A reader tolerates a truncated last line (a job killed mid-write), so a killed run's record stays
readable up to its last complete step.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from omegaconf import OmegaConf

from rlmm.disk import writing
from rlmm.logging import redact


def _plain(value):
    """JSON-safe: NaN/inf become None (JSON has no such numbers), tensors become floats."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class RunRecord:
    """Args:
        keep_through_step: resuming from a checkpoint of this step: keep the record's steps up to it
            and drop the later ones (they are redone), so no step is missing or written twice.
    """

    def __init__(self, run_dir: str | Path, config: dict, keep_through_step: int | None = None):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(OmegaConf.create(redact(config)), self.dir / "config.yaml")
        path = self.dir / "steps.jsonl"
        if keep_through_step:
            kept = [row for row in read_steps(self.dir) if row["step"] <= keep_through_step]
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(row) + "\n" for row in kept), encoding="utf-8")
            os.replace(tmp, path)
        elif path.exists():
            path.unlink()  # a fresh run in a used directory starts a fresh record
        (self.dir / "summary.json").unlink(missing_ok=True)
        self._steps = open(path, "a", encoding="utf-8")

    def log(self, metrics: dict, step: int) -> None:
        with writing(self._steps.name):
            self._steps.write(json.dumps(_plain({"step": step, **metrics})) + "\n")
            self._steps.flush()
            os.fsync(self._steps.fileno())

    def summary(self, summary: dict) -> None:
        path = self.dir / "summary.json"
        tmp = path.with_suffix(".tmp")
        with writing(path):
            tmp.write_text(json.dumps(_plain(summary), indent=2))
            tmp.replace(path)

    def close(self) -> None:
        try:
            self._steps.close()
        except OSError:  # a write the disk refused, raised by `log` already: the rows before it are on disk
            pass


class NullRecord:
    """Stands in for RunRecord on ranks that do not write one."""

    def log(self, metrics: dict, step: int) -> None:
        pass

    def summary(self, summary: dict) -> None:
        pass

    def close(self) -> None:
        pass


def read_steps(run_dir: str | Path) -> list[dict]:
    """Every complete step of a run's record (a torn last line is skipped)."""
    return read_steps_and_damage(run_dir)[0]


def read_steps_and_damage(run_dir: str | Path) -> tuple[list[dict], str]:
    """The record's step rows up to its first line that is not a JSON object with a "step" (a torn line, or
    damage), and what was skipped: "" when nothing, or only the torn last line of a run that did not finish (a
    kill mid-write leaves it: it is redone on resume), else e.g. "line 5 of steps.jsonl (after step 3) is torn
    or not JSON, it and the 2 lines after it skipped"."""
    rows = []
    path = Path(run_dir) / "steps.jsonl"
    if not path.exists():
        return rows, ""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for number, line in enumerate(lines, start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict) or "step" not in row:
            if number == len(lines) and not (Path(run_dir) / "summary.json").exists():
                return rows, ""  # the last line of a run killed while writing it: expected, not damage
            after = f"after step {rows[-1]['step']}" if rows else "before any step"
            rest = len(lines) - number
            skipped = f"it and the {rest} line{'s' if rest != 1 else ''} after it skipped" if rest else "skipped"
            return rows, f"line {number} of steps.jsonl ({after}) is torn or not JSON, {skipped}"
        rows.append(row)
    return rows, ""
