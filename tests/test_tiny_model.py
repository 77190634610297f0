"""The built-in model: character tokenizer, cache by config hash, warm start, the shipped default."""
import hashlib
import json
import logging
import shutil

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

import rlmm.config.schema  # noqa: F401
from rlmm.config.options import CONF_DIR, to_container
import rlmm.models.tiny as tiny
from rlmm.models.tiny import BUILTIN_DIR, TinyModel, build_char_tokenizer, shipped_digests


def _spec(cache_dir, **changes):
    values = dict(hidden_size=64, num_layers=1, num_heads=1, num_kv_heads=1, intermediate_size=64, max_position=64,
                  seed=0, warm_start_steps=40, warm_start_lr=3e-3, warm_start_batch_size=16, cache_dir=str(cache_dir),
                  rebuild=False)
    values.update(changes)
    return TinyModel(**values)


def test_tokenizer_is_character_level_with_bos():
    tokenizer = build_char_tokenizer()
    ids = tokenizer("12+3=").input_ids
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 6
    assert tokenizer.decode(ids, skip_special_tokens=True) == "12+3="
    assert tokenizer.decode(tokenizer("Question: A $5 pen?\nAnswer: ").input_ids[1:]) == "Question: A $5 pen?\nAnswer: "


def test_cache_key_follows_every_input(tmp_path):
    base = _spec(tmp_path).cache_key({"task": 1})
    assert base == _spec(tmp_path).cache_key({"task": 1})
    assert base != _spec(tmp_path, hidden_size=128).cache_key({"task": 1})
    assert base != _spec(tmp_path, warm_start_steps=41).cache_key({"task": 1})
    assert base != _spec(tmp_path).cache_key({"task": 2})


def test_build_warm_start_and_reuse(tmp_path, arithmetic_task):
    from transformers import AutoModelForCausalLM

    spec = _spec(tmp_path)
    path = spec.resolve(arithmetic_task, {"t": 1})
    info = json.loads((tmp_path / "models" / path.rsplit("/", 1)[-1] / "rlmm_model.json").read_text())
    assert info["warm_start_loss"] < info["initial_loss"]  # the warm start learned something
    stamp = (tmp_path / "models" / path.rsplit("/", 1)[-1] / "model.safetensors").stat().st_mtime_ns
    assert spec.resolve(arithmetic_task, {"t": 1}) == path  # cached: not rebuilt
    assert (tmp_path / "models" / path.rsplit("/", 1)[-1] / "model.safetensors").stat().st_mtime_ns == stamp
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "qwen2" and not model.config.tie_word_embeddings
    assert not list(tmp_path.glob("models/.building-*"))


def test_builtin_model_is_partially_competent():
    """The default model (shipped): better than chance, far from perfect, peaked."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("probe")
    GlobalHydra.instance().clear()
    task = instantiate(cfg.task)
    path = instantiate(cfg.model).resolve(task, to_container(cfg.task))
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert 1e6 < sum(p.numel() for p in model.parameters()) < 1e7
    examples = task.examples("test", 100)
    correct, top_probs = 0, []
    for example in examples:
        ids = torch.tensor([tokenizer(example.prompt).input_ids])
        out = model.generate(ids, do_sample=False, max_new_tokens=5, output_scores=True, return_dict_in_generate=True,
                             pad_token_id=tokenizer.pad_token_id)
        correct += task.reward(example, tokenizer.decode(out.sequences[0, ids.size(1):], skip_special_tokens=True))
        top_probs.append(out.scores[0].softmax(-1).max().item())
    accuracy = correct / len(examples)
    assert 0.05 < accuracy < 0.9, accuracy
    assert sum(top_probs) / len(top_probs) > 0.3  # peaked first-token distribution (uniform: 1/100)


def _compose(*overrides):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=list(overrides))
    GlobalHydra.instance().clear()
    return cfg


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _forbid_building(monkeypatch):
    def build(*args, **kwargs):
        raise AssertionError("the model was built (warm start) instead of taken from rlmm/models/builtin/")
    monkeypatch.setattr(tiny, "warm_start", build)
    monkeypatch.setattr(TinyModel, "_build", build)


def test_shipped_model_files_match_the_manifest():
    """Every file of the shipped model hashes to SHA256SUMS, and the manifest lists every file.

    CI runs this on another machine than the one the model was built on: that is the check that two
    machines hold the same checksum (the shipped bytes are read, never rebuilt, so the CPU does not matter).
    """
    shipped = shipped_digests()
    assert shipped and all("model.safetensors" in files for files in shipped.values())
    for name, files in shipped.items():
        assert sorted(p.name for p in (BUILTIN_DIR / name).iterdir()) == sorted(files), name
        for file, digest in files.items():
            assert _sha256(BUILTIN_DIR / name / file) == digest, f"{name}/{file}"


def test_shipped_model_is_the_default_configuration():
    """`rlmm train` with no overrides resolves to the shipped key, and the shipped model's own record
    (rlmm_model.json) hashes to that key: editing conf/model/tiny.yaml or the task's defaults fails here
    instead of silently building a machine-specific model again."""
    cfg = _compose()
    key = instantiate(cfg.model).cache_key(to_container(cfg.task))
    assert f"tiny-{key}" in shipped_digests()
    info = json.loads((BUILTIN_DIR / f"tiny-{key}" / "rlmm_model.json").read_text())
    recorded = TinyModel(**info["arch"], seed=info["seed"], warm_start_steps=info["warm_start"]["steps"],
                         warm_start_lr=info["warm_start"]["lr"], warm_start_batch_size=info["warm_start"]["batch_size"],
                         cache_dir=None, rebuild=False)
    assert recorded.cache_key(info["task"]) == key


def test_default_resolves_to_the_shipped_model_without_building(tmp_path, monkeypatch):
    _forbid_building(monkeypatch)
    cfg = _compose(f"model.cache_dir={tmp_path}")
    path = instantiate(cfg.model).resolve(instantiate(cfg.task), to_container(cfg.task))
    name = path.rsplit("/", 1)[-1]
    assert path == str(BUILTIN_DIR / name)
    assert _sha256(BUILTIN_DIR / name / "model.safetensors") == shipped_digests()[name]["model.safetensors"]
    assert not (tmp_path / "models").exists()  # nothing built, nothing cached


def _ship(tmp_path, monkeypatch, source, name):
    """Pretend `source` is a shipped model named `name`: a builtin dir and SHA256SUMS under tmp_path."""
    builtin = tmp_path / "builtin"
    shutil.copytree(source, builtin / name)
    (builtin / "SHA256SUMS").write_text("".join(f"{_sha256(f)}  {name}/{f.name}\n"
                                                for f in sorted((builtin / name).iterdir())))
    monkeypatch.setattr(tiny, "BUILTIN_DIR", builtin)
    monkeypatch.setattr(tiny, "BUILTIN_SUMS", builtin / "SHA256SUMS")
    return builtin


def test_corrupted_shipped_copy_is_a_one_line_error(tmp_path, monkeypatch):
    _forbid_building(monkeypatch)
    cfg = _compose(f"model.cache_dir={tmp_path / 'cache'}")
    name = f"tiny-{instantiate(cfg.model).cache_key(to_container(cfg.task))}"
    builtin = _ship(tmp_path, monkeypatch, BUILTIN_DIR / name, name)
    weights = builtin / name / "model.safetensors"
    expected = _sha256(weights)
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError) as err:
        instantiate(cfg.model).resolve(instantiate(cfg.task), to_container(cfg.task))
    message = str(err.value)
    assert "\n" not in message
    assert str(weights) in message and expected in message and _sha256(weights) in message


def test_rebuild_of_a_shipped_key_is_checked_against_its_digest(tmp_path, monkeypatch, caplog, arithmetic_task):
    """model.rebuild=true builds on this machine and uses that build; the log says whether its weights are
    the shipped ones, naming both digests when they are not."""
    spec = _spec(tmp_path / "cache")
    built = spec.resolve(arithmetic_task, {"t": 1})  # not shipped: built as always
    name = built.rsplit("/", 1)[-1]
    builtin = _ship(tmp_path, monkeypatch, built, name)
    assert _spec(tmp_path / "cache").resolve(arithmetic_task, {"t": 1}) == str(builtin / name)  # shipped: in place
    rebuild = _spec(tmp_path / "cache", rebuild=True)
    with caplog.at_level(logging.INFO, logger="rlmm.models.tiny"):
        assert rebuild.resolve(arithmetic_task, {"t": 1}) == built
    assert "has the shipped weights" in caplog.text and not [r for r in caplog.records if r.levelno >= logging.WARNING]
    shipped = "0" * 64  # as if the shipped model came from a machine whose kernels differ
    sums = (builtin / "SHA256SUMS").read_text().replace(_sha256(builtin / name / "model.safetensors"), shipped)
    (builtin / "SHA256SUMS").write_text(sums)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rlmm.models.tiny"):
        assert rebuild.resolve(arithmetic_task, {"t": 1}) == built
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "\n" not in warning and shipped in warning and _sha256(builtin / name / "model.safetensors") in warning
    assert "unless model.rebuild=true" in warning


def test_other_configurations_still_build(tmp_path):
    cfg = _compose(f"model.cache_dir={tmp_path}", "seed=1", "model.hidden_size=64", "model.num_layers=1",
                   "model.intermediate_size=64", "model.warm_start_steps=5", "model.warm_start_batch_size=8")
    model = instantiate(cfg.model)
    name = f"tiny-{model.cache_key(to_container(cfg.task))}"
    assert name not in shipped_digests()
    assert model.resolve(instantiate(cfg.task), to_container(cfg.task)) == str(tmp_path / "models" / name)
    assert json.loads((tmp_path / "models" / name / "rlmm_model.json").read_text())["warm_start"]["steps"] == 5


def test_a_warm_start_whose_loss_did_not_come_down_is_an_error_naming_the_model(tmp_path, arithmetic_task):
    """lr 0: the loss stays where it started; the build fails naming the model and caches nothing, and a model
    cached before the check (its record says the same) fails when it is resolved."""
    spec = _spec(tmp_path, warm_start_lr=0.0)
    name = f"tiny-{spec.cache_key({'t': 1})}"
    with pytest.raises(ValueError, match=rf"^model: the warm start of {name} did not bring its loss down \("):
        spec.resolve(arithmetic_task, {"t": 1})
    assert not (tmp_path / "models" / name).exists() and not list(tmp_path.glob("models/.building-*"))
    cached = tmp_path / "models" / name
    cached.mkdir(parents=True)
    (cached / "rlmm_model.json").write_text(json.dumps({"initial_loss": 4.8, "warm_start_loss": 4.7}))
    with pytest.raises(ValueError, match=f"warm start of {name} did not bring its loss down"):
        spec.resolve(arithmetic_task, {"t": 1})


def test_the_run_seed_leaves_the_model_and_the_task_as_they_are():
    """`rlmm train -m seed=0,1,2` trains the shipped model three ways: the run's seed varies sampling and updates,
    not the task's problems and demonstrations the model is warm-started on (`task.seed`, 0 by default)."""
    keys = set()
    for seed in (0, 1, 2):
        cfg = _compose(f"seed={seed}")
        assert cfg.task.seed == 0
        keys.add(instantiate(cfg.model).cache_key(to_container(cfg.task)))
    assert len(keys) == 1 and f"tiny-{keys.pop()}" in shipped_digests()
    other = _compose("task.seed=1")
    assert f"tiny-{instantiate(other.model).cache_key(to_container(other.task))}" not in shipped_digests()


KILLED_MID_BUILD = """
import sys
from rlmm.config.options import from_yaml
from rlmm.models.tiny import TinyModel
spec = TinyModel(hidden_size=64, num_layers=1, num_heads=1, num_kv_heads=1, intermediate_size=64, max_position=64,
                 seed=0, warm_start_steps=10**6, warm_start_lr=3e-3, warm_start_batch_size=16, cache_dir=sys.argv[1],
                 rebuild=False)
spec.resolve(from_yaml("task", "arithmetic", seed=0, careless_demos=0.0), {"t": "killed"})
"""


def test_a_build_killed_half_way_is_removed_by_the_next_build_and_only_it(tmp_path, arithmetic_task):
    """SIGKILL in the middle of a warm start leaves its `.building-<host>-<pid>-*` directory; the next build removes
    it, and leaves those that may still be building: this process's own, and another host's until it is a day
    old (this host cannot see that host's processes)."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    from tests.conftest import subprocess_env

    models = tmp_path / "models"
    log = tmp_path / "builder.log"
    with open(log, "w") as stderr:
        builder = subprocess.Popen([sys.executable, "-c", KILLED_MID_BUILD, str(tmp_path)], env=subprocess_env(),
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr)
    deadline = time.monotonic() + 120
    while not list(models.glob(".building-*")):  # made as the build starts; its files come at the end
        assert builder.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)
    builder.send_signal(signal.SIGKILL)
    builder.wait(timeout=60)
    killed = list(models.glob(".building-*"))
    assert len(killed) == 1 and f"-{builder.pid}-" in killed[0].name
    ours = models / f".building-{socket.gethostname()}-{os.getpid()}-abc123"
    elsewhere = models / ".building-another-host-1-abc123"
    stale_elsewhere = models / ".building-another-host-2-abc123"
    for directory in (ours, elsewhere, stale_elsewhere):
        directory.mkdir()
    two_days_ago = time.time() - 2 * 24 * 3600
    os.utime(stale_elsewhere, (two_days_ago, two_days_ago))
    _spec(tmp_path).resolve(arithmetic_task, {"t": 1})
    assert sorted(models.glob(".building-*")) == sorted([ours, elsewhere])
