"""What a run may do in a run directory that already holds a record (rlmm/run/resume.py): a resume it refuses, a run
already finished, a fresh run or a probe where a run is, each leaves every file there byte for byte as it was;
the run's own settings resume it. The rules on built directories first (milliseconds), then through `rlmm`."""
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import yaml

from rlmm.run.records import read_steps
from rlmm.run.resume import AlreadyFinished, ResumeRefused, check_probe_dir, check_train_dir
from tests.conftest import ending, subprocess_env
from tests.test_reliability import SIGNAL_AFTER_STEP_ZERO

CONFIG = {"choices": {"sampler": "hf", "logger": "none"}, "seed": 0,
          "train": {"staleness": 1, "resume": True, "checkpoint_every": 20, "overlap": False, "lr": 1e-3},
          "logger": {"_target_": "rlmm.run.logging.NoOpLogger"}, "algo": {"group_size": 4, "clip": [0.2, 0.28]}}


def record(run_dir, config=CONFIG, steps=2, finished=False, checkpoint_world=None):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    (run_dir / "steps.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(steps + 1)))
    if finished:
        (run_dir / "summary.json").write_text("{}")
    if checkpoint_world:
        (run_dir / "checkpoints" / "step-000001").mkdir(parents=True)
        (run_dir / "checkpoints" / "step-000001" / "state.json").write_text(json.dumps({"step": 1, "world_size":
                                                                                          checkpoint_world}))
        (run_dir / "checkpoints" / "latest").write_text("step-000001")
    return run_dir


def changed(**values) -> dict:
    """CONFIG with dotted keys set."""
    config = json.loads(json.dumps(CONFIG))
    for key, value in values.items():
        *parents, leaf = key.split("__")
        node = config
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return config


def test_an_empty_or_traceless_directory_starts_a_run(tmp_path):
    check_train_dir(tmp_path / "new", CONFIG, world=1, resume=True)
    traces = tmp_path / "engines_failed"  # a run that ended before step 0: its config, its log, no row
    traces.mkdir()
    (traces / "config.yaml").write_text("seed: 5\n")
    (traces / "steps.jsonl").write_text("")
    check_train_dir(traces, CONFIG, world=1, resume=False)


def test_the_runs_own_settings_resume_it_and_what_only_watches_or_saves_may_differ(tmp_path):
    run_dir = record(tmp_path / "run", checkpoint_world=1)
    check_train_dir(run_dir, CONFIG, world=1, resume=True)
    check_train_dir(run_dir, changed(train__checkpoint_every=5, train__overlap=True, logger__project="x",
                                     choices__logger="wandb"), world=1, resume=True)
    # through YAML as config.yaml is: a tuple is the list it was written as, 1e-3 the float
    check_train_dir(run_dir, changed(algo__clip=(0.2, 0.28)), world=1, resume=True)


def test_a_run_written_before_the_modules_moved_resumes_and_another_class_does_not(tmp_path):
    """Issue 51 moved rlmm's top-level modules into packages: config.yaml of an older run names the same classes by
    their old paths (rlmm.logging.NoOpLogger), which is no difference; a class that is another one still is."""
    run_dir = record(tmp_path / "run", config=changed(logger___target_="rlmm.logging.NoOpLogger"), checkpoint_world=1)
    check_train_dir(run_dir, CONFIG, world=1, resume=True)
    run_dir = record(tmp_path / "other", config=changed(algo___target_="rlmm.precision.PrecisionPolicy"),
                     checkpoint_world=1)
    with pytest.raises(ResumeRefused, match=r"algo._target_=rlmm.precision.PrecisionPolicy there, \(not set\) here"):
        check_train_dir(run_dir, CONFIG, world=1, resume=True)


def test_a_run_written_before_an_option_gained_a_key_resumes_at_its_yaml_value_and_not_another(tmp_path):
    """sampler=vllm gained `kv_scales` and `kv_calibration_prompts` (issue 52): a run written before computed what
    their YAML values compute (unit scales), so they are no difference there; another value still is."""
    from omegaconf import OmegaConf

    from rlmm.config.options import option_node

    vllm = OmegaConf.to_container(option_node("sampler", "vllm"))
    before = {key: value for key, value in vllm.items() if key not in ("kv_scales", "kv_calibration_prompts")}
    run_dir = record(tmp_path / "run", config=changed(choices__sampler="vllm", sampler=before), checkpoint_world=1)
    check_train_dir(run_dir, changed(choices__sampler="vllm", sampler=vllm), world=1, resume=True)
    with pytest.raises(ResumeRefused, match=r"sampler.kv_scales=\(not set\) there, calibrated here"):
        check_train_dir(run_dir, changed(choices__sampler="vllm", sampler={**vllm, "kv_scales": "calibrated"}),
                        world=1, resume=True)


OBJECTIVES = {  # algo.objective as config.yaml held it before issue 51 made it a node, and as it holds it now
    "clip": ({"objective": "clip", "clip_low": 0.2, "clip_high": 0.28, "dual_clip": None},
             {"_target_": "rlmm.algos.surrogate.ClippedSurrogate", "clip_low": 0.2, "clip_high": 0.28,
              "dual_clip": None}),
    "cispo": ({"objective": "cispo", "clip_low": 1.0, "clip_high": 4.0, "dual_clip": None},
              {"_target_": "rlmm.algos.surrogate.CISPO", "clip_low": 1.0, "clip_high": 4.0}),
}


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_a_run_written_before_the_objective_was_a_node_resumes_and_another_objective_does_not(tmp_path, objective):
    """config.yaml of an older run holds `algo.objective: clip` (or cispo) and the clip range beside it, the loss this
    version writes as a node (resume.MOVED_OBJECTIVES); another clip range is still a difference, named as it is now."""
    before, now = OBJECTIVES[objective]
    run_dir = record(tmp_path / "run", config={**CONFIG, "algo": {**CONFIG["algo"], **before}}, checkpoint_world=1)
    check_train_dir(run_dir, changed(algo__objective=now), world=1, resume=True)
    with pytest.raises(ResumeRefused, match=r"\(algo.objective.clip_high=[0-9.]+ there, 0.5 here\)"):
        check_train_dir(run_dir, changed(algo__objective={**now, "clip_high": 0.5}), world=1, resume=True)


def test_a_run_written_before_quantization_was_a_group_resumes_with_its_mode_and_not_another(tmp_path):
    """Issue 51 made `sampler.quantization: X` the config group `quantization=X`: config.yaml of an older run holds
    the key, which is no difference to the same mode chosen by the group; another mode still is."""
    from omegaconf import OmegaConf

    from rlmm.config.options import option_node

    def now(option: str) -> dict:  # this run's config with `quantization=option`
        return changed(choices__quantization=option, sampler__kv_cache_dtype="auto",
                       quantization=OmegaConf.to_container(option_node("quantization", option)))

    for option in ("none", "int8"):
        before = changed(sampler__quantization=option, sampler__kv_cache_dtype="auto")
        run_dir = record(tmp_path / option, config=before, checkpoint_world=1)
        check_train_dir(run_dir, now(option), world=1, resume=True)
    with pytest.raises(ResumeRefused, match=r"choices.quantization=int8 there, fp8 here; "
                                            r"quantization._target_=rlmm.policy.quantization.Int8W8A8 there, "
                                            r"rlmm.policy.quantization.Fp8Blockwise here\)"):
        check_train_dir(tmp_path / "int8", now("fp8"), world=1, resume=True)
    unknown = record(tmp_path / "int4", config=changed(sampler__quantization="int4"), checkpoint_world=1)
    with pytest.raises(ResumeRefused, match=r"choices.quantization=int4 there, none here"):
        check_train_dir(unknown, now("none"), world=1, resume=True)


@pytest.mark.parametrize("values,named", [
    ({"train__staleness": 2}, "train.staleness=1 there, 2 here"),
    ({"choices__sampler": "vllm"}, "choices.sampler=hf there, vllm here"),
    ({"algo__clip": [0.2, 0.2]}, "algo.clip=[0.2, 0.28] there, [0.2, 0.2] here"),
    ({"train__decompose_staleness": True}, "train.decompose_staleness=(not set) there, True here"),
    ({"seed": None}, "seed=0 there, null here"),
])
def test_other_settings_are_refused_naming_the_key_and_both_values(tmp_path, values, named):
    run_dir = record(tmp_path / "run", checkpoint_world=1)
    with pytest.raises(ResumeRefused, match=r"^train.resume: .* holds a run with other settings \(" + re.escape(named)
                       + r"\): resume it with its own settings, or give this run another hydra.run.dir$"):
        check_train_dir(run_dir, changed(**values), world=1, resume=True)


def test_many_differences_name_three_and_count_the_rest(tmp_path):
    run_dir = record(tmp_path / "run")
    config = changed(seed=1, train__staleness=2, train__lr=1.0, algo__group_size=8, algo__clip=[0, 0])
    with pytest.raises(ResumeRefused, match=r"\(algo.clip=.*; algo.group_size=4 there, 8 here; seed=0 there, 1 here "
                                            r"\(and 2 more\)\)"):
        check_train_dir(run_dir, config, world=1, resume=True)


def test_a_finished_run_is_nothing_to_do_and_other_ranks_or_resume_false_or_no_config_are_refused(tmp_path):
    with pytest.raises(AlreadyFinished, match=r"holds this run, finished \(summary.json\): nothing to do$"):
        check_train_dir(record(tmp_path / "done", finished=True), CONFIG, world=1, resume=True)
    with pytest.raises(ResumeRefused, match=r"written by 2 ranks, this run has 1 \(resume with the same number of "
                                            r"ranks, or give this run another hydra.run.dir\)$"):
        check_train_dir(record(tmp_path / "two", checkpoint_world=2), CONFIG, world=1, resume=True)
    with pytest.raises(ResumeRefused, match=r"^train.resume=false: .* holds a run's record \(steps.jsonl\)"):
        check_train_dir(record(tmp_path / "kept"), CONFIG, world=1, resume=False)
    no_config = record(tmp_path / "no_config")
    (no_config / "config.yaml").unlink()
    with pytest.raises(ResumeRefused, match="but no config.yaml"):
        check_train_dir(no_config, CONFIG, world=1, resume=True)


def test_a_run_directory_whose_config_yaml_does_not_read_is_refused_in_one_line(tmp_path):
    """Issue 50, case 9: a corrupt config.yaml in the run directory ended in a YAML traceback."""
    for name, content in (("garbage", b"seed: [0\n  train: {"), ("binary", b"\xff\xfe\x00seed"), ("list", b"- 1\n")):
        run_dir = record(tmp_path / name)
        (run_dir / "config.yaml").write_bytes(content)
        with pytest.raises(ResumeRefused, match=rf"^train.resume: .*{name}/config.yaml is not readable YAML \(.+\), so "
                                                rf"whether this is that run cannot be told: restore it, or give this run "
                                                rf"another hydra.run.dir$"):
            check_train_dir(run_dir, CONFIG, world=1, resume=True)


def test_a_probe_and_a_training_run_never_share_a_directory(tmp_path):
    with pytest.raises(ResumeRefused, match=r"holds a training run's record \(steps.jsonl\): give the probe another"):
        check_probe_dir(record(tmp_path / "run"), CONFIG)
    probed = tmp_path / "probed"
    probed.mkdir()
    (probed / "probe.json").write_text(json.dumps({"choices": CONFIG["choices"],
                                                   "config": {k: v for k, v in CONFIG.items() if k != "choices"}}))
    with pytest.raises(ResumeRefused, match=r"holds a probe's record \(probe.json\): give the training run another"):
        check_train_dir(probed, CONFIG, world=1, resume=True)
    check_probe_dir(probed, CONFIG)  # the same probe again: measured again
    with pytest.raises(ResumeRefused, match=r"holds a probe with other settings \(seed=0 there, 3 here\)"):
        check_probe_dir(probed, changed(seed=3))


def with_checkpoints(run_dir, *steps, latest=None, world=1):
    """Checkpoints of these steps in run_dir (a state.json each), `latest` naming the newest (or `latest`)."""
    for step in steps:
        path = run_dir / "checkpoints" / f"step-{step:06d}"
        path.mkdir(parents=True)
        (path / "state.json").write_text(json.dumps({"step": step, "world_size": world}))
    (run_dir / "checkpoints" / "latest").write_text(f"step-{latest if latest is not None else max(steps):06d}")
    return run_dir


def rows_with(run_dir, lines: list[str]):
    (run_dir / "steps.jsonl").write_text("".join(line + "\n" for line in lines))


def test_a_damaged_middle_row_resumes_from_the_checkpoint_before_it_or_is_refused(tmp_path):
    """steps.jsonl holds steps 0-4 and checkpoints of steps 1, 3 and 4 are there. A middle row torn or written twice
    is named; the resume starts from the newest checkpoint before it, which redoes it (and drops nothing whole
    before it); where every checkpoint is past it, the resume is refused. Before: the rows after a torn line were
    dropped without a word and the run resumed from step 4, leaving steps 1-3 out of its record."""
    from rlmm.run.resume import resume_point

    whole = [json.dumps({"step": s}) for s in range(5)]
    run_dir = with_checkpoints(record(tmp_path / "run", steps=4), 1, 3, 4)
    assert resume_point(run_dir).checkpoint.name == "step-000004" and resume_point(run_dir).warnings == ()
    rows_with(run_dir, [*whole[:3], whole[3][:7], whole[4]])  # step 3's row torn
    point = resume_point(run_dir)
    assert point.checkpoint.name == "step-000001" and point.state["step"] == 1
    assert point.warnings == (f"line 4 of {run_dir / 'steps.jsonl'} (after step 2) is torn or not JSON: resuming from "
                              f"{run_dir / 'checkpoints' / 'step-000001'}, which redoes the steps after it",)
    rows_with(run_dir, [*whole[:3], whole[2], *whole[3:]])  # step 2's row twice
    point = resume_point(run_dir)
    assert point.checkpoint.name == "step-000001"
    assert point.warnings[0].startswith(f"line 4 of {run_dir / 'steps.jsonl'} (after step 2) repeats step 2: ")
    shutil.rmtree(run_dir / "checkpoints" / "step-000004")  # a kill while writing row 4 comes before its checkpoint
    (run_dir / "checkpoints" / "latest").write_text("step-000003")
    rows_with(run_dir, [*whole[:4], whole[4][:9]])  # the last line torn, as a kill mid-write leaves it: no damage
    point = resume_point(run_dir)
    assert point.checkpoint.name == "step-000003" and point.warnings == ()
    rows_with(run_dir, [whole[0], whole[1][:5], *whole[2:]])  # step 1's row torn: every checkpoint is past it
    with pytest.raises(ResumeRefused, match=r"^train.resume: line 2 of .*steps.jsonl \(after step 0\) is torn or not "
                                            r"JSON, and every checkpoint is past it \(the oldest: step-000001\): "
                                            r"restore the line, or remove .*checkpoints to redo the run from step 0, "
                                            r"or give this run another hydra.run.dir$"):
        check_train_dir(run_dir, CONFIG, world=1, resume=True)
    assert resume_point(with_checkpoints(record(tmp_path / "none"), 1)).checkpoint.name == "step-000001"


def test_latest_naming_a_checkpoint_that_is_gone_falls_back_to_the_newest_one_there_or_is_refused(tmp_path):
    from rlmm.run.resume import resume_point

    run_dir = with_checkpoints(record(tmp_path / "run", steps=4), 1, 3, latest=4)
    point = resume_point(run_dir)
    assert point.checkpoint.name == "step-000003"
    assert point.warnings == (f"{run_dir / 'checkpoints' / 'latest'} names step-000004, which is not there: resuming "
                              f"from the newest checkpoint there, {run_dir / 'checkpoints' / 'step-000003'}",)
    gone = record(tmp_path / "gone", steps=4)
    (gone / "checkpoints").mkdir()
    (gone / "checkpoints" / "latest").write_text("step-000004")
    with pytest.raises(ResumeRefused, match=r"^train.resume: .*latest names step-000004, which is not there, and no "
                                            r"other checkpoint is: restore it, or remove .*checkpoints to redo the run "
                                            r"from step 0, or give this run another hydra.run.dir$"):
        check_train_dir(gone, CONFIG, world=1, resume=True)


def test_a_record_that_lost_its_last_rows_resumes_from_a_checkpoint_it_covers_or_is_refused(tmp_path):
    from rlmm.run.resume import resume_point

    run_dir = with_checkpoints(record(tmp_path / "run", steps=3), 3, 4)  # row 4 lost; the summary too
    point = resume_point(run_dir)
    assert point.checkpoint.name == "step-000003"
    assert point.warnings == (f"{run_dir / 'steps.jsonl'} ends at step 3, before checkpoint "
                              f"{run_dir / 'checkpoints' / 'step-000004'}: resuming from "
                              f"{run_dir / 'checkpoints' / 'step-000003'}, which redoes the steps after it",)
    (run_dir / "steps.jsonl").unlink()  # the record lost: a run resumed from step 3 would hold steps 4 on only
    with pytest.raises(ResumeRefused, match=r"^train.resume: .*steps.jsonl holds no step, before every checkpoint "
                                            r"\(the oldest: step-000003\): restore its rows, or remove .*checkpoints "
                                            r"to redo the run from step 0, or give this run another hydra.run.dir$"):
        check_train_dir(run_dir, CONFIG, world=1, resume=True)


def test_a_checkpoint_prunes_only_older_ones_and_those_past_it(tmp_path):
    """The newest `keep` at or before the step just written stay; checkpoints past it (left from before a resume went
    back to an older one) go. Before: the newest `keep` by name stayed, so a checkpoint written after going back
    past two newer ones removed itself."""
    from rlmm.run.checkpoint import prune

    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        (root / f"step-{step:06d}").mkdir(parents=True)
    prune(root, step=2, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step-000001", "step-000002"]
    (root / "step-000003").mkdir()
    prune(root, step=3, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step-000002", "step-000003"]


HOLD_THE_LOCK = """
import sys, time
from rlmm.run.run_lock import holding
with holding(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_run_directory_is_one_process_at_a_time_and_a_killed_holder_leaves_no_lock(tmp_path):
    from rlmm.run.run_lock import RunDirInUse, holding

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_LOCK, str(run_dir)], stdout=subprocess.PIPE, text=True,
                              env=subprocess_env())
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(RunDirInUse, match=rf"^hydra.run.dir: {re.escape(str(run_dir))} is in use by another rlmm "
                                              rf"run \(host \S+, pid {holder.pid}, since [0-9-]+ [0-9:]+\): let it end, "
                                              rf"or give this run another hydra.run.dir$"):
            with holding(run_dir):
                pass
    finally:
        holder.kill()  # SIGKILL: no handler runs, the kernel drops the lock with the process
        holder.wait()
    with holding(run_dir):  # no stale lock
        assert f"pid={os.getpid()} " in (run_dir / ".rlmm-lock").read_text()
        with pytest.raises(RunDirInUse):  # a second holder in this very process too (a sweep in one process)
            with holding(run_dir):
                pass


# Through `rlmm`: the built-in model, the transformers sampler and the torch trainer (seconds a run).
RUN = ("train", "debug=train", "sampler=hf", "trainer=torch", "precision=fp32", "train.steps=3", "train.staleness=1")


def rlmm(run_dir, *overrides, stop_after_step_zero=False):
    program = ["-c", SIGNAL_AFTER_STEP_ZERO] if stop_after_step_zero else ["-m", "rlmm.cli"]
    return subprocess.run([sys.executable, *program, *overrides, f"hydra.run.dir={run_dir}"], capture_output=True,
                          text=True, timeout=600, env=subprocess_env(), stdin=subprocess.DEVNULL)


def digests(run_dir) -> dict[str, str]:
    """Every file of the run directory, but the lock file (rlmm/run/run_lock.py: it names whoever started last)."""
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != ".rlmm-lock"}


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A staleness-1 run stopped by SIGTERM after step 0, with its checkpoint of step 1 and a batch in flight: the
    issue's case (its refused resume cut steps.jsonl, deleted the summary and rewrote config.yaml)."""
    run_dir = tmp_path_factory.mktemp("stopped") / "run"
    stopped = rlmm(run_dir, *RUN, stop_after_step_zero=True)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert (run_dir / "checkpoints" / "latest").exists() and not (run_dir / "summary.json").exists()
    return run_dir


@pytest.mark.parametrize("other", [
    ("train", "train.staleness=2"),
    ("train", "train.decompose_staleness=true"),
    ("train", "correction=none"),
    ("train", "train.resume=false"),
    ("probe",),
])
def test_a_refused_start_leaves_every_file_of_a_stopped_run_as_it_was(stopped_run, tmp_path, other):
    run_dir = tmp_path / "run"
    shutil.copytree(stopped_run, run_dir)
    before = digests(run_dir)
    app, *values = other
    overrides = (*RUN, *values) if app == "train" else ("probe", "debug=probe", "sampler=hf", "trainer=torch")
    refused = rlmm(run_dir, *overrides)
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert ending(refused).startswith("rlmm: error: ") and str(run_dir) in ending(refused), refused.stderr[-2000:]
    assert digests(run_dir) == before


def test_a_double_start_runs_once_and_refuses_the_other_naming_it(tmp_path):
    """The issue's case: the same command twice at once into an empty directory (a double submit). Before: both
    ran, both crashed (FileExistsError on a checkpoint, KeyError: 4), rows were lost and no resume could read the
    record again. Now one runs to a whole record, the other is refused in one line that names the first."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "rlmm.cli", *RUN, "train.staleness=0", "train.checkpoint_every=1",
               f"hydra.run.dir={run_dir}"]
    both = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
                             stdin=subprocess.DEVNULL) for _ in range(2)]
    outputs = [p.communicate(timeout=600) for p in both]
    ends = sorted((p.returncode, p.pid, out, err) for p, (out, err) in zip(both, outputs))
    assert [code for code, *_ in ends] == [0, 2], [(code, out[-2000:], err[-2000:]) for code, _, out, err in ends]
    (_, ran_pid, _, _), (_, _, out, err) = ends
    refused = ending(subprocess.CompletedProcess([], 2, out, err))
    assert re.fullmatch(rf"rlmm: error: hydra.run.dir: {re.escape(str(run_dir))} is in use by another rlmm run \(host "
                        rf"\S+, pid {ran_pid}, since [0-9-]+ [0-9:]+\): let it end, or give this run another "
                        rf"hydra.run.dir", refused), refused
    assert [row["step"] for row in read_steps(run_dir)] == [0, 1, 2, 3]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3


def test_the_runs_own_settings_resume_it_then_a_finished_run_is_left_alone(stopped_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(stopped_run, run_dir)
    resumed = rlmm(run_dir, *RUN)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [row["step"] for row in read_steps(run_dir)] == [0, 1, 2, 3]
    assert "train.staleness=1" in (run_dir / ".hydra" / "overrides.yaml").read_text()
    before = digests(run_dir)
    again = rlmm(run_dir, *RUN)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout == f"rlmm: {run_dir} holds this run, finished (summary.json): nothing to do\n"
    assert digests(run_dir) == before


def test_a_checkpoints_files_are_checked_against_its_sha256sums(tmp_path):
    from rlmm.runtime.checksums import damage, write_sums

    path = tmp_path / "step-000004"
    (path / "shards").mkdir(parents=True)
    for name, content in (("model.safetensors", b"weights" * 100), ("rank0.pt", b"state"), ("shards/.metadata", b"m"),
                          ("state.json", b'{"step": 4}')):
        (path / name).write_bytes(content)
    write_sums(path)
    assert [line.split("  ")[1] for line in (path / "SHA256SUMS").read_text().splitlines()] == [
        "model.safetensors", "rank0.pt", "shards/.metadata", "state.json"]  # `sha256sum -c SHA256SUMS` reads it
    assert damage(path) is None
    (path / "rank0.pt").write_bytes(b"stat")
    (path / "shards" / ".metadata").unlink()
    assert damage(path) == ("rank0.pt does not match its SHA-256 in SHA256SUMS; shards/.metadata is missing")
    (path / "SHA256SUMS").write_text("not a sum\n")
    assert damage(path) == "SHA256SUMS is not readable (line 1)"
    (path / "SHA256SUMS").unlink()  # a checkpoint written before checksums: nothing to check it against
    assert damage(path) is None


def test_a_checkpoint_file_that_cannot_be_read_is_named_in_one_line(tmp_path):
    """A checkpoint written without SHA256SUMS (or damaged since it was checked): the file is named, not a
    traceback from safetensors' or torch's reader."""
    import torch
    from safetensors.torch import load_file, save_file

    from rlmm.run.checkpoint import read

    path = tmp_path / "checkpoints" / "step-000002"
    path.mkdir(parents=True)
    save_file({"w": torch.ones(64)}, path / "model.safetensors")
    (path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes()[:100])
    torch.save({"step": 2}, path / "rank0.pt")
    (path / "rank0.pt").write_bytes((path / "rank0.pt").read_bytes()[:50])
    for name, reader in (("model.safetensors", load_file), ("rank0.pt", lambda f: torch.load(f, weights_only=True))):
        with pytest.raises(ResumeRefused, match=rf"^train.resume: {re.escape(str(path / name))} cannot be read \(\w+: "
                                                rf".*\): remove its checkpoint {re.escape(str(path))} to resume from "
                                                rf"the one before it, or give this run another hydra.run.dir$"):
            read(path / name, reader)
