"""Sweeps through the launchers (`hydra/launcher=slurm|local`): real `rlmm train -m` multiruns whose jobs
are real training runs, submitted to the local SLURM cluster (slurm/cluster.sh) or run as local processes.

Each sweep has 4 jobs of 2 steps on the small model (a few tens of seconds each on 2 cores; SLURM runs
two at a time, one CPU each). Checked: every job's run record lands in `<sweep dir>/<job num>/` with
the requested config; jobs get the submitting shell's environment except its process-group variables
(a port the test holds open stands in for a stale MASTER_PORT) and its thread count; a job that fails
leaves the others complete and the sweep command reports it once every job is done.
"""
from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

import rlmm.schema  # noqa: F401  (registers the schemas)
from rlmm.config import CONF_DIR
from tests.conftest import subprocess_env
from tests.test_slurm_cluster import slurm_cluster  # noqa: F401  (fixture: the local cluster; fails in CI)

ROOT = Path(__file__).resolve().parents[1]
RLMM = Path(sys.executable).parent / "rlmm"
STEPS = 2
# Short jobs: the fastest engines (vLLM joins in test (a)), 2 steps of 4 prompts, 8 eval prompts.
SHORT = ["trainer=torch", "precision=fp32", f"train.steps={STEPS}", "train.prompts_per_step=4",
         f"train.eval_every={STEPS}", "train.eval_prompts=8", "logger=none"]


def sweep(launcher: str, sweep_dir: Path, overrides: list[str], **env: str) -> subprocess.CompletedProcess:
    """`rlmm train -m hydra/launcher=... OVERRIDES` from sweep_dir's parent; on the way out, cancel any
    SLURM job of it still queued (a failed or timed-out test leaves none behind)."""
    command = [str(RLMM), "train", "-m", f"hydra/launcher={launcher}", *overrides, *SHORT,
               f"hydra.sweep.dir={sweep_dir}"]
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=840, cwd=sweep_dir.parent,
                              stdin=subprocess.DEVNULL, env=subprocess_env(**env))
    finally:
        if launcher == "slurm":
            arrays = {p.name.split("_")[0] for p in (sweep_dir / ".submitit").glob("*_*")}
            if arrays:
                subprocess.run(["scancel", *sorted(arrays)], capture_output=True, timeout=30)


def job_dirs(sweep_dir: Path) -> dict[int, Path]:
    return {int(p.name): p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()}


def check_complete(run_dir: Path, expected: dict[str, str]) -> None:
    """A finished run's record: summary, one line per step (and the step-0 eval), the requested config."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(STEPS + 1)), run_dir
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    for key, value in expected.items():
        node = config["choices"] if key in config["choices"] else config
        for part in key.split("."):
            node = node[part]
        assert str(node) == value, f"{run_dir}: {key}={node}, expected {value}"


def job_log(run_dir: Path) -> str:
    return "".join(p.read_text() for p in run_dir.glob("*.log"))


@pytest.fixture
def held_port():
    """A port that is in use for the whole test: a job that inherited it as MASTER_PORT would fail to bind."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield str(s.getsockname()[1])


def check_table(sweep_dir: Path, statuses: dict[str, int]) -> None:
    """`rlmm table` reads the sweep: exit 0, one run per job, with these statuses."""
    from rlmm.table import load_runs

    result = subprocess.run([str(RLMM), "table", str(sweep_dir), "--out", str(sweep_dir / "table")],
                            capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                            env=subprocess_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert load_runs([str(sweep_dir)])["status"].value_counts().to_dict() == statuses


# ---- the launcher options compose, and the CLI names them -----------------------------------------

def compose_launcher(overrides: list[str]):
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose("train", overrides=overrides, return_hydra_config=True).hydra
    finally:
        GlobalHydra.instance().clear()


@pytest.mark.parametrize("launcher,target", [("local", "LocalLauncher"), ("slurm", "SlurmLauncher")])
def test_launcher_composes_with_submitit_folder_in_the_sweep_dir(launcher, target):
    hydra_cfg = compose_launcher([f"hydra/launcher={launcher}", "hydra.sweep.dir=/sweeps/a"])
    assert hydra_cfg.launcher._target_ == f"hydra_plugins.hydra_submitit_launcher.submitit_launcher.{target}"
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
                                     "(allowed: basic, local, slurm, submitit_local, submitit_slurm)")


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


def test_slurm_sweep_with_a_failing_job(slurm_cluster, small_model_path, tmp_path):  # noqa: F811
    """Job 1 asks for a hub model that cannot be fetched (offline): it fails at run time, after the
    sweep was submitted; jobs 0, 2, 3 (three links to the small model) complete with intact records,
    and the sweep command exits non-zero with job 1's error once they are all done."""
    links = []
    for i in range(3):
        links.append(tmp_path / f"model{i}")
        links[-1].symlink_to(small_model_path, target_is_directory=True)
    paths = [str(links[0]), "nobody/no-such-model", str(links[1]), str(links[2])]
    sweep_dir = tmp_path / "sweep"
    result = sweep("slurm", sweep_dir, ["sampler=hf", "model=hf", f"model.path={','.join(paths)}"],
                   HF_HUB_OFFLINE="1")
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-4000:]
    assert re.search(r"JobFailed: rlmm: error: model.path: cannot fetch hub model 'nobody/no-such-model'", output)
    runs = job_dirs(sweep_dir)
    assert sorted(runs) == [0, 1, 2, 3]
    for num in (0, 2, 3):
        check_complete(runs[num], {"model.path": paths[num]})
    assert not (runs[1] / "summary.json").exists() and not (runs[1] / "steps.jsonl").exists()
    assert "rlmm: error: model.path: cannot fetch hub model" in job_log(runs[1])  # the job's own log says why
    check_table(sweep_dir, {"complete": 3, "failed": 1})
