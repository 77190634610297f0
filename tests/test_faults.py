"""Faults of the machine a run meets, each one line (exit 4) with the record intact up to its last step, and the
same command resuming to the uninterrupted run's records: the disk filling up at a checkpoint, at steps.jsonl, at
the plot (a small tmpfs, filled from outside the run as the run reaches each point: tests/fault_at.py), a
read-only or immutable run directory, and a sampler process killed under `train.overlap`."""
import errno
import json
import os
import subprocess
import sys
import uuid

import pytest

from rlmm.run.records import read_steps
from tests.conftest import ending, subprocess_env

RUN = ("train", "debug=train", "sampler=hf", "trainer=torch", "precision=fp32", "train.steps=3",
       "train.checkpoint_every=1")


def comparable(rows):
    return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in rows]


def rlmm(run_dir, *overrides, fault=None, filler=None):
    """`rlmm` (with `fault` = (action, point, n): tests/fault_at.py) in `run_dir`."""
    program = ["tests/fault_at.py", *map(str, fault)] if fault else ["-m", "rlmm.cli"]
    env = subprocess_env(**({"RLMM_FAULT_FILLER": str(filler)} if filler else {}))
    return subprocess.run([sys.executable, *program, *overrides, f"hydra.run.dir={run_dir}"], capture_output=True,
                          text=True, timeout=600, env=env, stdin=subprocess.DEVNULL)


def mount(where, *options) -> None:
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(("size=256m", *options)), "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"a small disk needs `mount -t tmpfs` (root with CAP_SYS_ADMIN): {done.stderr.strip()}")


@pytest.fixture
def small_disk(tmp_path):
    """A 256 MiB tmpfs (two checkpoints of the built-in model are ~80 MB), unmounted afterwards."""
    disk = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount(disk)
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    done = rlmm(run_dir, *RUN)
    assert done.returncode == 0, done.stderr[-3000:]
    return read_steps(run_dir)


@pytest.mark.parametrize("point,n,fails_at,kept,resumes", [
    # row 1 written, the disk fills, then step 1's checkpoint fails
    ("record_written", 2, "checkpoints/.partial-step-000001", [0, 1], "starts over"),
    # step 1's checkpoint written, then step 2's row fails
    ("checkpointed", 1, "steps.jsonl", [0, 1], "resumes from its checkpoint of step 1"),
])
def test_a_full_disk_is_one_line_with_the_record_intact_and_the_same_command_resumes(small_disk, straight, point, n,
                                                                                    fails_at, kept, resumes):
    run_dir, filler = small_disk / "run", small_disk / "filler"
    full = rlmm(run_dir, *RUN, fault=("fill", point, n), filler=filler)
    assert full.returncode == 4, full.stdout[-2000:] + full.stderr[-3000:]
    assert ending(full) == (f"rlmm: machine fault: the disk is full ({run_dir / fails_at}); {run_dir}/steps.jsonl "
                            f"holds steps 0-{kept[-1]}; once it is fixed the same command {resumes}")
    assert "Traceback" not in full.stderr, full.stderr[-3000:]
    assert [row["step"] for row in read_steps(run_dir)] == kept
    assert not (run_dir / "checkpoints" / "step-000002").exists()  # a checkpoint is whole or absent
    filler.unlink()
    resumed = rlmm(run_dir, *RUN)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert comparable(read_steps(run_dir)) == comparable(straight)
    assert not list((run_dir / "checkpoints").glob(".partial-*"))  # removed at the start


def test_a_full_disk_at_the_plot_says_the_record_is_complete(small_disk, straight):
    run_dir, filler = small_disk / "run", small_disk / "filler"
    full = rlmm(run_dir, *RUN, fault=("fill", "summary", 1), filler=filler)
    assert full.returncode == 4, full.stdout[-2000:] + full.stderr[-3000:]
    assert ending(full) == (f"rlmm: machine fault: the disk is full ({run_dir / 'training.png'}); the run finished: "
                            f"its record in {run_dir} is complete (summary.json); what came after it is missing")
    assert comparable(read_steps(run_dir)) == comparable(straight)
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3


def test_a_read_only_run_directory_is_one_line_before_anything_starts(tmp_path):
    disk = tmp_path / "disk"
    mount(disk, "ro")
    try:
        existing = rlmm(disk, *RUN)  # the run directory is there: rlmm's first write fails
        assert existing.returncode == 4, existing.stdout[-2000:] + existing.stderr[-3000:]
        assert ending(existing) == (f"rlmm: machine fault: the file system is read-only ({disk / '.hydra'}); no step "
                                    f"was recorded in {disk}; run the same command again once it is fixed")
        missing = rlmm(disk / "new", *RUN)  # Hydra would make it: refused before Hydra starts
        assert missing.returncode == 4, missing.stdout[-2000:] + missing.stderr[-3000:]
        assert missing.stderr == (f"rlmm: machine fault: cannot make the run directory {disk / 'new'}: Read-only file "
                                  f"system; choose another hydra.run.dir\n")
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_an_immutable_run_directory_is_one_line(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if subprocess.run(["chattr", "+i", str(run_dir)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not supported here (needs root and an ext4/xfs/btrfs file system)")
    try:
        refused = rlmm(run_dir, *RUN)
        assert refused.returncode == 4, refused.stdout[-2000:] + refused.stderr[-3000:]
        assert ending(refused).startswith(f"rlmm: machine fault: not permitted (an immutable file or directory?) "
                                          f"({run_dir / '.hydra'}); "), refused.stderr
    finally:
        subprocess.run(["chattr", "-i", str(run_dir)], check=False)


def test_a_killed_sampler_process_is_one_line_naming_the_signal(tmp_path):
    """`train.overlap`: the sampler process SIGKILLed (the OOM killer's way) as the trainer asks for batch 3 (step
    2, after step 1's checkpoint): the trainer stops in one line, exit 4, the record intact (once a 30-line
    traceback of SamplerProcessError). Its resume: tests/test_crash_consistency.py (slow)."""
    run_dir = tmp_path / "run"
    killed = rlmm(run_dir, *RUN, "train.staleness=1", "train.overlap=true", fault=("kill", "sampler_process", 3))
    assert killed.returncode == 4, killed.stdout[-2000:] + killed.stderr[-3000:]
    assert ending(killed) == ("rlmm: machine fault: train.overlap: the sampler process was killed by SIGKILL before the "
                              f"trainer's request; {run_dir}/steps.jsonl holds steps 0-1; once it is fixed the same "
                              "command resumes from its checkpoint of step 1")
    assert "Traceback" not in killed.stderr, killed.stderr[-3000:]


@pytest.mark.slow  # torchrun, twice: a minute (docs/testing.md)
@pytest.mark.parametrize("fault,overrides,says", [
    (("kill", "weight_sync", 2), (), "rank 1 ("),  # rank 1 SIGKILLed mid-step: "rank 1 (<host>) failed or is gone"
    (("kill", "sampler_process", 3), ("train.staleness=1", "train.overlap=true"),  # rank 1's sampler process
     "train.overlap: the sampler process was killed by SIGKILL"),
])
def test_a_fault_on_one_of_two_ranks_is_one_line_and_the_same_command_resumes(tmp_path, fault, overrides, says):
    """Two ranks (torchrun), the fault on rank 1 only ($RLMM_FAULT_RANK): a rank's line says what failed, exit 4
    or the signal, never a hang; the record keeps its steps, and the same torchrun command finishes the run."""
    from pathlib import Path

    root = Path(__file__).parent.parent
    run_dir = tmp_path / "run"
    common = (*RUN, "train.prompts_per_step=2", *overrides, f"hydra.run.dir={run_dir}")

    def torchrun(program, **env):
        # --monitor-interval 5: torchrun's agent SIGTERMs the other ranks ~0.1 s after one dies, which under load
        # came before rank 0's collective failed and it could name the fault (1 of 4 runs, 2026-12-07)
        return subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--standalone", "--monitor-interval", "5",
                               "--nproc_per_node", "2",
                               *program, *common], capture_output=True, text=True, timeout=600, cwd=root,
                              env=subprocess_env(OMP_NUM_THREADS="1", PYTHONPATH=str(root), **env),
                              stdin=subprocess.DEVNULL)

    failed = torchrun(["tests/fault_at.py", *map(str, fault)], RLMM_FAULT_RANK="1")
    assert failed.returncode != 0
    output = failed.stdout + failed.stderr
    assert f"rlmm: machine fault: {says}" in output, output[-4000:]
    assert [row["step"] for row in read_steps(run_dir)][:2] == [0, 1]
    resumed = torchrun(["-m", "rlmm.cli"])
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    assert [row["step"] for row in read_steps(run_dir)] == [0, 1, 2, 3]


def fill(path) -> None:
    """Write zeros into `path` until the disk holding it is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError as err:
        assert err.errno == errno.ENOSPC, err
    finally:
        os.close(fd)


@pytest.mark.parametrize("fault,says", [("read-only", "the file system is read-only"), ("full", "the disk is full")])
def test_rlmm_table_on_a_read_only_or_full_disk_is_one_line(tmp_path, fault, says):
    """`rlmm table SWEEP` writes its tables and plots beside the sweep (SWEEP/table/): a read-only or full disk
    there was an OSError traceback (issue 50, case 9); now one line, exit 4, the run records as they were."""
    from tests.test_table import train_run

    disk = tmp_path / "disk"
    mount(disk, "size=4m")
    try:
        sweep = disk / "sweep"
        for job, correction in enumerate(("tis", "icepop")):
            train_run(sweep / str(job), "bf16", correction, 0)
        records = {p: p.read_bytes() for p in sweep.rglob("*") if p.is_file()}
        if fault == "read-only":
            subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        else:
            fill(disk / "filler")
        result = subprocess.run([sys.executable, "-m", "rlmm.cli", "table", str(sweep)], capture_output=True, text=True,
                                timeout=300, env=subprocess_env(), stdin=subprocess.DEVNULL)
        assert result.returncode == 4, (result.stdout[-2000:], result.stderr[-3000:])
        assert "Traceback" not in result.stderr, result.stderr[-3000:]
        line = ending(result)
        assert line.startswith(f"rlmm: machine fault: {says} ({sweep / 'table'}"), line
        assert line.endswith("); the run records are as they were (rlmm table only reads them): run it again once it "
                             "is fixed, or give --out another directory"), line
        assert {p: p.read_bytes() for p in records} == records
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
