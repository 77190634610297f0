"""One process at a time in a run directory: an exclusive lock held for the run's life.

Two `rlmm train` into one directory at once (a double submit, a sweep launched again while the first still runs)
would both write its record and its checkpoints: rows lost, a checkpoint renamed under the other, a record no
resume can read. So before the run directory is checked (rlmm/run/resume.py) the app takes

    <run dir>/.rlmm-lock      flock(2), exclusive, held until the process ends or the app returns;
                              the file names its holder: host, process id, when it took the lock

A second process is refused at once, naming the holder, before it reads or writes anything else there (exit 2,
as for every run directory this run may not use: `ResumeRefused`). The lock belongs to the open file, so the
kernel drops it when its process dies however it dies (SIGKILL, the OOM killer, a node reboot): a killed run
leaves no stale lock, and the file that stays behind is only the name of whoever held it last (that is why it
is rewritten by every start, refused or not, and is no part of the record). flock is honoured across the
hosts of an NFS mount (Linux emulates it there with POSIX locks); on a file system without locks the run goes on
with a warning. Only rank 0 takes it: the ranks of one run share their directory.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from rlmm.run.resume import ResumeRefused

log = logging.getLogger(__name__)

LOCK_FILE = ".rlmm-lock"
# What the file system answers when it cannot lock at all (as opposed to: another process holds it).
NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)
# What it answers when no file can be made there: then the run's first write reports it (rlmm/launch/apps.py,
# machine_fault), as it did before the lock.
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


class RunDirInUse(ResumeRefused):
    """Another process holds the run directory's lock; nothing in the directory was read or written."""


def holder(path: Path) -> str:
    """Who holds the lock, as its file says: "host h, pid p, since 2026-12-06 01:14:12"."""
    try:
        fields = dict(item.split("=", 1) for item in path.read_text(encoding="utf-8").split() if "=" in item)
    except (OSError, UnicodeDecodeError):
        fields = {}
    if not {"host", "pid"} <= fields.keys():
        return "a process that has not yet named itself"
    since = f", since {fields['since'].replace('T', ' ')}" if "since" in fields else ""
    return f"host {fields['host']}, pid {fields['pid']}{since}"


@contextmanager
def holding(run_dir: str | Path) -> Iterator[None]:
    """Hold `run_dir`'s lock for the block; raise RunDirInUse at once when another process holds it."""
    path = Path(run_dir) / LOCK_FILE
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as err:
        if err.errno not in NOT_WRITABLE:
            raise
        yield  # nothing can be written there: the run's first write says so, in one line
        return
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise RunDirInUse(f"hydra.run.dir: {run_dir} is in use by another rlmm run ({holder(path)}): let it "
                                  f"end, or give this run another hydra.run.dir") from None
            if err.errno not in NO_LOCKS:
                raise
            log.warning("cannot lock %s on this file system (%s): a second run into it would not be refused",
                        path, os.strerror(err.errno))
        else:
            os.ftruncate(descriptor, 0)
            os.pwrite(descriptor, f"host={socket.gethostname()} pid={os.getpid()} "
                                  f"since={time.strftime('%Y-%m-%dT%H:%M:%S')}\n".encode(), 0)
        yield
    finally:
        os.close(descriptor)  # drops the lock
