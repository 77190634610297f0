"""rlmm's own exceptions and the one-line exit for bad input: a leaf module (it imports nothing of rlmm),
so every module can raise and catch these without an import cycle.

- `ConfigError`, and `ValueError` raised inside rlmm: bad input; the CLI prints the first line and
  exits 2 (`rlmm.launch.apps.user_error`). Every such line (error, stopped, machine fault, interrupted) goes to stderr.
- `RunStopped` and its kinds: the run stopped itself cleanly (exit 3): it is not a bug, and the
  message says where it can resume.
- `MachineFault`: a fault of the machine, not of the input or of rlmm (a dead sampler process, a disk full,
  read-only or not permitted, a rank gone): one line, exit 4, with what the run's record still holds
  (`rlmm.launch.apps.machine_fault`; OSErrors of the disk and torch's distributed errors are told apart there).
- `JobFailed`: why a job of a submitted sweep failed, carried back to `rlmm ... -m`.
"""
from __future__ import annotations

import sys
from typing import NoReturn


class ConfigError(ValueError):
    """A bad config value, with a one-line message meant for the user."""


class RunStopped(RuntimeError):
    """The run stopped itself; the message says why and where it can resume."""


class TrainingStopped(RunStopped):
    """Too many bad (skipped) steps in a row."""


class NonFiniteWeights(RunStopped):
    """The update produced NaN/Inf weights (an optimizer without an overflow check); never synced."""


class MachineFault(RuntimeError):
    """A fault of the machine the run met (exit 4); the message says what failed."""


MACHINE_FAULT_EXIT = 4


class JobFailed(RuntimeError):
    """Why a job of a submitted sweep failed, one line, as its result carries it back to `rlmm ... -m`."""


def fail(message: str) -> NoReturn:
    """Print `rlmm: error: <message>` on stderr and exit 2 (bad input on the command line)."""
    print(f"rlmm: error: {message}", file=sys.stderr)
    raise SystemExit(2)
