"""Sweeps through the launchers (`hydra/launcher=slurm|local`): real `rlmm train -m` multiruns whose jobs
are real training runs, submitted to the local SLURM cluster (slurm/cluster.sh) or run as local processes.

Most sweeps have 4 jobs of 2 steps on the small model (a few tens of seconds each on 2 cores; SLURM runs
two at a time, one CPU each); SLURM sweeps run with slurm/bin (sacct from scontrol) on PATH. Checked:
every job's run record lands in `<sweep dir>/<job num>/` with the requested config; jobs get the
submitting shell's environment except its process-group variables (a port the test holds open stands
in for a stale MASTER_PORT) and its thread count; a job that fails leaves the others complete and the
sweep command reports it once every job is done; a job killed from outside ends the sweep command in
bounded time (slurm/bin/sacct tells submitit), the others complete; a job sent SIGUSR2 mid-run
(pre-emption, time limit) is requeued by submitit and resumes from the checkpoint rlmm wrote, to the
numbers of an uninterrupted run.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

import rlmm.config.schema  # noqa: F401  (registers the schemas)
from rlmm.config.options import CONF_DIR
from tests.conftest import subprocess_env
from tests.test_slurm_cluster import slurm_cluster  # noqa: F401  (fixture: the local cluster; fails in CI)

ROOT = Path(__file__).resolve().parents[1]
RLMM = Path(sys.executable).parent / "rlmm"
SLURM_BIN = ROOT / "slurm" / "bin"  # sacct from scontrol, for a cluster without accounting (slurm/README.md)
STEPS = 2
# Short jobs: the fastest engines (vLLM joins in test (a)), 2 steps of 4 prompts, 8 eval prompts.
SHORT = ["trainer=torch", "precision=fp32", f"train.steps={STEPS}", "train.prompts_per_step=4",
         f"train.eval_every={STEPS}", "train.eval_prompts=8", "logger=none"]


def sweep_command(launcher: str, sweep_dir: Path, overrides: list[str]) -> list[str]:
    """`rlmm train -m hydra/launcher=... OVERRIDES` plus the SHORT settings OVERRIDES does not set."""
    keys = {o.split("=")[0] for o in overrides}
    short = [o for o in SHORT if o.split("=")[0] not in keys]
    return [str(RLMM), "train", "-m", f"hydra/launcher={launcher}", *overrides, *short, f"hydra.sweep.dir={sweep_dir}"]


def sweep_env(launcher: str, **env: str) -> dict[str, str]:
    """The test's environment; for SLURM, slurm/bin first on PATH: its sacct answers submitit's job-state
    queries from scontrol, as the local cluster has no accounting database (slurm/README.md)."""
    if launcher == "slurm":
        env["PATH"] = f"{SLURM_BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    return subprocess_env(**env)


def cancel_jobs(sweep_dir: Path, env: dict[str, str] | None = None) -> None:
    """Cancel any SLURM job of the sweep still queued or running (a failed or timed-out test leaves none), on the
    cluster the sweep went to (env's SLURM_CONF)."""
    arrays = {p.name.split("_")[0] for p in (sweep_dir / ".submitit").glob("[0-9]*")}
    if arrays:
        subprocess.run(["scancel", *sorted(arrays)], capture_output=True, timeout=30, env=env)


def sweep(launcher: str, sweep_dir: Path, overrides: list[str], **env: str) -> subprocess.CompletedProcess:
    """Run a sweep from sweep_dir's parent to its end; on the way out, cancel any SLURM job of it."""
    environment = sweep_env(launcher, **env)
    try:
        return subprocess.run(sweep_command(launcher, sweep_dir, overrides), capture_output=True, text=True,
                              timeout=840, cwd=sweep_dir.parent, stdin=subprocess.DEVNULL, env=environment)
    finally:
        if launcher == "slurm":
            cancel_jobs(sweep_dir, environment)


@contextmanager
def slurm_sweep_started(sweep_dir: Path, overrides: list[str], **env: str) -> Iterator[subprocess.Popen]:
    """A SLURM sweep running in the background (output in <sweep dir>.out); on the way out, the sweep
    command is stopped and its jobs cancelled."""
    environment = sweep_env("slurm", **env)
    with open(f"{sweep_dir}.out", "w") as out:
        process = subprocess.Popen(sweep_command("slurm", sweep_dir, overrides), stdout=out, stderr=subprocess.STDOUT,
                                   text=True, cwd=sweep_dir.parent, stdin=subprocess.DEVNULL, env=environment)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        cancel_jobs(sweep_dir, environment)


def wait_for(what: str, condition, process: subprocess.Popen | None, timeout: float = 600):
    """Poll `condition()` until it returns something true; fail if the sweep command (`process`; None: none to
    watch) ends first."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert process is None or process.poll() is None, \
            f"the sweep command ended (exit {process.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} after {timeout:.0f} s"
        time.sleep(0.5)
    return value


def array_task(sweep_dir: Path, num: int) -> str | None:
    """SLURM id (<array id>_<num>) of job `num` of the sweep, from submitit's folder of it."""
    folders = list((sweep_dir / ".submitit").glob(f"*_{num}"))
    return folders[0].name if folders else None


def steps_done(run_dir: Path) -> int:
    """The last training step in the run's record (0: none yet)."""
    from rlmm.run.records import read_steps

    return max((row["step"] for row in read_steps(run_dir)), default=0)


def scontrol_job(job_id: str) -> dict[str, str]:
    """`scontrol show job` of one job as a dict ({} once the controller forgot it, MinJobAge)."""
    result = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    return dict(re.findall(r"(\w+)=(\S*)", result.stdout))


def job_dirs(sweep_dir: Path) -> dict[int, Path]:
    return {int(p.name): p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()}


def check_complete(run_dir: Path, expected: dict[str, str], steps: int = STEPS) -> None:
    """A finished run's record: summary, one line per step (and the step-0 eval), the requested config."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps
    rows = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(steps + 1)), run_dir
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    for key, value in expected.items():
        node = config["choices"] if key in config["choices"] else config
        for part in key.split("."):
            node = node[part]
        assert str(node) == value, f"{run_dir}: {key}={node}, expected {value}"


def job_log(run_dir: Path) -> str:
    return "".join(p.read_text() for p in run_dir.glob("*.log"))


LOGLESS = (".rlmm-lock", "apps.log")  # a submitted job that finds its run finished: submitit logs that it completed


def digests(run_dir: Path, leaving_out: tuple[str, ...] = (".rlmm-lock",)) -> dict[str, str]:
    """Every file of a run directory and its SHA-256 (the lock file aside: it names the last process that held it)."""
    import hashlib

    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name not in leaving_out}


@pytest.fixture
def held_port():
    """A port that is in use for the whole test: a job that inherited it as MASTER_PORT would fail to bind."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield str(s.getsockname()[1])


def check_table(sweep_dir: Path, statuses: dict[str, int]) -> str:
    """`rlmm table` reads the sweep: exit 0, one run per job, with these statuses; returns its output."""
    from rlmm.table import load_runs

    result = subprocess.run([str(RLMM), "table", str(sweep_dir), "--out", str(sweep_dir / "table")],
                            capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                            env=subprocess_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert load_runs([str(sweep_dir)])["status"].value_counts().to_dict() == statuses
    return result.stdout


# ---- the launcher options compose, and the CLI names them -----------------------------------------

def compose_launcher(overrides: list[str]):
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose("train", overrides=overrides, return_hydra_config=True).hydra
    finally:
        GlobalHydra.instance().clear()


@pytest.mark.parametrize("launcher,target", [("local", "hydra_submitit_launcher.submitit_launcher.LocalLauncher"),
                                             ("slurm", "rlmm_launcher.slurm_launcher.SlurmLauncher")])
def test_launcher_composes_with_submitit_folder_in_the_sweep_dir(launcher, target):
    hydra_cfg = compose_launcher([f"hydra/launcher={launcher}", "hydra.sweep.dir=/sweeps/a"])
    assert hydra_cfg.launcher._target_ == f"hydra_plugins.{target}"
    assert hydra_cfg.launcher.submitit_folder == "/sweeps/a/.submitit/%j"
    if launcher == "slurm":
        assert hydra_cfg.launcher.partition == "rlmm"  # the local cluster's (slurm/cluster.sh)


def test_site_example_composes(tmp_path):
    """slurm/site.example.yaml, copied as a launcher option, extends slurm.yaml."""
    (tmp_path / "hydra" / "launcher").mkdir(parents=True)
    shutil.copy(ROOT / "slurm" / "site.example.yaml", tmp_path / "hydra" / "launcher" / "mysite.yaml")
    launcher = compose_launcher(["hydra/launcher=mysite", f"hydra.searchpath=[file://{tmp_path}]",
                                 "hydra.sweep.dir=/sweeps/a"]).launcher
    assert launcher._target_.endswith(".SlurmLauncher")
    assert (launcher.partition, launcher.account, launcher.gpus_per_node) == ("gpu", "my-project", 1)
    assert launcher.setup == ["module load cuda/12.4"]
    assert launcher.submitit_folder == "/sweeps/a/.submitit/%j"  # from slurm.yaml


def test_unknown_launcher_is_one_line_error():
    result = subprocess.run([str(RLMM), "train", "-m", "hydra/launcher=slrum", "seed=0,1"], capture_output=True,
                            text=True, timeout=120, stdin=subprocess.DEVNULL, env=subprocess_env())
    assert result.returncode == 2
    assert result.stderr.strip() == ("rlmm: error: unknown hydra/launcher 'slrum' "
                                     "(allowed: basic, local, process, slurm, submitit_local, submitit_slurm)")


# ---- real sweeps ----------------------------------------------------------------------------------

def test_slurm_sweep_runs_every_job(slurm_cluster, small_model_path, tmp_path, held_port):  # noqa: F811
    sweep_dir = tmp_path / "sweep"
    result = sweep("slurm", sweep_dir, ["sampler=hf,vllm", "correction=none,tis", "model=hf",
                                        f"model.path={small_model_path}"],
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=held_port, OMP_NUM_THREADS="7")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    runs = job_dirs(sweep_dir)
    assert sorted(runs) == [0, 1, 2, 3]
    requested = [(s, c) for s in ("hf", "vllm") for c in ("none", "tis")]  # Hydra's job order
    for num, (sampler, correction) in enumerate(requested):
        check_complete(runs[num], {"sampler": sampler, "correction": correction, "model.path": small_model_path})
        # the job's threads follow its SLURM CPUs (cpus_per_task: 1), not the submitting shell's 7
        assert "submitted job: OMP_NUM_THREADS=1 " in job_log(runs[num])
    assert list((sweep_dir / ".submitit").glob("*_0/*_0_log.out"))  # submitit's files inside the sweep dir
    check_table(sweep_dir, {"complete": 4})
    # Job 3 as if killed before its last row: the same command again runs it alone, and says so
    (runs[3] / "summary.json").unlink()
    (runs[3] / "steps.jsonl").write_text("".join((runs[3] / "steps.jsonl").read_text().splitlines(True)[:-1]))
    finished = {num: digests(runs[num], LOGLESS) for num in (0, 1, 2)}  # submitit logs "Job completed" in apps.log
    again = sweep("slurm", sweep_dir, ["sampler=hf,vllm", "correction=none,tis", "model=hf",
                                       f"model.path={small_model_path}"], OMP_NUM_THREADS="7")
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert "rlmm: 3 of 4 jobs of this sweep had finished already and did nothing (#0, #1, #2); 1 ran" in again.stdout
    check_complete(runs[3], {"sampler": "vllm", "correction": "tis"})
    assert {num: digests(runs[num], LOGLESS) for num in (0, 1, 2)} == finished


def test_local_sweep_runs_every_job(small_model_path, tmp_path, held_port):
    sweep_dir = tmp_path / "sweep"
    result = sweep("local", sweep_dir, ["correction=none,tis", "seed=0,1", "sampler=hf", "model=hf",
                                        f"model.path={small_model_path}"],
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=held_port, OMP_NUM_THREADS="1")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    runs = job_dirs(sweep_dir)
    assert sorted(runs) == [0, 1, 2, 3]
    for num, (correction, seed) in enumerate([(c, s) for c in ("none", "tis") for s in ("0", "1")]):
        check_complete(runs[num], {"correction": correction, "seed": seed})
        # local jobs run at once on this machine: they keep the thread count the shell gave them
        assert "submitted job: OMP_NUM_THREADS=1 " in job_log(runs[num])
    check_table(sweep_dir, {"complete": 4})


def test_the_sweeper_counts_the_jobs_that_had_finished_already():
    from hydra.core.utils import JobReturn, JobStatus
    from omegaconf import OmegaConf

    from hydra_plugins.rlmm_launcher.sweeper import skipped_line
    from rlmm.run.resume import FINISHED_JOB

    def job(num: int, value, status=JobStatus.COMPLETED) -> JobReturn:
        result = JobReturn(status=status, hydra_cfg=OmegaConf.create({"hydra": {"job": {"num": num}}}))
        result.return_value = value
        return result

    assert skipped_line([job(0, None), job(1, None)]) is None
    assert skipped_line([job(0, FINISHED_JOB), job(1, None), job(2, FINISHED_JOB), job(3, ValueError("x"),
                                                                                      JobStatus.FAILED)]) == (
        "rlmm: 2 of 4 jobs of this sweep had finished already and did nothing (#0, #2); 2 ran")


def test_a_sweep_launched_again_runs_only_its_unfinished_jobs_and_says_how_many_it_skipped(tmp_path):
    """The issue's case: `rlmm train -m ... correction=none,tis` killed in job 1 (SIGKILL of the sweep command: the
    basic launcher runs every job in it), then the same command again. Job 0 had finished: it does nothing, and
    the sweep goes on to job 1, which resumes to a complete record (before: job 0's "nothing to do" exited the
    whole sweep with 0 and job 1 never ran). Then once more with `hydra/launcher=process`, each job in a process
    of its own: both had finished; nothing in either run directory changes."""
    sweep_dir = tmp_path / "sweep"
    overrides = ["train", "-m", "debug=train", "sampler=hf", "trainer=torch", "precision=fp32", "correction=none,tis",
                 "seed=0", f"hydra.sweep.dir={sweep_dir}"]

    def run(*program: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *program, *overrides], capture_output=True, text=True, timeout=600,
                              cwd=ROOT, stdin=subprocess.DEVNULL, env=subprocess_env())

    # job 0 logs steps 0-2, job 1 step 0: the 5th row is job 1's step 1
    killed = run("tests/fault_at.py", "kill", "record_written", "5")
    assert killed.returncode == -9, (killed.stdout + killed.stderr)[-3000:]
    assert (sweep_dir / "0" / "summary.json").exists() and not (sweep_dir / "1" / "summary.json").exists()
    finished = digests(sweep_dir / "0")
    again = run("-m", "rlmm.cli")
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert f"rlmm: {sweep_dir / '0'} holds this run, finished (summary.json): nothing to do" in again.stdout
    assert "rlmm: 1 of 2 jobs of this sweep had finished already and did nothing (#0); 1 ran" in again.stdout
    assert digests(sweep_dir / "0") == finished
    check_complete(sweep_dir / "1", {"correction": "tis"})
    both = {num: digests(sweep_dir / str(num)) for num in (0, 1)}
    overrides.insert(2, "hydra/launcher=process")
    once_more = run("-m", "rlmm.cli")
    assert once_more.returncode == 0, (once_more.stdout + once_more.stderr)[-3000:]
    assert "rlmm: 2 of 2 jobs of this sweep had finished already and did nothing (#0, #1); 0 ran" in once_more.stdout
    # the record as it was; submitit logged "Job completed successfully" into each job's log (apps.log) after it
    assert {num: digests(sweep_dir / str(num), LOGLESS) for num in (0, 1)} == {
        num: {k: v for k, v in files.items() if k != "apps.log"} for num, files in both.items()}


@pytest.mark.slow  # 32 s each on the AVX2 EPYC; by default the one-node twin of test_slurm_two_nodes.py runs such a
# job (DeepSpeed, vLLM; its slow cases FSDP and ZeRO 3) and checks the same, and more
@pytest.mark.parametrize("trainer", ["deepspeed", "fsdp"])
def test_slurm_job_of_two_tasks_trains_as_two_ranks(slurm_cluster, small_model_path, tmp_path, trainer):  # noqa: F811
    """tasks_per_node=2: one job, two SLURM tasks, one DeepSpeed or FSDP world of two gloo ranks (each rank
    samples half the prompts); rank 0 writes the record."""
    sweep_dir = tmp_path / "sweep"
    result = sweep("slurm", sweep_dir, ["seed=0", f"trainer={trainer}", "sampler=hf", "model=hf",
                                        f"model.path={small_model_path}", "hydra.launcher.tasks_per_node=2"])
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    runs = job_dirs(sweep_dir)
    assert sorted(runs) == [0]
    check_complete(runs[0], {"trainer": trainer})
    log_text = job_log(runs[0])
    assert "rank 0 of 2" in log_text and "rank 1 of 2" in log_text, log_text[-3000:]
    check_table(sweep_dir, {"complete": 1})


def test_slurm_sweep_with_a_failing_and_a_killed_job(slurm_cluster, small_model_path, tmp_path):  # noqa: F811
    """One sweep, model.path x train.steps: jobs 2 and 3 ask for a hub model that cannot be fetched (offline) and
    fail at run time, after the sweep was submitted; job 1 (many steps) is cancelled from outside (`scancel`, as
    an admin, a time limit or the OOM killer would) once it has recorded a step. A killed job writes no result,
    so only SLURM can tell that it ended: through slurm/bin/sacct submitit sees it CANCELLED, the sweep command
    says so in one line, waits for the other jobs and exits non-zero in bounded time (without sacct: forever). Job 0 completes with an intact record, each
    failed job's log and submitit result say why, and `rlmm table` counts each and names the killed run."""
    import pickle

    long_steps = 200  # never reached: the job is cancelled after step 1
    sweep_dir = tmp_path / "sweep"
    overrides = ["sampler=hf", "model=hf", f"model.path={small_model_path},nobody/no-such-model",
                 f"train.steps={STEPS},{long_steps}"]
    with slurm_sweep_started(sweep_dir, overrides, HF_HUB_OFFLINE="1") as process:
        job = wait_for("job 1 submitted", lambda: array_task(sweep_dir, 1), process)
        wait_for("step 1 of job 1", lambda: steps_done(sweep_dir / "1") >= 1, process)
        subprocess.run(["scancel", job], check=True, timeout=30)
        killed = time.monotonic()
        # submitit polls job states at intervals that double up to 10 min; a poll sees CANCELLED, then
        # it waits 15 s for a result file that never comes
        process.wait(timeout=300)
        waited = time.monotonic() - killed
    output = Path(f"{sweep_dir}.out").read_text()
    assert process.returncode == 1, output[-4000:]
    # the killed job is one failed job, in one line, and the command goes on to the others' results
    # (hydra_plugins/rlmm_launcher/slurm_launcher.py; before: submitit's 40-line UncompletedJobError, and the end)
    assert re.search(rf"#1 failed: job 1 \(SLURM {job}\) ended CANCELLED without a result: its output is in "
                     rf"\S+\n", output), output[-4000:]
    for num in (2, 3):
        assert f"#{num} failed: rlmm: error: model.path: cannot fetch hub model 'nobody/no-such-model'" in output
    assert re.search(r"JobEndedWithoutResult: job 1 \(SLURM", output) and "UncompletedJobError" not in output
    print(f"sweep command returned {waited:.0f} s after the scancel")
    assert scontrol_job(job)["JobState"] == "CANCELLED"
    runs = job_dirs(sweep_dir)
    assert sorted(runs) == [0, 1, 2, 3]
    check_complete(runs[0], {"model.path": small_model_path})
    assert not (runs[1] / "summary.json").exists()
    stopped = steps_done(runs[1])
    assert 1 <= stopped < long_steps
    # SLURM's SIGTERM reached rlmm: it checkpointed at the step boundary before the job ended
    assert f"stop signal 15 at step {stopped}: checkpoint in" in job_log(runs[1])
    for num in (2, 3):
        # the sweep command gives up at job 1's CANCELLED state: on a loaded machine a failing job may still be
        # starting then, so wait (bounded) for the result submitit writes when the job ends
        task = array_task(sweep_dir, num)
        result_file = sweep_dir / ".submitit" / task / f"{task}_0_result.pkl"
        wait_for(f"job {num}'s result", result_file.exists, None, timeout=300)
        assert not (runs[num] / "summary.json").exists() and not (runs[num] / "steps.jsonl").exists()
        assert "rlmm: error: model.path: cannot fetch hub model" in job_log(runs[num])  # the job's own log says why
        with open(result_file, "rb") as result:
            outcome, job_return = pickle.load(result)  # Hydra's JobReturn: the sweep raises its error as JobFailed
        assert outcome == "success" and job_return.status.name == "FAILED"  # the job ran; the task in it failed
        assert "rlmm: error: model.path: cannot fetch hub model 'nobody/no-such-model'" in str(job_return._return_value)
    table = check_table(sweep_dir, {"complete": 1, "incomplete": 1, "failed": 2})
    assert re.search(rf"Not complete: \S*1 \(incomplete: stopped after step {stopped}\)", table), table


@pytest.mark.slow  # 210 s on 2 cores, mostly SLURM's requeue delay; the resume itself: test_reliability.py
def test_slurm_preempted_job_is_requeued_and_resumes(slurm_cluster, small_model_path, tmp_path):  # noqa: F811
    """SIGUSR2, which SLURM sends a submitit job `signal_delay_s` before its time limit or pre-emption,
    reaches job 0 of a 2-job sweep mid-run; the only checkpoint is the one the signal makes
    (train.checkpoint_every=0). rlmm checkpoints at the step boundary and hands over to submitit's
    handler, which requeues the job (same SLURM id, Restarts=1); the requeued job resumes from the
    checkpoint and finishes. Its record holds every step once, and its numbers equal those of job 1, the
    same run (fp32, one thread each) never interrupted. SLURM holds a requeued batch job about 2 min
    before it may start again; the test lets it start at once."""
    steps = 40  # the signal needs a moment to arrive: at 10 steps the one-pass step outran it to the end
    links = []
    for i in range(2):  # two names for the small model: the jobs' configs differ only in the path
        links.append(tmp_path / f"model{i}")
        links[-1].symlink_to(small_model_path, target_is_directory=True)
    sweep_dir = tmp_path / "sweep"
    overrides = ["sampler=hf", "model=hf", f"model.path={links[0]},{links[1]}", f"train.steps={steps}",
                 f"train.eval_every={steps // 2}", "train.checkpoint_every=0"]
    with slurm_sweep_started(sweep_dir, overrides) as process:
        job = wait_for("job 0 submitted", lambda: array_task(sweep_dir, 0), process)
        wait_for("step 2 of job 0", lambda: steps_done(sweep_dir / "0") >= 2, process)
        subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=30)
        requeued = wait_for("job 0 requeued", lambda: (info := scontrol_job(job)).get("Restarts", "0") != "0" and info,
                            process, timeout=120)
        # SLURM holds a requeued batch job for about 2 min (Reason=BeginTime), counted from when its first
        # run has ended: release it, again if the hold comes back, until it runs
        deadline = time.monotonic() + 300
        while process.poll() is None and time.monotonic() < deadline:
            info = scontrol_job(job)
            if info.get("JobState") != "PENDING":
                break
            if info.get("Reason") == "BeginTime":
                subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True, timeout=30)
            time.sleep(1)
        process.wait(timeout=600)
        output = Path(f"{sweep_dir}.out").read_text()
        assert process.returncode == 0, output[-4000:]
        # the result is written a moment before the job's process ends (and before leaving this block
        # cancels what still runs)
        deadline = time.monotonic() + 60
        while (info := scontrol_job(job))["JobState"] in ("RUNNING", "COMPLETING") and time.monotonic() < deadline:
            time.sleep(0.5)
    assert (info["JobState"], info["Restarts"], info["JobId"]) == ("COMPLETED", "1", requeued["JobId"])
    assert sorted(p.name for p in (sweep_dir / ".submitit").glob("[0-9]*_*")) == [job, array_task(sweep_dir, 1)]

    runs = job_dirs(sweep_dir)
    check_complete(runs[0], {"model.path": str(links[0])}, steps=steps)
    check_complete(runs[1], {"model.path": str(links[1])}, steps=steps)
    stopped = json.loads((runs[0] / "checkpoints" / (runs[0] / "checkpoints" / "latest").read_text().strip()
                          / "state.json").read_text())["step"]
    assert 2 <= stopped < steps, stopped
    log = job_log(runs[0])  # apps.log: both runs of the job, one after the other
    assert f"stop signal 12 at step {stopped}: checkpoint in" in log
    assert f"resuming from {runs[0] / 'checkpoints'}/step-{stopped:06d} at step {stopped + 1}" in log
    submitit_log = (sweep_dir / ".submitit" / job / f"{job}_0_log.out").read_text()  # the job's stdout
    assert "this job is preempted" in submitit_log and f"Requeued job {job}" in submitit_log
    assert submitit_log.count("Starting with JobEnvironment") == 2  # SLURM appends the second run's output
    assert json.loads((runs[0] / "summary.json").read_text())["resumed_at_step"] == stopped + 1

    from rlmm.run.records import read_steps

    def comparable(rows):  # every logged number but wall-clock timings
        return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in rows]

    assert comparable(read_steps(runs[0])) == comparable(read_steps(runs[1]))
