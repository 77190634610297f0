"""Crash consistency, in the spirit of SQLite's crash tests: a short run SIGKILLed at a chosen point (a phase of a
step: tests/fault_at.py), then the same command again, must end with the records of a run never interrupted:
every step row once, every number but the timings equal, the summary written, no half-written checkpoint left,
and no file outside the run directory changed.

The default run tries two points (a torn row of steps.jsonl, a chunk of partial rollouts); the whole sweep (every
point at every step, with staleness 1 and its batch in flight, the overlapped sampler whose process is killed
instead, the MoE model under routing replay, and partial rollouts at staleness 2 with responses half sampled in
flight) is `slow`: docs/testing.md has its figures. So
is the sweep of damage a user or a disk does to a killed run's directory (a torn or repeated middle row, flipped
checkpoint bytes, the newest checkpoint removed) and Ctrl-C, each in every variant (issue 50; each damage's
default check is in tests/test_damaged_runs.py).
"""
import hashlib
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rlmm.models.tiny import BUILTIN_DIR
from rlmm.run.records import read_steps
from tests.conftest import subprocess_env

STEPS = 3
BASE = ("train", "debug=train", "sampler=hf", "trainer=torch", "precision=fp32", f"train.steps={STEPS}",
        "train.checkpoint_every=1")
VARIANTS = {
    "sync": (),
    "staleness1": ("train.staleness=1",),  # a batch in flight between steps, in the checkpoint
    "overlap": ("train.staleness=1", "train.overlap=true"),  # the sampler in a process of its own
    "moe_r3": ("model=tiny_moe", "routing=r3"),  # the sampler's experts replayed in every policy forward
    # responses sampled a token per weight sync: after step 1 batches 2 and 3 are in flight half sampled
    "partial": ("train.staleness=2", "train.partial_rollouts=true", "train.rollout_chunk=1"),
}
# The calls of each point in a 3-step run with a checkpoint every step, counted (RunRecord.log is also step 0's).
POINTS = {"sampling": 3, "update": 3, "weight_sync": 3, "record": 4, "record_written": 4, "checkpoint": 3,
          "checkpointed": 3}
# Partial rollouts: `sampling` is a call per batch and chunk (tests/fault_at.py): step 1 starts batches 1-3 (calls
# 1-3: batch 1 whole, 2 and 3 a token each), step 2 advances batches 2 (to its end) and 3 (a token) (calls 4-5),
# step 3 finishes batch 3 (call 6).
POINTS_OF = {variant: POINTS for variant in VARIANTS} | {"partial": {**POINTS, "sampling": 6}}
# partial, sampling 5: step 2, batch 2 finished in memory, batch 3 (a token sampled under v_0, in step 1's checkpoint)
# being continued under v_1
# The default run's points (the slow sweep takes every other; sync checkpoint 2 and staleness1 weight_sync 2 joined
# it on 2026-12-07, to keep CI's run under 45 min: docs/testing.md)
DEFAULT = [("sync", "record", 3), ("partial", "sampling", 5)]


def every_point() -> list[tuple[str, str, int]]:
    points = [(variant, point, n) for variant in VARIANTS for point, calls in POINTS_OF[variant].items()
              for n in range(1, calls + 1) if variant != "overlap" or point not in ("sampling",)]
    points += [("overlap", "sampler_process", n) for n in (1, 2, 3)]
    return [p for p in points if p not in DEFAULT]


def rlmm(run_dir: Path, *overrides: str, fault=None):
    program = ["tests/fault_at.py", *map(str, fault)] if fault else ["-m", "rlmm.cli"]
    return subprocess.run([sys.executable, *program, *overrides, f"hydra.run.dir={run_dir}"], capture_output=True,
                          text=True, timeout=600, env=subprocess_env(), stdin=subprocess.DEVNULL)


def comparable(rows):
    return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in rows]


def digests(root: Path, leaving_out: Path | None = None) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file() and (leaving_out is None or leaving_out not in p.parents)}


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory):
    """Each variant's uninterrupted records, run when first asked for."""
    runs = {}

    def of(variant: str) -> list[dict]:
        if variant not in runs:
            run_dir = tmp_path_factory.mktemp(f"straight-{variant}") / "run"
            done = rlmm(run_dir, *BASE, *VARIANTS[variant])
            assert done.returncode == 0, done.stderr[-3000:]
            runs[variant] = read_steps(run_dir)
        return runs[variant]

    return of


def assert_killed_run_resumes_to_the_straight_records(straight_runs, tmp_path, variant, point, n):
    overrides = (*BASE, *VARIANTS[variant])
    run_dir = tmp_path / "run"
    (tmp_path / "neighbour.txt").write_text("a file outside the run directory")
    outside = {**digests(tmp_path, leaving_out=run_dir), **digests(BUILTIN_DIR)}
    killed = rlmm(run_dir, *overrides, fault=("kill", point, n))
    # SIGKILL of the trainer; a killed sampler process is a machine fault the trainer reports (exit 4)
    expected = 4 if point == "sampler_process" else -signal.SIGKILL
    assert killed.returncode == expected, killed.stdout[-2000:] + killed.stderr[-3000:]
    resumed = rlmm(run_dir, *overrides)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    rows = read_steps(run_dir)
    assert [row["step"] for row in rows] == list(range(STEPS + 1))  # none missing, none twice, no torn line
    assert len((run_dir / "steps.jsonl").read_text().splitlines()) == STEPS + 1
    assert comparable(rows) == comparable(straight_runs(variant))
    assert (run_dir / "summary.json").exists()
    assert not list((run_dir / "checkpoints").glob(".partial-*"))
    assert {**digests(tmp_path, leaving_out=run_dir), **digests(BUILTIN_DIR)} == outside


@pytest.mark.parametrize("variant,point,n", DEFAULT)
def test_a_run_killed_at_a_point_resumes_to_the_uninterrupted_records(straight_runs, tmp_path, variant, point, n):
    assert_killed_run_resumes_to_the_straight_records(straight_runs, tmp_path, variant, point, n)


@pytest.mark.slow  # 114 kill points x two runs of seconds each: tens of minutes (docs/testing.md)
@pytest.mark.parametrize("variant,point,n", every_point())
def test_every_kill_point_resumes_to_the_uninterrupted_records(straight_runs, tmp_path, variant, point, n):
    assert_killed_run_resumes_to_the_straight_records(straight_runs, tmp_path, variant, point, n)


# ---- damage, then the same command (issue 50): every variant, each damage -----------------------------------------

def damage_then_resume(run_dir: Path, overrides: tuple, damage: str) -> None:
    """Bring run_dir to the damaged state `damage` names; the run that makes it ends as expected."""
    if damage == "sigint":  # Ctrl-C after step 1's row: a checkpoint of step 1 (the only one), exit 130
        stopped = rlmm(run_dir, *overrides, "train.checkpoint_every=0", fault=("sigint", "record_written", 2))
        assert stopped.returncode == 130, stopped.stdout[-2000:] + stopped.stderr[-3000:]
        return
    # SIGKILL after the last row, before its checkpoint: rows 0-3, checkpoints of steps 1 and 2
    killed = rlmm(run_dir, *overrides, fault=("kill", "record_written", STEPS + 1))
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-2000:] + killed.stderr[-3000:]
    steps, newest = run_dir / "steps.jsonl", run_dir / "checkpoints" / f"step-{STEPS - 1:06d}"
    lines = steps.read_text().splitlines(keepends=True)
    if damage == "torn_middle_row":  # step 2's row cut in half (a disk, an editor)
        steps.write_text("".join([*lines[:2], lines[2][:len(lines[2]) // 2] + "\n", *lines[3:]]))
    elif damage == "repeated_middle_row":  # step 2's row twice (a copy appended twice)
        steps.write_text("".join([*lines[:3], lines[2], *lines[3:]]))
    elif damage == "flipped_checkpoint":  # 4000 bytes of the newest checkpoint's weights inverted
        data = bytearray((newest / "model.safetensors").read_bytes())
        middle = len(data) // 2
        data[middle:middle + 4000] = bytes(b ^ 0xFF for b in data[middle:middle + 4000])
        (newest / "model.safetensors").write_bytes(bytes(data))
    elif damage == "newest_checkpoint_removed":  # by hand, `latest` still naming it
        shutil.rmtree(newest)
    else:
        raise ValueError(damage)


DAMAGES = ("torn_middle_row", "repeated_middle_row", "flipped_checkpoint", "newest_checkpoint_removed", "sigint")


@pytest.mark.slow  # 25 damaged runs x two runs of seconds each (docs/testing.md); each damage's default check:
@pytest.mark.parametrize("variant", VARIANTS)  # tests/test_damaged_runs.py
@pytest.mark.parametrize("damage", DAMAGES)
def test_every_damage_resumes_to_the_uninterrupted_records(straight_runs, tmp_path, variant, damage):
    overrides = (*BASE, *VARIANTS[variant])
    run_dir = tmp_path / "run"
    damage_then_resume(run_dir, overrides, damage)
    resumed = rlmm(run_dir, *overrides)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    rows = read_steps(run_dir)
    assert [row["step"] for row in rows] == list(range(STEPS + 1))
    assert len((run_dir / "steps.jsonl").read_text().splitlines()) == STEPS + 1
    assert comparable(rows) == comparable(straight_runs(variant))
    assert (run_dir / "summary.json").exists()
