"""What the table's modules share: one run as every source reads it (`Run`), the status rule of
`rlmm.table`'s docstring (`set_status`), the numbers a record may hold (`is_number`, `number`), and
`TableError` for bad input."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


class TableError(ValueError):
    """Bad input (path, metric, source), with a one-line message for the user."""


@dataclass
class Run:
    name: str
    path: str
    overrides: dict[str, str]
    status: str = "failed"
    kind: str = ""                                       # train | probe | "" (nothing recorded)
    steps: int = 0                                       # training steps recorded (probe: 1 once done)
    history: list[dict] = field(default_factory=list)    # one dict per step, with "step"
    values: dict[str, float] = field(default_factory=dict)  # one-off numbers: summary/*, probe metrics
    note: str = ""                                       # why not complete
    damage: str = ""                                     # what of its record could not be read (then its
                                                         # final values are those of the last step before it)


def set_status(run: Run, complete: bool, error: str = "", note: str = "") -> Run:
    """The status rule of `rlmm.table`'s docstring."""
    if complete and not error:
        run.status = "complete"
    elif error or run.steps == 0:
        run.status = "failed"
        run.note = note or error or ("nothing recorded" if not run.history else "no training step recorded")
    else:
        run.status = "incomplete"
        run.note = note or f"stopped after step {run.steps}"
    return run


def is_number(value) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def number(value) -> float:
    return math.nan if value is None else float(value)
