"""`rlmm prefetch`, then a run with HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1: what a compute node without
internet sees.

The hub is unreachable from the tests, so each side of it is stood in for by something that takes the
same code path in the libraries:
- the model: a small HTTP server that answers the hub's model API (revision, file tree, file
  downloads) for one repository, `rlmm-test/tiny`, holding the small test checkpoint; huggingface_hub
  goes to it through HF_ENDPOINT. prefetch's `snapshot_download` really downloads into the hub cache,
  and the offline run resolves the id from that cache after the server has stopped.
- the dataset: a folder in the hub's layout for GSM8K (a README.md whose `configs` name `main`, and
  `main/{train,test}-*.parquet`), named by a relative path without a slash, `gsm8k`, which is also how
  a hub id without an owner reads. `datasets` loads the folder and caches its splits. Once the folder
  is renamed, `task.path=gsm8k` names no folder, so offline `datasets` does what it does for
  `openai/gsm8k` on a compute node: it finds the dataset's cached splits by name (its
  CachedDatasetModuleFactory), or, not cached, fails.
"""
from __future__ import annotations

import hashlib
import json
import shlex
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.conftest import ending, subprocess_env

SAMPLE = Path(__file__).parent / "data" / "gsm8k_sample.jsonl"
HUB_VARS = ("HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
            "TRANSFORMERS_OFFLINE", "HF_ENDPOINT", "HF_TOKEN")
SMALL = ["probe.num_prompts=2", "probe.samples_per_prompt=2", "probe.trainer_micro_batch_sizes=[1,4]",
         "probe.batch_invariance.num_prompts=2", "probe.batch_invariance.num_completions=2",
         "probe.batch_invariance.max_batch_size=4", "sampling.max_new_tokens=16",
         "sampler=hf", "trainer=torch", "precision=fp32", "logger=none"]
DATASET_README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
---
"""


def gsm8k_folder(root: Path) -> Path:
    """GSM8K's layout on the hub, with the sample records: 8 to train, 3 to test."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [json.loads(line) for line in SAMPLE.read_text().splitlines() if line.strip()]
    (root / "main").mkdir(parents=True)
    (root / "README.md").write_text(DATASET_README)
    pq.write_table(pa.Table.from_pylist(records[:8]), root / "main" / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(records[8:]), root / "main" / "test-00000-of-00001.parquet")
    return root


class FakeHub:
    """The hub's model API for one repository whose files are those of `folder`, on 127.0.0.1."""

    def __init__(self, repo_id: str, folder: str):
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(Path(folder).rglob("*"))
                 if p.is_file()}
        sha = hashlib.sha1(json.dumps({k: hashlib.sha1(v).hexdigest() for k, v in files.items()}).encode()).hexdigest()
        self.requests: list[str] = []
        requests = self.requests

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, body: bytes, headers: dict[str, str] | None = None, status: int = 200, head=False):
                self.send_response(status)
                for key, value in {"Content-Length": str(len(body)), **(headers or {})}.items():
                    self.send_header(key, value)
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def route(self, head: bool):
                path = self.path.split("?")[0]
                requests.append(path)
                if path.startswith(f"/api/models/{repo_id}/revision/"):
                    info = {"id": repo_id, "sha": sha, "siblings": [{"rfilename": f} for f in files]}
                    return self.reply(json.dumps(info).encode(), {"Content-Type": "application/json"})
                if path.startswith(f"/api/models/{repo_id}/tree/"):
                    tree = [{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                            for f, b in files.items()]
                    return self.reply(json.dumps(tree).encode(), {"Content-Type": "application/json"})
                name = path.removeprefix(f"/{repo_id}/resolve/").partition("/")[2]
                if path.startswith(f"/{repo_id}/resolve/") and name in files:
                    etag = f'"{hashlib.sha1(files[name]).hexdigest()}"'
                    return self.reply(files[name], {"X-Repo-Commit": sha, "ETag": etag}, head=head)
                self.reply(b"", {"X-Error-Code": "RepoNotFound"}, status=404, head=head)

            def do_GET(self):
                self.route(head=False)

            def do_HEAD(self):
                self.route(head=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def env_with(hf_home: Path, **extra: str) -> dict[str, str]:
    """This environment with its own Hugging Face caches and none of the caller's hub settings."""
    env = {k: v for k, v in subprocess_env().items() if k not in HUB_VARS}
    return {**env, "HF_HOME": str(hf_home), **extra}


def rlmm(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlmm.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300, stdin=subprocess.DEVNULL)


def error_line(result: subprocess.CompletedProcess) -> str:
    """The one line a failed run ends with, on stderr (Hydra apps and other commands alike)."""
    assert result.returncode == 2, (result.stdout + result.stderr)[-3000:]
    line = ending(result)
    assert line.startswith("rlmm: error: "), line
    return line


@pytest.fixture()
def hub(small_model_path):
    server = FakeHub("rlmm-test/tiny", small_model_path)
    yield server
    server.stop()


def test_prefetch_then_an_offline_probe_runs_from_the_caches(tmp_path, hub):
    work, hf_home = tmp_path / "work", tmp_path / "hf"
    gsm8k_folder(work / "gsm8k")
    run_dir = tmp_path / "run"
    args = ["probe", "model=hf", "model.path=rlmm-test/tiny", "task=gsm8k", "task.path=gsm8k", *SMALL,
            f"hydra.run.dir={run_dir}"]

    to_hub = env_with(hf_home, HF_ENDPOINT=hub.endpoint, NO_PROXY="127.0.0.1", no_proxy="127.0.0.1")
    result = rlmm("prefetch", *args, cwd=work, env=to_hub)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    model_line, task_line, command_line = result.stdout.strip().splitlines()[-3:]
    snapshots = hf_home / "hub" / "models--rlmm-test--tiny" / "snapshots"
    assert model_line.startswith(f"model=hf rlmm-test/tiny: cached in {snapshots}/"), result.stdout
    assert task_line.startswith(f"task=gsm8k gsm8k (main: train, test): cached in {hf_home / 'datasets' / 'gsm8k'}/")
    assert any(p.startswith("/rlmm-test/tiny/resolve/") for p in hub.requests)  # downloaded, not copied
    snapshot = Path(model_line.split("cached in ")[1])
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in snapshot.iterdir()}

    # The command it prints is the probe's, with the caches it filled and both libraries offline.
    assert command_line.startswith("run offline: ")
    words = shlex.split(command_line.removeprefix("run offline: "))
    env = dict(word.split("=", 1) for word in words[:3])
    assert env == {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    assert words[3:] == ["rlmm", *args]

    # Nothing but the caches left: the hub is gone and so is the dataset folder.
    hub.stop()
    (work / "gsm8k").rename(work / "gsm8k-moved")
    result = rlmm(*words[4:], cwd=work, env=env_with(hf_home, **env))
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    record = json.loads((run_dir / "probe.json").read_text())
    assert record["model_path"] == str(snapshot)
    assert record["sampler_vs_trainer"]["num_tokens"] > 0


def test_offline_without_the_caches_fails_in_one_line(tmp_path):
    """What is not cached fails at once, in one line naming it (for the dataset, with the prefetch
    command), instead of waiting on a network that is not there."""
    offline = env_with(tmp_path / "empty-hf", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    result = rlmm("probe", "task=gsm8k", "task.path=gsm8k", *SMALL, f"hydra.run.dir={tmp_path / 'run'}",
                  cwd=tmp_path, env=offline)
    line = error_line(result)
    assert line.startswith("rlmm: error: task.path: dataset 'gsm8k' is not in the datasets cache "
                           f"({tmp_path / 'empty-hf' / 'datasets'})"), line
    assert line.endswith("run: rlmm prefetch task=gsm8k task.path=gsm8k")

    result = rlmm("prefetch", "model=hf", "model.path=rlmm-test/absent", cwd=tmp_path, env=offline)
    line = error_line(result)
    assert line.startswith("rlmm: error: model.path: cannot fetch hub model 'rlmm-test/absent'")
    assert "cached snapshot" in line and line.endswith("run: rlmm prefetch model=hf model.path=rlmm-test/absent")


def test_local_files_need_nothing_and_a_sweep_lists_each_item_once(tmp_path, capsys, monkeypatch):
    from rlmm.launch.prefetch import main

    for name in HUB_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf dir"))
    main(["-m", "task=gsm8k", f"task.path={SAMPLE}", "seed=0,1", "correction=tis,none",
          "hydra/launcher=local"])
    assert capsys.readouterr().out.splitlines() == [
        "model=tiny: shipped with rlmm or built by the run itself, nothing to fetch",
        f"task=gsm8k {SAMPLE}: a local file, nothing to fetch",
        f"run offline: HF_HOME='{tmp_path / 'hf dir'}' HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 rlmm train -m "
        f"task=gsm8k task.path={SAMPLE} seed=0,1 correction=tis,none hydra/launcher=local",
    ]
    assert not (tmp_path / "hf dir").exists()  # nothing was fetched


@pytest.mark.parametrize("args, message", [
    (["task=gsm9k"], "unknown task 'gsm9k' (allowed: arithmetic, calculator, gsm8k, gsm8k_tools)"),
    (["model=hf", "model.path=/no/such/checkpoint"],
     "model.path: '/no/such/checkpoint' does not exist and is not a Hugging Face hub id (owner/name)"),
    (["task=gsm8k", "task.path=/no/such.jsonl"], "task.path: file not found: '/no/such.jsonl'"),
    (["probe", "train.steps=3"], "Could not override 'train.steps'"),
])
def test_bad_input_is_one_line(args, message, capsys):
    from rlmm.launch.prefetch import main

    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and err.startswith(f"rlmm: error: {message}") and "\n" not in err, err
