"""The two-node SLURM cluster emulated on this machine (slurm/two_nodes.sh): two slurmd, each in a network and
UTS namespace of its own, run a real two-node job whose tasks reach each other over the namespaces' bridge.

The module fixture runs `two_nodes.sh start` (installs SLURM when missing and running as root, as cluster.sh
does) and leaves the cluster running. Where it cannot start (no root, no network namespaces), the tests skip,
except in CI (`CI` set), where it is expected and its absence fails them."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlmm.run.records import read_steps
from tests.test_reliability import comparable
from tests.test_slurm_cluster import DONE, slurm_cluster, start_or_skip  # noqa: F401  (a fixture)
from tests.test_sweeps import (LOGLESS, check_complete, check_table, digests, job_dirs, job_log, slurm_sweep_started,
                               steps_done, sweep, wait_for)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "slurm" / "two_nodes.sh"
CONF = "/etc/slurm/rlmm-two-nodes/slurm.conf"
NODES = ("rlmm-node1", "rlmm-node2")
HOSTS_TAG = "# rlmm slurm/two_nodes.sh"
LOST_RANK_LIMIT = 60  # s from a rank's SIGKILL to its job's end (issue 61)


def two_nodes(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, cwd=ROOT)


def on_two_nodes(*command: str, **kwargs) -> subprocess.CompletedProcess:
    """A SLURM command against the two-node cluster (its config, not the one-node cluster's)."""
    return subprocess.run(list(command), capture_output=True, text=True, env={**os.environ, "SLURM_CONF": CONF},
                          stdin=subprocess.DEVNULL, **kwargs)


@pytest.fixture(scope="module")
def two_node_cluster() -> None:
    start_or_skip(SCRIPT, limit=360)  # an install and a start, behind another test worker's start of the one-node cluster


def job_state(job_id: str) -> str | None:
    """JobState from the two-node cluster's scontrol, None once the controller has forgotten the job."""
    result = on_two_nodes("scontrol", "show", "job", "-o", job_id, timeout=30)
    match = re.search(r"\bJobState=(\S+)", result.stdout)
    return match.group(1) if match else None


def wait_for_job(job_id: str, limit: float) -> str | None:
    deadline = time.monotonic() + limit
    state = job_state(job_id)
    while state not in DONE and state is not None and time.monotonic() < deadline:
        time.sleep(0.5)
        state = job_state(job_id)
    return state


def test_unknown_command_is_one_line_error():
    result = two_nodes("strat")
    assert result.returncode == 2
    assert result.stderr.strip() == "two_nodes.sh: error: unknown command 'strat' (allowed: start, status, stop, --help)"


def test_status_reports_both_nodes_usable(two_node_cluster):
    result = two_nodes("status")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "two nodes: usable" in result.stdout
    for node in NODES:
        assert f"slurmd {node}: running" in result.stdout
        assert f"namespace {node}: present" in result.stdout


def test_start_again_is_quick(two_node_cluster):
    begin = time.monotonic()
    result = two_nodes("start")
    assert result.returncode == 0, result.stdout + result.stderr
    assert time.monotonic() - begin < 15


def test_each_task_of_a_two_node_job_runs_on_its_own_node(two_node_cluster, tmp_path):
    out = tmp_path / "out.txt"
    submit = on_two_nodes("sbatch", "--parsable", "-N2", "--ntasks-per-node=1", "-o", str(out), "--wrap",
                          "srun bash -c 'echo $SLURM_PROCID $(hostname) $(hostname -I)'", timeout=30, cwd=tmp_path)
    assert submit.returncode == 0, submit.stderr
    job_id = submit.stdout.strip().split(";")[0]
    state = wait_for_job(job_id, 120)
    assert state in ("COMPLETED", None), f"job {job_id} ended {state}: {out.read_text() if out.exists() else ''}"
    lines = sorted(" ".join(line.split()) for line in out.read_text().splitlines())
    # Each task sees its node's name and its node's address on the bridge, never the machine's own.
    assert lines == ["0 rlmm-node1 198.18.0.11", "1 rlmm-node2 198.18.0.12"], lines


def test_a_gloo_all_reduce_crosses_the_two_nodes(two_node_cluster, tmp_path):
    """What a two-node rlmm run needs of the network: rank 1 on the second node reaches rank 0's store at the
    first node's name (MASTER_ADDR from the node list), a collective between them gives the right sum, and the
    ranks' roster holds each node's name and address."""
    script = tmp_path / "reduce.py"
    script.write_text(
        "import os, socket, torch, torch.distributed as dist\n"
        "rank = int(os.environ['SLURM_PROCID'])\n"
        "dist.init_process_group('gloo', init_method='tcp://rlmm-node1:29531', rank=rank, world_size=2)\n"
        "x = torch.tensor([float(rank + 1)])\n"
        "dist.all_reduce(x)\n"
        "from rlmm.runtime.roster import ROSTER, take_roster\n"
        "take_roster()\n"
        "print(rank, socket.gethostname(), int(x.item()), ROSTER, flush=True)\n"
        "dist.destroy_process_group()\n")
    out = tmp_path / "out.txt"
    submit = on_two_nodes("sbatch", "--parsable", "-N2", "--ntasks-per-node=1", "-o", str(out), "--wrap",
                          f"srun {sys.executable} {script}", timeout=30, cwd=tmp_path)
    assert submit.returncode == 0, submit.stderr
    job_id = submit.stdout.strip().split(";")[0]
    state = wait_for_job(job_id, 180)
    text = out.read_text() if out.exists() else ""
    assert state in ("COMPLETED", None), f"job {job_id} ended {state}: {text[-2000:]}"
    results = sorted(line for line in text.splitlines() if line[:1].isdigit())
    # and each rank's roster (rlmm/runtime/roster.py): the addresses a peer's gloo error would name
    roster = "[('rlmm-node1', '198.18.0.11'), ('rlmm-node2', '198.18.0.12')]"
    assert results == [f"0 rlmm-node1 3 {roster}", f"1 rlmm-node2 3 {roster}"], text[-2000:]


def test_the_one_node_cluster_keeps_its_own_node(two_node_cluster):
    """The two clusters stay apart: the default SLURM_CONF (cluster.sh's) knows none of the emulated nodes."""
    if not Path("/etc/slurm/slurm.conf").exists():
        pytest.skip("no one-node cluster configured here")
    listed = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30,
                            env={k: v for k, v in os.environ.items() if k != "SLURM_CONF"})
    assert "rlmm-two-nodes" not in listed.stdout
    ours = on_two_nodes("scontrol", "show", "config", timeout=30)
    assert "ClusterName             = rlmm-two-nodes" in ours.stdout


# ---- rlmm on two nodes ----------------------------------------------------------------------------

def numbers(run_dir: Path) -> list[dict]:
    """Every logged number of a run but its wall-clock timings."""
    return comparable(read_steps(run_dir))


def files_of(run_dir: Path, under: str) -> list[str]:
    return sorted(str(p.relative_to(run_dir)) for p in (run_dir / under).rglob("*") if p.is_file())


TWO_NODE_CASES = [pytest.param(["trainer=deepspeed", "trainer.zero_stage=2", "sampler=vllm"], id="deepspeed-zero2-vllm"),
                  pytest.param(["trainer=deepspeed", "trainer.zero_stage=3", "sampler=hf"], id="deepspeed-zero3",
                               marks=pytest.mark.slow),
                  pytest.param(["trainer=fsdp", "sampler=hf"], id="fsdp", marks=pytest.mark.slow)]


@pytest.mark.parametrize("arm", TWO_NODE_CASES)
def test_a_two_node_run_equals_its_one_node_twin(two_node_cluster, slurm_cluster, small_model_path, tmp_path,  # noqa: F811
                                                  arm):
    """`hydra.launcher.nodes=2 tasks_per_node=1` on the emulated nodes against `tasks_per_node=2` on the one-node
    cluster: the same world of two gloo ranks, rank 1 on the other node (MASTER_ADDR its first node's name), its
    sampler engine started there. The same reductions in the same order, so every logged number is equal to the
    bit; the record, the checkpoints and the W&B run are written once, by rank 0, as on one node."""
    overrides = ["seed=0", *arm, "model=hf", f"model.path={small_model_path}", "logger=wandb",
                 "train.checkpoint_every=1"]
    one_node = sweep("slurm", tmp_path / "one-node", [*overrides, "hydra.launcher.tasks_per_node=2"])
    assert one_node.returncode == 0, (one_node.stdout + one_node.stderr)[-4000:]
    two = sweep("slurm", tmp_path / "two-nodes", [*overrides, "hydra.launcher.nodes=2",
                                                   "hydra.launcher.tasks_per_node=1"], SLURM_CONF=CONF)
    assert two.returncode == 0, (two.stdout + two.stderr)[-4000:]
    twin, run = job_dirs(tmp_path / "one-node")[0], job_dirs(tmp_path / "two-nodes")[0]
    for record in (twin, run):
        check_complete(record, {"trainer": arm[0].split("=")[1]})
        assert "rank 0 of 2" in job_log(record) and "rank 1 of 2" in job_log(record), job_log(record)[-3000:]
    submitit_logs = "".join(p.read_text() for p in (tmp_path / "two-nodes" / ".submitit").rglob("*_log.out"))
    for rank, node in enumerate(NODES):
        assert f"hostname={node}, local_rank=0(1), node={rank}(2), global_rank={rank}(2)" in submitit_logs
    assert numbers(run) == numbers(twin)
    assert files_of(run, "checkpoints") == files_of(twin, "checkpoints") != []
    assert len([p for p in (run / "wandb").iterdir() if p.name.startswith("offline-run-")]) == 1


@pytest.mark.slow  # two two-node runs and a relaunch: ~3 min under load (2026-12-07)
def test_a_sweep_of_two_node_jobs_becomes_one_table_and_a_relaunch_runs_only_the_unfinished(
        two_node_cluster, small_model_path, tmp_path):
    """`seed=0,1` as two-node jobs: both complete, `rlmm table` reads them as one sweep, and with job 1's record cut
    back as a kill would leave it, the same sweep command runs job 1 alone (job 0's files untouched)."""
    sweep_dir = tmp_path / "sweep"
    overrides = ["seed=0,1", "trainer=deepspeed", "sampler=hf", "model=hf", f"model.path={small_model_path}",
                 "hydra.launcher.nodes=2", "hydra.launcher.tasks_per_node=1"]
    first = sweep("slurm", sweep_dir, overrides, SLURM_CONF=CONF)
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    runs = job_dirs(sweep_dir)
    assert sorted(runs) == [0, 1]
    for num in (0, 1):
        check_complete(runs[num], {"seed": str(num)})
    check_table(sweep_dir, {"complete": 2})
    (runs[1] / "summary.json").unlink()
    (runs[1] / "steps.jsonl").write_text("".join((runs[1] / "steps.jsonl").read_text().splitlines(True)[:-1]))
    finished = digests(runs[0], LOGLESS)
    again = sweep("slurm", sweep_dir, overrides, SLURM_CONF=CONF)
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert "rlmm: 1 of 2 jobs of this sweep had finished already and did nothing (#0); 1 ran" in again.stdout
    check_complete(runs[1], {"seed": "1"})
    assert digests(runs[0], LOGLESS) == finished
    check_table(sweep_dir, {"complete": 2})


def fault_run_overrides(model_path: str, steps: int, checkpoint_every: int) -> list[str]:
    """A two-node DeepSpeed run of the fault tests (the transformers sampler: the fault, not the engine, is tested)."""
    return ["seed=0", "trainer=deepspeed", "sampler=hf", "model=hf", f"model.path={model_path}", f"train.steps={steps}",
            f"train.checkpoint_every={checkpoint_every}", "hydra.launcher.nodes=2", "hydra.launcher.tasks_per_node=1"]


def straight_run(tmp_path: Path, overrides: list[str]) -> Path:
    """The run never interrupted that a fault test's resumed run must equal: its run directory."""
    straight = sweep("slurm", tmp_path / "straight", overrides, SLURM_CONF=CONF)
    assert straight.returncode == 0, (straight.stdout + straight.stderr)[-4000:]
    return tmp_path / "straight" / "0"


def only_job(sweep_dir: Path) -> str:
    """The SLURM id of a one-job sweep (submitit submits a single job, not an array)."""
    return next(p.name for p in (sweep_dir / ".submitit").iterdir() if p.name[0].isdigit())


def job_processes_on(node: str) -> list[int]:
    """The pids of a submitit job's Python on one emulated node (its task: one rank), found in the node's network
    namespace; slurmd and slurmstepd left out."""
    listed = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True).stdout.split()
    pids = []
    for pid in listed:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # ended since
            continue
        if "submitit.core._submit" in command:
            pids.append(int(pid))
    return pids


@pytest.mark.slow  # three two-node runs: ~4 min under load (2026-12-07)
def test_a_rank_killed_on_its_node_ends_the_job_in_one_line_and_the_run_resumes(two_node_cluster, small_model_path,
                                                                                 tmp_path):
    """Rank 1's process SIGKILLed on rlmm-node2 after step 2 (the OOM killer's way, or a node's power gone as far
    as its sockets go): the job ends within LOST_RANK_LIMIT s, rank 0's line names the rank and its node, the
    sweep command reports the job failed in that line, and the same sweep command again resumes the run from its
    checkpoint to the records of a run never interrupted."""
    import signal

    overrides = fault_run_overrides(small_model_path, steps=4, checkpoint_every=1)
    straight = straight_run(tmp_path, overrides)

    sweep_dir = tmp_path / "killed"
    with slurm_sweep_started(sweep_dir, overrides, SLURM_CONF=CONF) as process:
        wait_for("step 2 of the run", lambda: steps_done(sweep_dir / "0") >= 2, process)
        victims = wait_for("rank 1's process on rlmm-node2", lambda: job_processes_on("rlmm-node2"), process)
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        job = only_job(sweep_dir)
        state = wait_for(f"job {job} ended", lambda: (s := job_state(job)) in DONE and s, None, LOST_RANK_LIMIT)
        ended = time.monotonic() - killed
        process.wait(timeout=300)
    output = Path(f"{sweep_dir}.out").read_text()
    print(f"job {job} ended {state} {ended:.1f} s after rank 1 was killed")
    assert process.returncode == 1, output[-4000:]
    line = re.search(r"#0 failed: rlmm: machine fault: rank 1 \(rlmm-node2\) failed or is gone \([^\n]*\n", output)
    assert line, output[-4000:]
    assert "UncompletedJobError" not in output
    assert not (sweep_dir / "0" / "summary.json").exists()

    again = sweep("slurm", sweep_dir, overrides, SLURM_CONF=CONF)
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert numbers(sweep_dir / "0") == numbers(straight)


@pytest.mark.slow  # two two-node runs and SLURM's requeue delay: ~6 min under load (2026-12-07)
def test_a_node_set_down_mid_job_requeues_it_and_the_run_resumes(two_node_cluster, small_model_path, tmp_path):
    """`scontrol update nodename=rlmm-node2 state=down` after step 2 (what SLURM does to a node that stops
    answering): SLURM requeues the job (submitit's jobs are requeueable), its ranks get SIGTERM and checkpoint at
    the end of their step, the requeued job resumes from that checkpoint once the node is back (ReturnToService=2:
    when its slurmd registers), and the sweep command ends 0 with the records of a run never interrupted."""
    overrides = fault_run_overrides(small_model_path, steps=5, checkpoint_every=1)
    straight = straight_run(tmp_path, overrides)

    sweep_dir = tmp_path / "down"
    try:
        with slurm_sweep_started(sweep_dir, overrides, SLURM_CONF=CONF) as process:
            wait_for("step 2 of the run", lambda: steps_done(sweep_dir / "0") >= 2, process)
            downed = on_two_nodes("scontrol", "update", "nodename=rlmm-node2", "state=down", "reason=rlmm-test",
                                  timeout=30)
            assert downed.returncode == 0, downed.stderr
            down_at = time.monotonic()
            stopped = wait_for("the ranks' stop at the end of their step",
                               lambda: re.search(r"stop signal 15 at step (\d+)", job_log(sweep_dir / "0")), process,
                               LOST_RANK_LIMIT)
            print(f"the ranks stopped {time.monotonic() - down_at:.1f} s after the node went down, at step "
                  f"{stopped.group(1)}")
            process.wait(timeout=600)
        output = Path(f"{sweep_dir}.out").read_text()
        assert process.returncode == 0, output[-4000:]
    finally:
        on_two_nodes("scontrol", "update", "nodename=rlmm-node2", "state=resume", timeout=30)
    job = only_job(sweep_dir)
    assert re.search(r"\bRestarts=1\b", on_two_nodes("scontrol", "show", "job", "-o", job, timeout=30).stdout)
    assert f"resuming from {sweep_dir / '0'}/checkpoints/step-{int(stopped.group(1)):06d}" in job_log(sweep_dir / "0")
    assert numbers(sweep_dir / "0") == numbers(straight)


@pytest.mark.slow  # two two-node runs: ~4 min under load (2026-12-07)
def test_a_preempted_two_node_job_is_requeued_and_resumes(two_node_cluster, small_model_path, tmp_path):
    """SIGUSR2 (SLURM's warning before pre-emption or the time limit, `scancel --signal=USR2`) reaches both ranks of
    a two-node job after step 2: they checkpoint at the end of their step, submitit's handler on rank 0 requeues the
    job (the same id, Restarts=1), the requeued job resumes on both nodes from the checkpoint, and the sweep command
    ends 0 with the records of a run never interrupted. SLURM holds a requeued job ~2 min; the test releases it."""
    overrides = fault_run_overrides(small_model_path, steps=6, checkpoint_every=0)
    straight = straight_run(tmp_path, overrides)

    sweep_dir = tmp_path / "preempted"
    with slurm_sweep_started(sweep_dir, overrides, SLURM_CONF=CONF) as process:
        wait_for("step 2 of the run", lambda: steps_done(sweep_dir / "0") >= 2, process)
        job = only_job(sweep_dir)
        signalled = on_two_nodes("scancel", "--signal=USR2", job, timeout=30)
        assert signalled.returncode == 0, signalled.stderr
        deadline = time.monotonic() + 300
        while process.poll() is None and time.monotonic() < deadline:  # release SLURM's hold on the requeued job
            shown = on_two_nodes("scontrol", "show", "job", "-o", job, timeout=30).stdout
            if "Restarts=1" in shown and "Reason=BeginTime" in shown:
                on_two_nodes("scontrol", "update", f"JobId={job}", "StartTime=now", timeout=30)
            time.sleep(1)
        process.wait(timeout=600)
        output = Path(f"{sweep_dir}.out").read_text()
        assert process.returncode == 0, output[-4000:]
    shown = on_two_nodes("scontrol", "show", "job", "-o", job, timeout=30).stdout
    assert re.search(r"\bRestarts=1\b", shown), shown
    log = job_log(sweep_dir / "0")
    stopped = int(re.search(r"stop signal 12 at step (\d+): checkpoint in", log).group(1))
    assert f"resuming from {sweep_dir / '0'}/checkpoints/step-{stopped:06d} at step {stopped + 1}" in log
    assert numbers(sweep_dir / "0") == numbers(straight)


def test_stop_removes_what_start_made_and_start_brings_it_back(two_node_cluster, tmp_path):
    """A job running at `stop` cannot outlive its nodes' network: it is cancelled, not left recorded as running."""
    submit = on_two_nodes("sbatch", "--parsable", "-N2", "-o", str(tmp_path / "out.txt"), "--wrap", "srun sleep 300",
                          timeout=30, cwd=tmp_path)
    assert submit.returncode == 0, submit.stderr
    job_id = submit.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 60
    while job_state(job_id) != "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.5)
    stopped = two_nodes("stop")
    assert stopped.returncode == 0, stopped.stderr
    try:
        assert two_nodes("status").returncode == 1
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not any(node in names for node in NODES), names
        assert subprocess.run(["ip", "link", "show", "rlmm-br0"], capture_output=True).returncode != 0
        assert HOSTS_TAG not in Path("/etc/hosts").read_text()
    finally:
        started = two_nodes("start", timeout=120)
    assert started.returncode == 0, started.stderr
    assert two_nodes("status").returncode == 0
    assert job_state(job_id) in ("CANCELLED", None)
    left = subprocess.run(["pgrep", "-f", "sleep 300"], capture_output=True, text=True).stdout.split()
    assert not [pid for pid in left if alive(pid)], "the job's processes outlived stop"


def alive(pid: str) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # not a zombie
    except (FileNotFoundError, ProcessLookupError):
        return False
