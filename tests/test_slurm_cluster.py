"""The local single-node SLURM cluster (slurm/cluster.sh) starts and runs a real batch job.

The module fixture runs `cluster.sh start` (installs SLURM when missing and running as root, then
starts munged/slurmctld/slurmd; about a second when already running) and leaves the cluster running
for later tests. Where it cannot start (no root, no apt), the tests skip, except in CI (`CI` set),
where a cluster is expected and its absence fails them."""
from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "slurm" / "cluster.sh"
# The terminal states `scontrol show job` reports.
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
        "DEADLINE"}


def cluster(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, cwd=ROOT)


def start_or_skip(script: Path, limit: float) -> None:
    """`bash <script> start`, or the test skipped where it cannot start (no root, no apt), except in CI (`CI` set),
    where a cluster is expected and its absence fails the test."""
    try:
        result = subprocess.run(["bash", str(script), "start"], capture_output=True, text=True, timeout=limit,
                                stdin=subprocess.DEVNULL, cwd=ROOT)
        ok, output = result.returncode == 0, (result.stdout + result.stderr).strip()
        reason = f"exit {result.returncode}"
    except subprocess.TimeoutExpired as e:
        ok, output, reason = False, f"{e.stdout or ''}{e.stderr or ''}", f"timed out after {limit} s"
    if not ok:
        message = f"`bash slurm/{script.name} start` failed ({reason}):\n{output[-3000:]}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def slurm_cluster() -> None:
    start_or_skip(SCRIPT, limit=360)  # 180 s for an install and a start, twice over behind another worker's start


def job_state(job_id: str) -> str | None:
    """JobState from scontrol, None once the controller has forgotten the job."""
    result = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    match = re.search(r"\bJobState=(\S+)", result.stdout)
    return match.group(1) if match else None


def test_help_lists_commands():
    result = cluster("--help")
    assert result.returncode == 0
    for command in ("install", "start", "status", "stop"):
        assert command in result.stdout


def test_unknown_command_is_one_line_error():
    result = cluster("strat")
    assert result.returncode == 2
    assert result.stderr.strip() == \
        "cluster.sh: error: unknown command 'strat' (allowed: install, start, status, stop, --help)"


def test_status_reports_usable(slurm_cluster):
    result = cluster("status")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "cluster: usable" in result.stdout


def test_start_again_is_quick(slurm_cluster):
    begin = time.monotonic()
    result = cluster("start")
    assert result.returncode == 0, result.stdout + result.stderr
    assert time.monotonic() - begin < 15


def test_daemons_do_not_hold_the_start_lock(slurm_cluster):
    # A daemon that inherits cluster.sh's lock holds it for its life: every later start then waits 30 min (CI, 2026-12-07).
    lock = Path(os.environ.get("TMPDIR", "/tmp")) / "rlmm-slurm-cluster.lock"
    holders = []
    for name in ("munged", "slurmctld", "slurmd"):
        pids = subprocess.run(["pgrep", "-x", name], capture_output=True, text=True).stdout.split()
        for pid in pids:
            fds = Path(f"/proc/{pid}/fd")
            try:
                targets = [os.readlink(fd) for fd in fds.iterdir()]
            except PermissionError:
                pytest.skip(f"cannot read {fds} (the daemons run as another user)")
            except FileNotFoundError:  # exited (or a zombie) since pgrep
                continue
            if str(lock) in targets:
                holders.append(f"{name} {pid}")
    assert not holders, f"{', '.join(holders)} hold {lock}"


def test_batch_job_runs(slurm_cluster, tmp_path):
    out = tmp_path / "out.txt"
    submit = subprocess.run(["sbatch", "--parsable", "--wrap", "echo rlmm-ok", "-o", str(out)],
                            capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert submit.returncode == 0, submit.stderr
    job_id = submit.stdout.strip().split(";")[0]

    limit = 300  # the node's cores may be taken by another test worker's sweep's jobs
    deadline = time.monotonic() + limit
    state = job_state(job_id)
    while state not in DONE and time.monotonic() < deadline:
        if state is None and out.exists():  # already completed and purged
            break
        time.sleep(0.5)
        state = job_state(job_id)
    assert state in DONE or state is None, f"job {job_id} still {state} after {limit} s"
    assert state in ("COMPLETED", None), f"job {job_id} ended {state}: {out.read_text() if out.exists() else ''}"
    # The output file is written by slurmd on the node; it is there once the job has completed.
    assert "rlmm-ok" in out.read_text()
