"""The check for the GPU machine this project can be lent (scripts/gpu_lent_check.sh: no vLLM, no DeepSpeed, no
package index there): its dry run on CPU runs every part with a tiny model, and its JSON holds the figures the
GPU run would report; the wheel install it relies on there (unzipping into a site folder, no pip) is exercised
on wheels the dry run makes."""
import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import subprocess_env

ROOT = Path(__file__).parent.parent


@pytest.mark.timeout(1300)  # ~2.5 min on an idle 2-core machine; the parts' own limits (the hang guards) add to 870 s
def test_gpu_lent_check_dry_run(tmp_path):
    env = subprocess_env(OUT=str(tmp_path / "out"), RLMM_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="2")
    result = subprocess.run(["bash", "scripts/gpu_lent_check.sh", "--dry-run", "--work", str(tmp_path / "work")],
                            cwd=ROOT, capture_output=True, text=True, timeout=1200, env=env)
    record = json.loads((tmp_path / "out" / "gpu_lent_check.json").read_text())
    parts = record["parts"]
    failures = {name: part.get("failed") or [r["failed"] for r in [*part.get("runs", []), part.get("run", {})]
                                             if "failed" in r] for name, part in parts.items() if not part["ok"]}
    assert result.returncode == 0 and not failures, (failures, result.stdout[-3000:], result.stderr[-3000:])
    assert list(parts) == ["setup", "train", "probe", "layouts"]
    assert all(part["seconds"] <= part["limit_seconds"] + 15 for part in parts.values())

    # setup: wheels unzipped as pip would (a .data/purelib module too, no scripts), if_missing only where absent
    setup = parts["setup"]
    wheels = {row["wheel"]: row for row in setup["wheels"]}
    assert wheels["rlmm_wheel_check-1.0-py3-none-any.whl"]["modules"] == ["rlmm_wheel_check", "rlmm_wheel_check_data"]
    assert not wheels["if_missing/packaging-0.0-py3-none-any.whl"]["installed"]
    assert wheels["if_missing/rlmm_wheel_check_missing-1.0-py3-none-any.whl"]["installed"]
    site = tmp_path / "work" / "site"
    assert (site / "rlmm_wheel_check_data.py").exists() and not (site / "packaging").exists()
    assert not list(site.rglob("rlmm-wheel-check"))  # a wheel's scripts are not installed
    imports = setup["imports"]
    assert imports["modules"]["rlmm_wheel_check"]["from_carried_wheels"]
    assert imports["modules"]["rlmm_wheel_check_missing"]["from_carried_wheels"]
    assert not imports["modules"]["deepspeed"]["from_carried_wheels"]  # .venv's, in the dry run
    deepspeed = imports["deepspeed"]
    assert deepspeed["accelerator_detected"] == deepspeed["accelerator_rlmm_sets"] == "cpu"
    assert deepspeed["one_step"]["weights_moved"] and deepspeed["ops_compiled_in_wheel"] == []
    assert setup["model"]["tie_word_embeddings"] and setup["layouts_model"]["num_parameters"] > 0

    # train: DeepSpeed with the transformers sampler; fp16 skipped with its reason where the CPU refuses it
    runs = {run["name"]: run for run in parts["train"]["runs"]}
    assert list(runs) == ["train-bf16-zero0", "train-fp16-zero0", "train-bf16-zero2", "train-bf16_fp32head-zero0"]
    for name, run in runs.items():
        if "skipped" in run:
            assert name == "train-fp16-zero0" and "fp16 unsupported" in run["skipped"], run
            assert deepspeed["fp16_supported"] is False
            continue
        assert run["steps"] == 2 and run["skipped_steps"] == 0 and len(run["per_step"]) == 2, name
        assert all(s["logprob_abs_diff_mean"] > 0 and s["kl_k3"] >= 0 and s["seconds"] > 0 for s in run["per_step"])
        assert run["step_seconds_median"] > 0
        # no op is compiled for the step (torch_adam); only DeepSpeed's CPU shared-memory comm op on this CPU
        assert all("shm_comm" in op for op in run["jit_ops"]), run["jit_ops"]
        assert run["precision_report"]["actual"]["trainer"]["dtype"] == run["precision"][:4]
    assert runs["train-bf16_fp32head-zero0"]["precision_report"]["actual"]["trainer"]["head_dtype"] == "fp32"
    assert runs["train-bf16-zero0"]["precision_report"]["actual"]["trainer"]["head_dtype"] == "bf16"

    # probe: both trainers in every precision, compared directly
    probe = parts["probe"]
    grid = [run for run in probe["runs"] if run["name"] != "probe-routing-r3"]
    assert {(run["trainer"], run["precision"]) for run in grid if "sampler_vs_trainer" in run} == {
        (t, p) for t in ("fsdp", "torch") for p in ("bf16", "fp16", "fp32", "bf16_fp32head")}
    # then routing replay on the shipped MoE model (issue 25): the probe's routing part
    routing = next(r for r in probe["runs"] if r["name"] == "probe-routing-r3")
    assert "failed" not in routing, routing
    assert 0 <= routing["routing"]["disagreement"]["differing_decisions_reaching_scores"] <= \
        routing["routing"]["disagreement"]["differing_decisions"]
    assert "kl_k3" in routing["routing"]["share_removed"]
    compared = probe["torch_vs_fsdp"]
    assert set(compared) == {"bf16", "fp16", "fp32", "bf16_fp32head"}
    for precision, row in compared.items():
        # on CPU the trainers give the same log-probs since the RoPE cast fix (docs/precision.md); the GPU
        # run reports whether that holds there
        assert row["same_figures"], (precision, row)
        assert "first_run" not in row  # the first GPU run's figures belong to the 0.5B model only
    assert compared["fp32"]["fsdp"]["logprob_abs_diff_mean"] < compared["fp16"]["fsdp"]["logprob_abs_diff_mean"] \
        < compared["bf16"]["fsdp"]["logprob_abs_diff_mean"]
    fsdp_bf16 = next(r for r in probe["runs"] if r["name"] == "probe-fsdp-bf16")
    assert fsdp_bf16["trainer_vs_itself"]["micro_batch_sizes"] == [1, 8]

    # layouts: benchmarks/layouts.py's figures, and its own record beside the JSON
    summary = parts["layouts"]["summary"]
    assert list(summary) == ["padded", "packed", "budget_64", "budget_packed_64", "budget_128", "budget_packed_128"]
    assert all(layout["wall_median"] > 0 for layout in summary.values())
    assert (tmp_path / "out" / "layouts.json").exists() and (tmp_path / "out" / "gpu_lent_runs.tar.gz").exists()
    assert "torch vs fsdp" in result.stdout
