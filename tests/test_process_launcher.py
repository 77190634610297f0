"""`hydra/launcher=process` (hydra_plugins/rlmm_launcher): the jobs of a `-m` sweep one after another, each
in a fresh process; and the warning for a sweep whose jobs would share one process on a GPU machine.

One real `rlmm probe -m` sweep of three short jobs on the small model (about 10 s a job on 2 cores): job
0's process is killed (SIGKILL, as the OOM killer or a crash in a CUDA kernel would end it), job 1
completes, job 2 fails inside rlmm. Checked: each job ran in a process of its own, none of them the sweep
command's, each starting after the last had ended; the job after a killed one still runs, and its record
is intact after a later job failed; the sweep command names both failures and exits 1.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

import rlmm.config.schema  # noqa: F401  (registers the schemas)
from rlmm.config.options import CONF_DIR
from rlmm.launch.launcher import BASIC_LAUNCHER, launcher_target, sweep_launcher_warning
from rlmm.tasks.arithmetic import ArithmeticTask
from tests.conftest import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
RLMM = Path(sys.executable).parent / "rlmm"
PROCESS_LAUNCHER = "hydra_plugins.rlmm_launcher.process_launcher.ProcessLauncher"
ARITHMETIC = "rlmm.tasks.arithmetic.ArithmeticTask"
KILLED = "tests.test_process_launcher.KilledTask"
FAILING = "tests.test_process_launcher.FailingTask"
# Short probe jobs: transformers sampler, plain torch trainer, fp32, 2 prompts x 2 samples, no W&B.
SHORT = ["sampler=hf", "trainer=torch", "precision=fp32", "logger=none", "probe.num_prompts=2",
         "probe.samples_per_prompt=2", "probe.trainer_micro_batch_sizes=[1,2]", "probe.batch_invariance.num_prompts=1",
         "probe.batch_invariance.num_completions=2", "probe.batch_invariance.max_batch_size=4"]
# Each line of a job's log (<job num>/apps.log) starts with its process id and time.
LOG_FORMAT = "hydra.job_logging.formatters.simple.format='%(process)d %(created)f %(message)s'"


class KilledTask(ArithmeticTask):
    """The arithmetic task, whose process is killed (SIGKILL) when the probe asks it for prompts."""

    def examples(self, split, n):
        os.kill(os.getpid(), signal.SIGKILL)


class FailingTask(ArithmeticTask):
    """The arithmetic task, which raises (a bug's error, not a user's) when the probe asks it for prompts."""

    def examples(self, split, n):
        raise ValueError("FailingTask has no examples")


# ---- the option composes, and the launcher builds from it -----------------------------------------

@pytest.mark.parametrize("app", ["train", "probe"])
def test_process_launcher_composes_and_builds(app):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        launcher = compose(app, ["hydra/launcher=process", "hydra.sweep.dir=/sweeps/a"], return_hydra_config=True)
    GlobalHydra.instance().clear()
    launcher = launcher.hydra.launcher
    assert launcher._target_ == PROCESS_LAUNCHER
    assert launcher.submitit_folder == "/sweeps/a/.submitit/%j"  # submitit's files inside the sweep dir
    built = instantiate(launcher)  # the constructor is the schema: every key of process.yaml is one of its arguments
    assert (built.timeout_min, built.gpus_per_node) == (240, None)


def job_sees(launcher, monkeypatch, visible: str | None) -> str | None:
    """CUDA_VISIBLE_DEVICES in a Python started as the launcher starts a job, from a shell with `visible`."""
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    # submitit's local controller runs the job as shlex.split(<python> -u -m ...), with CUDA_VISIBLE_DEVICES
    # set to its own choice: none, when gpus_per_node is not given to it
    command = shlex.split(launcher.job_python()) + ["-c", "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'))"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}).stdout.strip()
    return None if out == "None" else out


def test_job_sees_the_gpus_of_the_sweep_command(monkeypatch):
    from hydra_plugins.rlmm_launcher.process_launcher import ProcessLauncher

    def launcher(gpus_per_node):
        return ProcessLauncher(submitit_folder="/tmp/unused", timeout_min=1, gpus_per_node=gpus_per_node)

    assert job_sees(launcher(None), monkeypatch, None) is None  # all of the machine's
    assert job_sees(launcher(None), monkeypatch, "2,3") == "2,3"
    assert job_sees(launcher(1), monkeypatch, "2,3") == "2"  # the first of the shell's, not GPU 0
    assert job_sees(launcher(2), monkeypatch, None) == "0,1"
    assert job_sees(launcher(0), monkeypatch, "2,3") == ""


def test_bad_launcher_values_are_one_line_errors():
    from hydra_plugins.rlmm_launcher.process_launcher import ProcessLauncher

    with pytest.raises(ValueError, match=r"^hydra.launcher.timeout_min: must be > 0, got 0$"):
        ProcessLauncher(submitit_folder="/tmp/unused", timeout_min=0, gpus_per_node=None)
    with pytest.raises(ValueError, match=r"^hydra.launcher.gpus_per_node: must be null or >= 0, got -1$"):
        ProcessLauncher(submitit_folder="/tmp/unused", timeout_min=1, gpus_per_node=-1)


# ---- the warning for jobs that would share the rlmm process ---------------------------------------

def test_sweep_launcher_warning():
    warning = sweep_launcher_warning(BASIC_LAUNCHER, cuda=True, config_name="train")
    assert warning == ("rlmm: warning: the jobs of this sweep share one process (hydra/launcher=basic): GPU memory "
                       "of each vLLM engine is not freed between jobs; use hydra/launcher=process")
    assert sweep_launcher_warning(BASIC_LAUNCHER, cuda=True, config_name="probe") == warning
    assert sweep_launcher_warning(BASIC_LAUNCHER, cuda=False, config_name="train") is None  # CPU: nothing leaks
    for target in (PROCESS_LAUNCHER, "hydra_plugins.rlmm_launcher.slurm_launcher.SlurmLauncher"):
        assert sweep_launcher_warning(target, cuda=True, config_name="train") is None
    assert sweep_launcher_warning(BASIC_LAUNCHER, cuda=True, config_name="no_engines") is None


def test_launcher_target_of_a_command():
    assert launcher_target("train", ["seed=0,1"]) == BASIC_LAUNCHER
    assert launcher_target("train", ["hydra/launcher=process", "seed=0,1", "hydra.sweep.dir=/x"]) == PROCESS_LAUNCHER
    assert launcher_target("probe", ["experiment=fp16_vs_bf16"]) == BASIC_LAUNCHER
    assert launcher_target("probe", ["hydra/launcher=nope"]) is None  # Hydra reports it


# ---- a real sweep ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sweep(small_model_path, tmp_path_factory):
    """`rlmm probe -m hydra/launcher=process` of three jobs (killed, ok, failing), run to its end; returns
    the sweep dir, the sweep command's process id, its exit code and its output."""
    sweep_dir = tmp_path_factory.mktemp("process-sweep") / "sweep"
    command = [str(RLMM), "probe", "-m", "hydra/launcher=process", "model=hf", f"model.path={small_model_path}",
               f"task._target_={KILLED},{ARITHMETIC},{FAILING}", *SHORT, LOG_FORMAT,
               f"hydra.sweep.dir={sweep_dir}"]
    # PYTHONPATH: the jobs import this module's tasks
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               cwd=sweep_dir.parent, stdin=subprocess.DEVNULL, env=subprocess_env(PYTHONPATH=str(ROOT)))
    output, _ = process.communicate(timeout=600)
    return sweep_dir, process.pid, process.returncode, output


def job_log_lines(run_dir: Path) -> list[tuple[int, float, str]]:
    """(process id, time, message) of each line of the job's log that starts with them (LOG_FORMAT)."""
    lines = (run_dir / "apps.log").read_text().splitlines()
    return [(int(m[1]), float(m[2]), m[3]) for m in (re.match(r"(\d+) (\d+\.\d+) (.*)", line) for line in lines) if m]


def test_each_job_runs_in_a_fresh_process_after_the_last(sweep):
    sweep_dir, command_pid, _, _ = sweep
    logs = [job_log_lines(sweep_dir / str(num)) for num in range(3)]
    for num, lines in enumerate(logs):
        assert lines and lines[0][2].startswith("submitted job: "), (num, lines)  # apps.submitted_job() holds
        assert len({pid for pid, _, _ in lines}) == 1, lines
    pids = [lines[0][0] for lines in logs]
    assert len(set(pids)) == 3 and command_pid not in pids, (pids, command_pid)
    for num in range(2):  # job num's last line comes before job num + 1's first
        assert logs[num][-1][1] < logs[num + 1][0][1], (num, logs[num][-1], logs[num + 1][0])


def test_killed_and_failed_jobs_leave_the_others_intact(sweep):
    sweep_dir, _, returncode, output = sweep
    assert returncode == 1, output[-4000:]
    # the command names each failure as it happens, then Hydra stops on the first one
    killed = re.search(r"#0 failed: job 0 ended without a result \(killed, .*: its output is in (\S+)", output)
    assert killed and list(Path(killed[1]).glob("*_0_log.err")), output[-4000:]  # submitit's logs of the job
    assert "#2 failed: rlmm: error: ValueError: FailingTask has no examples" in output, output[-4000:]
    assert re.search(r"Error executing job with overrides: \[.*'task._target_=" + re.escape(KILLED), output)
    assert "JobEndedWithoutResult: job 0 ended without a result" in output, output[-4000:]
    record = json.loads((sweep_dir / "1" / "probe.json").read_text())
    assert record["sampler_vs_trainer"], record.keys()
    assert (sweep_dir / "1" / "probe.png").exists()
    for num in (0, 2):
        assert not (sweep_dir / str(num) / "probe.json").exists()
    assert "rlmm: error: ValueError: FailingTask has no examples" in (sweep_dir / "2" / "apps.log").read_text()
