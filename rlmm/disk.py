"""Writes that say which file the disk refused.

A full disk does not always look like one: Python's own writes raise OSError(ENOSPC) without the file's name
(a buffered flush), safetensors raises `SafetensorError("... No space left on device (os error 28)")` and
`torch.save` a RuntimeError from its zip writer ("unexpected pos 576 vs 534"). `writing(path)` turns each into
`OSError(errno, strerror, path)`, which `rlmm.apps.machine_fault` reports in one line (exit 4): an OSError keeps
its errno and gains the path; any other error raised while the file system holding `path` has less than
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
