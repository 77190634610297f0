"""Stop signals: checkpoint at the next step boundary, then let whoever handled the signal act.

SLURM warns a job before it kills it: SIGTERM on `scancel` and preemption, and the signal asked for
with `--signal` before the time limit (submitit asks for SIGUSR2 and requeues the job from its
handler; other setups use SIGUSR1). A handler that runs in the middle of an optimizer step cannot
checkpoint safely, so ours only records the signal; the training loop checks `requested` after each
step, writes a checkpoint, and calls `hand_over()`, which runs the handler that was installed before
ours (submitit's requeue) or, when there was none, exits with the conventional 128 + signal number.

SIGINT (Ctrl-C in the run's terminal) is one of them: the run checkpoints at the end of its step and exits 130,
where Python's own handler would raise KeyboardInterrupt wherever the run stood (a traceback, no checkpoint). A
second Ctrl-C before that does what Ctrl-C always did: KeyboardInterrupt at once (rlmm/launch/apps.py says it in one
line), for a user who will not wait for the step to end.
"""
from __future__ import annotations

import signal
import sys

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)


class StopSignals:
    def __init__(self, signals=STOP_SIGNALS):
        self.signals = signals
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _record(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C twice: stop now, without the checkpoint
        if self.received is None:
            self.received = signum

    @property
    def requested(self) -> bool:
        return self.received is not None

    def hand_over(self) -> None:
        """Run the previous handler of the received signal (it may requeue and exit); if it returns or
        there was none, exit with 128 + the signal number. A rank that stops for a signal another rank received
        (the loop stops every rank together) has none of its own to hand over: it exits as for SIGTERM."""
        signum = self.received
        self.__exit__()
        if signum is None:
            sys.exit(128 + signal.SIGTERM)
        previous = self._previous.get(signum)
        if callable(previous) and previous is not signal.default_int_handler:  # Python's raises KeyboardInterrupt
            previous(signum, None)
        sys.exit(128 + signum)
