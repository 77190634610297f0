"""The run's local record: what tables and plots are built from (W&B is optional, this is not).

    <run dir>/config.yaml     resolved config (credentials redacted)
    <run dir>/steps.jsonl     one JSON object per step, flushed and fsynced as it is written
    <run dir>/summary.json    written at the end of a run that finished

A reader tolerates a truncated last line (a job killed mid-write), so a killed run's record stays
readable up to its last complete step; any other line that is not the next step's row (torn, repeated, out of
place) is damage, named by `read_record` (a resume starts from a checkpoint before it: rlmm/run/resume.py).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from rlmm.run.logging import redact
from rlmm.runtime.disk import writing
from rlmm.runtime.errors import MachineFault


def json_safe(value):
    """JSON-safe: NaN/inf become None (strict JSON has no such numbers; every record of rlmm writes them so: steps.jsonl,
    summary.json, probe.json), tensors and numpy scalars become Python numbers."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
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
        if keep_through_step:  # the rows of steps 0..keep_through_step, whole (rlmm/run/resume.py chose the step so)
            kept = [row for row in read_steps(self.dir) if row["step"] <= keep_through_step]
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(row) + "\n" for row in kept), encoding="utf-8")
            os.replace(tmp, path)
        elif path.exists():
            path.unlink()  # a fresh run in a used directory starts a fresh record
        (self.dir / "summary.json").unlink(missing_ok=True)
        self._steps = open(path, "a", encoding="utf-8")

    def log(self, metrics: dict, step: int) -> None:
        if os.fstat(self._steps.fileno()).st_nlink == 0:  # rows written on would go nowhere a reader finds them
            raise MachineFault(f"{self._steps.name} was removed while the run wrote it (its run directory removed or "
                               f"replaced?)")
        with writing(self._steps.name):
            self._steps.write(json.dumps(json_safe({"step": step, **metrics})) + "\n")
            self._steps.flush()
            os.fsync(self._steps.fileno())

    def summary(self, summary: dict) -> None:
        path = self.dir / "summary.json"
        tmp = path.with_suffix(".tmp")
        with writing(path):
            tmp.write_text(json.dumps(json_safe(summary), indent=2))
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


def finished(run_dir: str | Path) -> bool:
    """Whether the run finished: its summary.json is there and reads (a torn one is a run to resume, for
    `rlmm train` and `rlmm table` alike)."""
    try:
        return isinstance(json.loads((Path(run_dir) / "summary.json").read_text(encoding="utf-8")), dict)
    except (OSError, ValueError):
        return False


def read_steps(run_dir: str | Path) -> list[dict]:
    """The record's rows of steps 0, 1, 2, ... up to its first damage (a torn last line is skipped)."""
    return read_record(run_dir)[0]


@dataclass(frozen=True)
class RecordDamage:
    """The first line of steps.jsonl that is not the next step's row: `line` (1-based), `after` the step of the row
    before it (None: none), `problem` ("is torn or not JSON", "repeats step 2", "holds step 5"), `lines_after` how
    many lines follow it."""

    line: int
    after: int | None
    problem: str
    lines_after: int

    @property
    def step(self) -> int:
        """The step whose row that line should be."""
        return 0 if self.after is None else self.after + 1

    def __str__(self) -> str:
        return self.of("steps.jsonl")

    def of(self, path: str | Path) -> str:
        """"line 4 of <path> (after step 2) is torn or not JSON"."""
        after = "before any step" if self.after is None else f"after step {self.after}"
        return f"line {self.line} of {path} ({after}) {self.problem}"


def read_record(run_dir: str | Path) -> tuple[list[dict], RecordDamage | None]:
    """The record's rows of steps 0, 1, 2, ... in that order, up to its first line that is not the next step's row,
    and that line (None when there is none). A line that is not a JSON object with a "step" is torn (or damage); a
    row of another step than the next is a repeat (a row written twice) or out of place (rows missing). The torn
    last line of a run that did not finish is no damage: a kill mid-write leaves it, and it is redone on resume."""
    rows = []
    path = Path(run_dir) / "steps.jsonl"
    if not path.exists():
        return rows, None
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for number, line in enumerate(lines, start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        after = rows[-1]["step"] if rows else None
        expected = 0 if after is None else after + 1
        if not isinstance(row, dict) or "step" not in row:
            if number == len(lines) and not finished(run_dir):
                return rows, None  # the last line of a run killed while writing it: expected, not damage
            problem = "is torn or not JSON"
        elif row["step"] != expected:
            problem = f"repeats step {row['step']}" if after is not None and row["step"] <= after else \
                f"holds step {row['step']}"
        else:
            rows.append(row)
            continue
        return rows, RecordDamage(number, after, problem, len(lines) - number)
    return rows, None


def read_steps_and_damage(run_dir: str | Path) -> tuple[list[dict], str]:
    """The record's rows up to its first damage (`read_record`), and what was skipped: "" when nothing, else e.g.
    "line 5 of steps.jsonl (after step 3) is torn or not JSON, it and the 2 lines after it skipped"."""
    rows, damage = read_record(run_dir)
    if damage is None:
        return rows, ""
    rest = damage.lines_after
    skipped = f"it and the {rest} line{'s' if rest != 1 else ''} after it skipped" if rest else "skipped"
    return rows, f"{damage}, {skipped}"
