"""DeepSpeed's just-in-time ops (rlmm/trainers/deepspeed_ops.py): a build lock left by a dead process is broken,
not waited on for ever; a live build's lock is waited for; DeepSpeed's trainer starts past a dead build's lock."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rlmm.models.tiny import default_cache_dir
from rlmm.trainers.deepspeed_ops import STALE_LOCK_SECONDS, clear_stale_locks, extensions_dir
from tests.conftest import subprocess_env

REPO = Path(__file__).resolve().parent.parent


def lock_aged(root: Path, op: str, seconds: float) -> Path:
    lock = root / op / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    os.utime(lock, (time.time() - seconds, time.time() - seconds))
    return lock


def test_a_dead_builds_lock_is_removed_a_live_one_waited_for(tmp_path):
    dead = lock_aged(tmp_path, "dead_op", STALE_LOCK_SECONDS + 5)
    live = lock_aged(tmp_path, "live_op", 0)
    (tmp_path / "unlocked_op").mkdir()
    threading.Timer(0.5, live.unlink).start()  # the live build finishes half a second in
    started = time.perf_counter()
    removed = clear_stale_locks(tmp_path, poll=0.05)
    assert removed == [dead] and not dead.exists()
    assert time.perf_counter() - started >= 0.5  # waited for the live build rather than breaking its lock
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dead_op", "live_op", "unlocked_op"]


def test_the_build_folder_is_this_environments_own():
    """Inside a writable environment (every test run's .venv), else a folder of rlmm's cache of its own."""
    if os.access(sys.prefix, os.W_OK):
        assert extensions_dir() == Path(sys.prefix) / "torch_extensions"
    else:
        assert extensions_dir().parent == default_cache_dir() / "torch_extensions"


@pytest.mark.timeout(420)
def test_deepspeed_starts_past_a_build_lock_its_dead_builder_left(small_model_path, tmp_path):
    """A copy of the environment's built op with a lock an hour old (a build killed mid-way): DeepSpeed's trainer
    starts, in a process of its own (DeepSpeed builds its op once per process), and the lock is gone. Without
    `prepare_jit_ops` torch waits on that lock for ever (this test's CI run did, 900 s per DeepSpeed test)."""
    root = tmp_path / "torch_extensions"
    built = extensions_dir() / "deepspeed_shm_comm"
    if built.is_dir():  # the op setup built: a copy keeps this test from rebuilding it
        shutil.copytree(built, root / "deepspeed_shm_comm", ignore=shutil.ignore_patterns("lock"))
    lock = lock_aged(root, "deepspeed_shm_comm", 3600)
    start = (f"from rlmm.policy.precision import SidePrecision\nfrom tests.conftest import build_trainer, sampling\n"
             f"build_trainer('deepspeed', {small_model_path!r}, SidePrecision('fp32', False), sampling()).close()\n"
             f"print('trainer started')\n")
    done = subprocess.run([sys.executable, "-c", start], cwd=REPO, env=subprocess_env(TORCH_EXTENSIONS_DIR=str(root)),
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0 and "trainer started" in done.stdout, done.stderr[-3000:]
    assert not lock.exists()
    assert "left by a process that died while building" in done.stderr
