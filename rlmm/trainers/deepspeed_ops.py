"""DeepSpeed's just-in-time ops, built where nothing outside this environment can block or undo them.

On a CPU, `deepspeed.init_distributed` compiles its shared-memory collectives (`deepspeed_shm_comm`, 1-3
minutes on 2 cores) through `torch.utils.cpp_extension.load`, into `~/.cache/torch_extensions` by default.
Two things go wrong with that default, both seen in this project's CI:

- torch guards each build with a bare `lock` file (`FileBaton`: no owner recorded, waited on forever). A
  process killed while it holds the lock (a CI timeout, a killed run, a restarted machine) leaves it behind,
  and every later DeepSpeed start on the machine hangs in `baton.wait()`: a CI run on a clone whose home
  carried such a lock hung 900 s in every DeepSpeed test until its 90 minutes ran out.
- the build directory is shared by every checkout, and the build's flags name the environment's own paths,
  so two checkouts used in turn rebuild the op at every switch (`.ninja_log` showed 13 rebuilds in a day).

So rlmm points `TORCH_EXTENSIONS_DIR` at its own environment (unless the user set it), `scripts/setup.sh`
builds the op there once, and a lock older than any build takes (`STALE_LOCK_SECONDS`; the slowest build
seen took 163 s on 2 busy cores) is broken with a warning instead of waited on for ever.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from pathlib import Path

from rlmm.models.tiny import default_cache_dir

log = logging.getLogger(__name__)

STALE_LOCK_SECONDS = 600.0


def extensions_dir() -> Path:
    """The environment's own build root: inside the virtual environment where it is writable, else a folder of
    rlmm's cache named after the environment (so two environments never share one)."""
    prefix = Path(sys.prefix)
    if os.access(prefix, os.W_OK):
        return prefix / "torch_extensions"
    return default_cache_dir() / "torch_extensions" / hashlib.sha1(str(prefix.resolve()).encode()).hexdigest()[:12]


def use_own_extensions_dir() -> Path:
    """`TORCH_EXTENSIONS_DIR`, set to `extensions_dir()` unless the user chose one; returns the one in use."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))
    return Path(os.environ["TORCH_EXTENSIONS_DIR"])


def clear_stale_locks(root: Path, stale_after: float = STALE_LOCK_SECONDS, poll: float = 1.0) -> list[Path]:
    """Wait while a build under `root` holds its lock; remove a lock older than `stale_after` seconds (its
    builder is gone: no build takes that long). Returns the locks removed."""
    removed = []
    for lock in sorted(root.glob("*/lock")):
        while True:
            try:
                age = time.time() - lock.stat().st_mtime
            except FileNotFoundError:
                break  # the build finished
            if age >= stale_after:
                log.warning("removing %s: a build lock %.0f s old, left by a process that died while building",
                            lock, age)
                lock.unlink(missing_ok=True)
                removed.append(lock)
                break
            time.sleep(poll)
    return removed


def prepare_jit_ops() -> Path:
    """Before DeepSpeed starts: its ops built in this environment's own folder, no dead build's lock in the way."""
    root = use_own_extensions_dir()
    clear_stale_locks(root)
    return root


def build_now() -> None:
    """Build the ops `deepspeed.init_distributed` would build on first use (what `scripts/setup.sh` calls)."""
    root = prepare_jit_ops()
    from deepspeed.accelerator import get_accelerator
    from deepspeed.comm.torch import build_shm_op

    if get_accelerator().device_name() != "cpu":
        print(f"[setup] DeepSpeed on {get_accelerator().device_name()}: no CPU ops to build")
        return
    started = time.perf_counter()
    built = build_shm_op()
    what = "shared-memory collectives" if built is not None else "nothing (this CPU has no shm op)"
    print(f"[setup] DeepSpeed JIT ops in {root}: {what}, {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    build_now()
