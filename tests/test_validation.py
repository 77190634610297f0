"""Values refused before any engine starts (issue 50, case 9): a trainer's numeric keys out of range or not
finite, and a `+key` the schema does not know. `trainer.lr=nan` ran 12 s, then a torch traceback; `lr=inf` ended
advising a resume that was then refused; `+train.stepz=3` was accepted and ignored."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import open_dict

import rlmm.config.schema  # noqa: F401  (registers the schemas)
from rlmm.config.options import CONF_DIR, validate
from rlmm.runtime.errors import ConfigError
from tests.conftest import ending, subprocess_env


def composed(app: str, overrides: list[str]):
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(app, overrides=overrides, return_hydra_config=True)
        choices = dict(cfg.hydra.runtime.choices)
        with open_dict(cfg):
            del cfg["hydra"]
        return cfg, choices
    finally:
        GlobalHydra.instance().clear()


@pytest.mark.parametrize("override,message", [
    ("trainer.lr=nan", "trainer=torch: lr must be a finite number > 0, got nan"),
    ("trainer.lr=-1e-5", "trainer=torch: lr must be a finite number > 0, got -1e-05"),
    ("trainer.lr=inf", "trainer=torch: lr must be a finite number > 0, got inf"),
    ("trainer.lr=0", "trainer=torch: lr must be a finite number > 0, got 0"),
    ("trainer.weight_decay=-0.1", "trainer=torch: weight_decay must be a finite number >= 0, got -0.1"),
    ("trainer.grad_clip=nan", "trainer=torch: grad_clip must be a finite number > 0, got nan"),
    ("trainer.micro_batch_size=0", "trainer=torch: micro_batch_size must be >= 1, got 0"),
    ("trainer.warmup_steps=-1", "trainer=torch: warmup_steps must be >= 0, got -1"),
    ("trainer.initial_loss_scale=inf", "trainer=torch: initial_loss_scale must be a finite number > 0, got inf"),
    ("+train.stepz=3", "train.stepz: unknown key (allowed: steps, prompts_per_step, "),
    ("+sampling.temprature=1", "sampling.temprature: unknown key (allowed: temperature, "),
    ("+stepz=3", "stepz: unknown key (allowed: model, "),
])
def test_a_bad_trainer_value_or_an_added_key_the_schema_lacks_is_refused(override, message):
    cfg, choices = composed("train", ["debug=train", "trainer=torch", override])
    with pytest.raises(ConfigError) as refused:
        validate(cfg, choices)
    assert str(refused.value).startswith(message), str(refused.value)


def test_the_shipped_trainers_pass():
    for trainer in ("deepspeed", "fsdp", "torch"):
        validate(*composed("train", [f"trainer={trainer}"]))
    validate(*composed("probe", []))


def test_a_bad_lr_is_one_line_before_anything_starts(tmp_path):
    result = subprocess.run([sys.executable, "-m", "rlmm.cli", "train", "debug=train", "trainer.lr=nan",
                             f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=300,
                            env=subprocess_env(), stdin=subprocess.DEVNULL)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr == "rlmm: error: trainer=deepspeed: lr must be a finite number > 0, got nan\n"
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


@pytest.mark.parametrize("line,code", [("rlmm: error: task.path: bad", 2), ("rlmm: stopped: 3 bad steps in a row", 3),
                                       ("rlmm: machine fault: the disk is full (/d/steps.jsonl)", 4),
                                       ("rlmm: interrupted (SIGINT): no step was recorded", 130)])
def test_the_line_a_run_ends_with_goes_to_stderr(capsys, line, code):
    """Every fault one line with its exit code, on stderr: `end` printed these on stdout, where the composition's
    refusals (rlmm/runtime/errors.py::fail) went to stderr."""
    from rlmm.launch.apps import end

    with pytest.raises(SystemExit) as ended:
        end(line, code, submitted=False)
    assert ended.value.code == code
    assert capsys.readouterr() == ("", line + "\n")


# ---- the command line, for real: one line on stderr, no traceback, nothing written ----------------------------------

def rlmm(*args: str, cwd=None, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlmm.cli", *args], capture_output=True, text=True, timeout=300,
                          env=subprocess_env(**env), stdin=subprocess.DEVNULL, cwd=cwd)


def refused(result: subprocess.CompletedProcess, code: int = 2) -> str:
    """The one line of a refused command: its exit code, no traceback."""
    assert result.returncode == code, (result.stdout[-2000:], result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return ending(result)


FAST = ("train", "debug=train", "sampler=hf", "trainer=torch")


@pytest.mark.parametrize("how", ["RLMM_CACHE", "RLMM_CACHE below", "model.cache_dir"])
def test_a_cache_directory_that_is_a_file_is_one_line_before_anything_starts(tmp_path, how):
    """RLMM_CACHE (or model.cache_dir) naming a file, or a path below one: a NotADirectoryError traceback once a
    model was built; now refused with the other bad values, before the run directory is made."""
    file = tmp_path / "cache"
    file.write_text("a file, not a directory")
    run_dir = tmp_path / "run"
    if how == "model.cache_dir":
        result = rlmm(*FAST, "model.rebuild=true", f"model.cache_dir={file}", f"hydra.run.dir={run_dir}")
        says = (f"rlmm: error: model.cache_dir: {file} is a file, not a directory (give a directory, or null for "
                "$RLMM_CACHE or ~/.cache/rlmm)")
    else:
        cache = file if how == "RLMM_CACHE" else file / "below"
        result = rlmm(*FAST, "model.rebuild=true", f"hydra.run.dir={run_dir}", RLMM_CACHE=str(cache))
        where = "is a file" if cache == file else f"is below {file}, a file"
        says = (f"rlmm: error: RLMM_CACHE: {cache} {where}, not a directory (point RLMM_CACHE at a directory, or "
                "unset it for ~/.cache/rlmm)")
    assert refused(result) == says
    assert not run_dir.exists()


def test_a_task_file_not_in_utf8_is_one_line_naming_its_line_and_byte(tmp_path):
    """tests/data/gsm8k_latin1.jsonl: a record saved as Latin-1 (its `û` the byte 0xfb); docs/bad_inputs.md runs it."""
    path = Path(__file__).parent / "data" / "gsm8k_latin1.jsonl"
    result = rlmm(*FAST, "task=gsm8k", f"task.path={path}", f"hydra.run.dir={tmp_path / 'run'}")
    assert refused(result) == (f"rlmm: error: task.path: {path}:1: not UTF-8: byte 0xfb at offset 24 of the file (save "
                               "it as UTF-8: iconv -f <its encoding> -t utf-8)")


@pytest.mark.parametrize("how", ["plain", "quoted", "sweep"])
def test_a_run_directory_outside_ascii_just_runs(tmp_path, how):
    """`hydra.run.dir=/tmp/rün`: Hydra's override grammar takes letters outside ASCII only in quotes, so it ended in
    Hydra's LexerNoViableAltException (exit 1); quoted, rlmm made a directory named `'` in the working directory
    before the run. rlmm now quotes such a value for Hydra, and reads a quoted one as Hydra does."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    if how == "sweep":
        sweep_dir = tmp_path / "sweep-ü"
        result = rlmm(FAST[0], "-m", *FAST[1:], f"hydra.sweep.dir={sweep_dir}", "seed=0", cwd=cwd)
        run_dir = sweep_dir / "0"
    else:
        run_dir = tmp_path / "rün"
        result = rlmm(*FAST, f"hydra.run.dir='{run_dir}'" if how == "quoted" else f"hydra.run.dir={run_dir}", cwd=cwd)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    assert (run_dir / "summary.json").exists() and (run_dir / "steps.jsonl").exists()
    assert list(cwd.iterdir()) == []


@pytest.mark.parametrize("args", [
    ["task.path=/data/ü.jsonl"], ["task.path=/data/ü.jsonl,/data/ö.jsonl"], ["+x=ü"], ["hydra.run.dir=/tmp/rün"],
    ["--cfg", "job", "task.path=/data/ü.jsonl"], ["task.path='/data/ü.jsonl'"], ["seed=1"], ["task.path=[ü]"],
])
def test_values_outside_ascii_are_quoted_for_hydra(args):
    from rlmm.cli import quoted_outside_ascii

    expected = {"task.path=/data/ü.jsonl": "task.path='/data/ü.jsonl'", "+x=ü": "+x='ü'",
                "task.path=/data/ü.jsonl,/data/ö.jsonl": "task.path='/data/ü.jsonl','/data/ö.jsonl'",
                "hydra.run.dir=/tmp/rün": "hydra.run.dir='/tmp/rün'"}
    assert quoted_outside_ascii(args) == [expected.get(arg, arg) for arg in args]


@pytest.mark.parametrize("args,says", [
    (["hydra.run.dir="], "empty, which would put the run's files in the working directory"),
    (["hydra.run.dir=''"], "empty, which would put the run's files in the working directory"),
    (["hydra.run.dir= "], "empty, which would put the run's files in the working directory"),
    (["hydra.sweep.dir=", "seed=0", "-m"], "empty, which would put the run's files in the working directory"),
    (["hydra.run.dir=null"], "null is not a directory"),
    (["hydra.run.dir=a,b"], "a,b is not one directory"),
])
def test_a_run_directory_that_is_none_is_one_line_before_anything_is_written(tmp_path, args, says):
    """`hydra.run.dir=` (an unset variable in a script) wrote the run into the working directory; null or a sweep of
    directories made a directory of that name in it (`null`, `a,b`), then ended in Hydra's error, exit 1."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    key, default = ("hydra.sweep.dir", "multirun") if "-m" in args else ("hydra.run.dir", "outputs")
    sweep = ["-m"] if "-m" in args else []
    after = "; a sweep's jobs each get one below hydra.sweep.dir, with -m" if "," in args[0] else ""
    assert refused(rlmm(FAST[0], *sweep, *FAST[1:], *(a for a in args if a != "-m"), cwd=cwd)) == (
        f"rlmm: error: {key}: {says} (give a directory, or leave {key} out for {default}/train/<date>/<time>{after})")
    assert list(cwd.iterdir()) == []
