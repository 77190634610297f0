"""Writes that say which file the disk refused.

A full disk does not always look like one: Python's own writes raise OSError(ENOSPC) without the file's name
(a buffered flush), safetensors raises `SafetensorError("... No space left on device (os error 28)")` and
`torch.save` a RuntimeError from its zip writer ("unexpected pos 576 vs 534"). `writing(path)` turns each into
`OSError(errno, strerror, path)`, which `disk_fault` names in a few words and the commands report in one line
(exit 4: `rlmm.launch.apps.machine_fault` for `rlmm train` and `rlmm probe`, `rlmm table`'s own): an OSError keeps its
errno and gains the path; any other error raised while the file system holding `path` has less than
FULL_BELOW_BYTES free is that file system being full (what is left after a write that failed on space is
nothing, give or take a block).
"""
from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

FULL_BELOW_BYTES = 1 << 20
# The OSErrors that are the disk's or the file system's, not a bug's: what each means for the user.
DISK_FAULTS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
               errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
               errno.EPERM: "not permitted (an immutable file or directory?)", errno.EIO: "an I/O error of the disk"}


def disk_fault(err: BaseException) -> str | None:
    """`err`, an OSError of the disk (DISK_FAULTS), in a few words naming its file: `the disk is full (<path>)`;
    None for any other error."""
    if isinstance(err, OSError) and err.errno in DISK_FAULTS:
        text = str(err).splitlines()[0] if str(err) else type(err).__name__
        return f"{DISK_FAULTS[err.errno]} ({err.filename or text})"
    return None


def free_bytes(path: Path) -> int | None:
    """Free bytes on the file system holding `path` (or its nearest existing parent); None if unknown."""
    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


@contextmanager
def writing(path: str | Path):
    """Around writes into `path` (a file or a directory): a failure of the disk is an OSError naming it."""
    path = Path(path)
    try:
        yield
    except OSError as err:
        if err.filename is not None or err.errno is None:
            raise
        raise OSError(err.errno, err.strerror, str(path)) from err
    except Exception as err:
        free = free_bytes(path)
        if free is not None and free < FULL_BELOW_BYTES:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from err
        raise
