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

import rlmm.schema  # noqa: F401  (registers the schemas)
from rlmm.config import CONF_DIR, validate
from rlmm.errors import ConfigError
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
    refusals (rlmm/errors.py::fail) went to stderr."""
    from rlmm.apps import end

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
