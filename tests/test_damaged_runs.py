"""A run directory damaged as users and machines damage them, then the same command again (issue 50): a torn
or repeated middle row of steps.jsonl, a checkpoint file with flipped bytes or cut short, `checkpoints/latest`
naming a checkpoint that is gone, a finished run that lost its last row. Each is named and resumed from the
newest whole checkpoint its record covers, to the records of the run never damaged, or refused in one line with
every file as it was. The rules themselves are tested on built directories in tests/test_run_dir.py; here
`rlmm train` runs them: the issue's command `rlmm train debug=train train.steps=4 train.checkpoint_every=1 seed=0`
with the fastest engines (transformers sampler, torch trainer, fp32), seconds a run.
"""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlmm.run.records import read_steps
from tests.conftest import ending, subprocess_env

STEPS = 4
RUN = ("train", "debug=train", "sampler=hf", "trainer=torch", "precision=fp32", f"train.steps={STEPS}",
       "train.checkpoint_every=1", "seed=0")


def rlmm(run_dir: Path, *overrides: str, fault=None) -> subprocess.CompletedProcess:
    program = ["tests/fault_at.py", *map(str, fault)] if fault else ["-m", "rlmm.cli"]
    return subprocess.run([sys.executable, *program, *RUN, *overrides, f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, timeout=600, env=subprocess_env(), stdin=subprocess.DEVNULL)


def comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in rows]


def digests(run_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != ".rlmm-lock"}


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The run never interrupted: its records are what every repaired run must end with."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    done = rlmm(run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> Path:
    """The run SIGKILLed once its row of step 4 was written, before its checkpoint: rows 0-4, checkpoints of steps 2
    and 3 (the newest two are kept)."""
    run_dir = tmp_path_factory.mktemp("killed") / "run"
    done = rlmm(run_dir, fault=("kill", "record_written", 5))
    assert done.returncode == -9, done.stderr[-3000:]
    assert [row["step"] for row in read_steps(run_dir)] == [0, 1, 2, 3, 4]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == ["step-000002", "step-000003"]
    return run_dir


def copy(run_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run_dir, tmp_path / "run"))


def tear_line(run_dir: Path, number: int) -> None:
    lines = (run_dir / "steps.jsonl").read_text().splitlines(keepends=True)
    lines[number - 1] = lines[number - 1][:len(lines[number - 1]) // 2] + "\n"
    (run_dir / "steps.jsonl").write_text("".join(lines))


def assert_resumes_to_the_straight_records(run_dir: Path, straight: Path, says: str) -> None:
    resumed = rlmm(run_dir)
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-3000:]
    assert says in output, output[-3000:]
    assert comparable(read_steps(run_dir)) == comparable(read_steps(straight))
    assert len((run_dir / "steps.jsonl").read_text().splitlines()) == STEPS + 1  # no torn or repeated line left
    assert (run_dir / "summary.json").exists()


def assert_refused_with_every_file_as_it_was(run_dir: Path, says: str) -> None:
    before = digests(run_dir)
    refused = rlmm(run_dir)
    assert refused.returncode == 2, (refused.stdout + refused.stderr)[-3000:]
    assert ending(refused).startswith(f"rlmm: error: {says}"), refused.stderr[-3000:]
    assert digests(run_dir) == before


def test_a_torn_middle_row_is_redone_from_the_checkpoint_before_it_or_refused(killed, straight, tmp_path):
    """The issue's case 3: line 2 of a killed run's steps.jsonl torn, then resumed: it exited 0 "resuming at step 4"
    with a record of steps 0 and 4 only, and no warning."""
    run_dir = copy(killed, tmp_path)
    tear_line(run_dir, 4)  # step 3's row: the checkpoint of step 2 covers it
    assert_resumes_to_the_straight_records(
        run_dir, straight, f"line 4 of {run_dir / 'steps.jsonl'} (after step 2) is torn or not JSON: resuming from "
                           f"{run_dir / 'checkpoints' / 'step-000002'}, which redoes the steps after it")
    other = tmp_path / "other"
    shutil.copytree(killed, other)
    tear_line(other, 2)  # step 1's row: both checkpoints are past it
    assert_refused_with_every_file_as_it_was(
        other, f"train.resume: line 2 of {other / 'steps.jsonl'} (after step 0) is torn or not JSON, and every "
               f"checkpoint is past it (the oldest: step-000002)")


def flip_bytes(path: Path, count: int = 4000) -> None:
    """`count` bytes in the middle of the file inverted (a disk or a copy that went wrong)."""
    data = bytearray(path.read_bytes())
    start = max(0, len(data) // 2 - count // 2)
    data[start:start + count] = bytes(b ^ 0xFF for b in data[start:start + count])
    path.write_bytes(bytes(data))


def test_a_damaged_checkpoint_is_named_and_the_one_before_it_resumed_or_the_resume_refused(killed, straight, tmp_path):
    """The issue's case 4: 4000 flipped bytes in model.safetensors of the newest checkpoint resumed without a word,
    exited 0 and ended at accuracy 0.0 instead of 0.5 (41 values differed); a truncated rank0.pt or a garbage
    state.json ended in tracebacks that named no file. Every file of a checkpoint now has its SHA-256 in its
    SHA256SUMS, checked before the resume."""
    run_dir = copy(killed, tmp_path)
    newest, older = run_dir / "checkpoints" / "step-000003", run_dir / "checkpoints" / "step-000002"
    assert {line.split()[1] for line in (newest / "SHA256SUMS").read_text().splitlines()} == {
        "model.safetensors", "rank0.pt", "state.json"}
    flip_bytes(newest / "model.safetensors")
    assert_resumes_to_the_straight_records(
        run_dir, straight, f"checkpoint {newest} is damaged (model.safetensors does not match its SHA-256 in "
                           f"SHA256SUMS): resuming from the one before it, {older}")
    other = tmp_path / "other"
    shutil.copytree(killed, other)
    newest, older = other / "checkpoints" / "step-000003", other / "checkpoints" / "step-000002"
    (newest / "state.json").write_text("{\"step\": 3, garbage")
    (older / "rank0.pt").write_bytes((older / "rank0.pt").read_bytes()[:1000])
    assert_refused_with_every_file_as_it_was(
        other, f"train.resume: no whole checkpoint in {other / 'checkpoints'}: {newest} is damaged (state.json does "
               f"not match its SHA-256 in SHA256SUMS); {older} is damaged (rank0.pt does not match its SHA-256 in "
               f"SHA256SUMS): restore them, or remove {other / 'checkpoints'} to redo the run from step 0, or give "
               f"this run another hydra.run.dir")


def test_latest_naming_a_checkpoint_that_is_gone_resumes_from_the_newest_one_there(killed, straight, tmp_path):
    """The issue's case 5: the newest checkpoint removed (by hand, to free space or because it was bad), `latest`
    still naming it: the run restarted from step 0 without a word and replaced the older checkpoint still there."""
    run_dir = copy(killed, tmp_path)
    shutil.rmtree(run_dir / "checkpoints" / "step-000003")
    older = run_dir / "checkpoints" / "step-000002"
    assert_resumes_to_the_straight_records(
        run_dir, straight, f"{run_dir / 'checkpoints' / 'latest'} names step-000003, which is not there: resuming "
                           f"from the newest checkpoint there, {older}")
    assert "resuming from " + str(older) + " at step 3" in (run_dir / "apps.log").read_text()


def test_a_finished_run_that_lost_its_last_row_is_redone_from_its_checkpoint_before_it(straight, tmp_path):
    """The issue's case 6: summary.json and the last row of a finished run deleted, then resumed: KeyError: 4 at
    every try, for ever (the resume started after the lost row, and the summary looked for it)."""
    run_dir = copy(straight, tmp_path)
    (run_dir / "summary.json").unlink()
    lines = (run_dir / "steps.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "steps.jsonl").write_text("".join(lines[:-1]))
    assert_resumes_to_the_straight_records(
        run_dir, straight, f"{run_dir / 'steps.jsonl'} ends at step 3, before checkpoint "
                           f"{run_dir / 'checkpoints' / 'step-000004'}: resuming from "
                           f"{run_dir / 'checkpoints' / 'step-000003'}, which redoes the steps after it")


def test_a_run_whose_directory_is_removed_while_it_runs_stops_in_one_line(tmp_path):
    """The issue's case 6, second half: the run directory removed mid-run (rm -r by a user or a cleanup job). The
    run went on writing into the removed record and ended in KeyError: 4; it now stops at its next row, exit 4."""
    run_dir = tmp_path / "run"
    removed = rlmm(run_dir, fault=("remove_run_dir", "record_written", 2))
    assert removed.returncode == 4, (removed.stdout + removed.stderr)[-3000:]
    assert ending(removed) == (f"rlmm: machine fault: {run_dir / 'steps.jsonl'} was removed while the run wrote it "
                               f"(its run directory removed or replaced?); no step was recorded in {run_dir}; run the "
                               f"same command again once it is fixed"), removed.stderr[-3000:]
    assert "Traceback" not in removed.stderr


def test_the_summary_of_a_record_missing_a_step_the_run_logged_names_it(tmp_path):
    from types import SimpleNamespace

    from rlmm.run.train_report import TrainingHistory, summarize
    from rlmm.runtime.errors import MachineFault

    (tmp_path / "steps.jsonl").write_text("".join(f'{{"step": {s}, "eval/accuracy": 0.5}}\n' for s in range(4)))
    with pytest.raises(MachineFault, match=rf"^{tmp_path / 'steps.jsonl'} holds steps 0-3, not every step to 4 this "
                                           rf"run logged \(its run directory removed or changed while it ran\?\)$"):
        summarize(TrainingHistory.read(tmp_path), {}, {}, SimpleNamespace(steps=4), 1, 1.0, 1)


def test_ctrl_c_checkpoints_and_exits_130_then_the_same_command_resumes(straight, tmp_path):
    """The issue's case 8: Ctrl-C (SIGINT) gave a 63-line traceback and no checkpoint, where SIGTERM checkpoints.
    Here it lands after step 1's row (no checkpoint every step: the one it makes is the only one)."""
    run_dir = tmp_path / "run"
    interrupted = rlmm(run_dir, "train.checkpoint_every=0", fault=("sigint", "record_written", 2))
    output = interrupted.stdout + interrupted.stderr
    assert interrupted.returncode == 130, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    assert f"stop signal 2 at step 1: checkpoint in {run_dir / 'checkpoints' / 'step-000001'}" in output, output
    assert_resumes_to_the_straight_records(run_dir, straight, f"resuming from {run_dir / 'checkpoints' / 'step-000001'}")
