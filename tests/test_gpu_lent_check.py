"""The check for the GPU machine this project can be lent (scripts/gpu_lent_check.sh: no vLLM, no DeepSpeed, no
package index there): its dry run on CPU runs every part with a tiny model, and its JSON holds the figures the
GPU run would report; the wheel install it relies on there (unzipping into a site folder, no pip) is exercised
on wheels the dry run makes. The default run checks setup, probe and layouts; the train part (four DeepSpeed runs,
~50 s) is `slow`.

The size of a mismatch depends on the CPU's kernels: on an AVX512-BF16 CPU transformers' bf16 and fp16 `generate`
and DeepSpeed's forward give bit-identical log-probs (every |δ| 0), on AVX2 they differ by ~2e-4. So the train
part's figures are checked for what holds on every CPU (finite, >= 0, zero together) and against each other in
the same run, never against a constant (docs/testing.md, "Machine-dependent figures")."""
import json
import math
import subprocess
from pathlib import Path

import pytest

from tests.conftest import subprocess_env

ROOT = Path(__file__).parent.parent


def dry_run(tmp_path, parts: str) -> tuple[dict, subprocess.CompletedProcess]:
    """`gpu_lent_check.sh --dry-run --parts <parts>`: its JSON record (asserted to have no failed part)."""
    env = subprocess_env(OUT=str(tmp_path / "out"), RLMM_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="2")
    result = subprocess.run(["bash", "scripts/gpu_lent_check.sh", "--dry-run", "--work", str(tmp_path / "work"),
                             "--parts", parts], cwd=ROOT, capture_output=True, text=True, timeout=1200, env=env)
    record = json.loads((tmp_path / "out" / "gpu_lent_check.json").read_text())
    failures = {name: part.get("failed") or [r["failed"] for r in [*part.get("runs", []), part.get("run", {})]
                                             if "failed" in r] for name, part in record["parts"].items() if not part["ok"]}
    assert result.returncode == 0 and not failures, (failures, result.stdout[-3000:], result.stderr[-3000:])
    assert list(record["parts"]) == parts.split(",")
    assert all(part["seconds"] <= part["limit_seconds"] + 15 for part in record["parts"].values())
    return record, result


@pytest.mark.slow  # 3-6 min on 2 cores: the whole lent-machine script on the CPU
@pytest.mark.timeout(1000)  # ~2 min on an idle 2-core machine; the parts' own limits (the hang guards) add to 750 s
def test_gpu_lent_check_dry_run(tmp_path):
    record, result = dry_run(tmp_path, "setup,probe,layouts")
    parts = record["parts"]
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
    # More mantissa bits, a smaller gap: fp32 <= fp16 <= bf16 among the precisions whose sampler and trainer are not
    # bit-identical (on some CPUs a precision's kernels agree exactly: its gap is 0, whatever the others')
    gaps = [compared[p]["fsdp"]["logprob_abs_diff_mean"] for p in ("fp32", "fp16", "bf16")]
    assert all(math.isfinite(g) and g >= 0 for g in gaps), gaps
    nonzero = [g for g in gaps if g > 0]
    assert nonzero == sorted(nonzero), gaps
    fsdp_bf16 = next(r for r in probe["runs"] if r["name"] == "probe-fsdp-bf16")
    assert fsdp_bf16["trainer_vs_itself"]["micro_batch_sizes"] == [1, 8]

    # layouts: benchmarks/layouts.py's figures, and its own record beside the JSON
    summary = parts["layouts"]["summary"]
    assert list(summary) == ["padded", "packed", "budget_64", "budget_packed_64", "budget_128", "budget_packed_128"]
    assert all(layout["wall_median"] > 0 for layout in summary.values())
    assert (tmp_path / "out" / "layouts.json").exists() and (tmp_path / "out" / "gpu_lent_runs.tar.gz").exists()
    assert "torch vs fsdp" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(800)  # ~2 min on an idle 2-core machine (setup and the four train runs)
def test_gpu_lent_check_dry_run_train_part(tmp_path):
    """The train part: DeepSpeed with the transformers sampler; fp16 skipped with its reason where the CPU refuses
    it. Each run's mismatch is finite and >= 0, zero in every figure together or in none (the record's
    `bitwise_on_policy`), the same at ZeRO-2 as at ZeRO-0 on the first step, and fp16's at most bf16's."""
    record, _ = dry_run(tmp_path, "setup,train")
    deepspeed = record["parts"]["setup"]["imports"]["deepspeed"]
    train = record["parts"]["train"]
    runs = {run["name"]: run for run in train["runs"]}
    assert list(runs) == ["train-bf16-zero0", "train-fp16-zero0", "train-bf16-zero2", "train-bf16_fp32head-zero0",
                          "train-bitwise-bf16"]
    bitwise = runs["train-bitwise-bf16"]  # the zero-mismatch arm: every step checked, and every figure 0
    assert [s["agreement_bitwise"] for s in bitwise["per_step"]] == [1.0, 1.0] and bitwise["bitwise_on_policy"]
    figures = ("logprob_abs_diff_mean", "logprob_abs_diff_max", "kl_k3")
    for name, run in runs.items():
        if "skipped" in run:
            assert name == "train-fp16-zero0" and "fp16 unsupported" in run["skipped"], run
            assert deepspeed["fp16_supported"] is False
            continue
        assert run["steps"] == 2 and run["skipped_steps"] == 0 and len(run["per_step"]) == 2, name
        for step in run["per_step"]:
            assert all(math.isfinite(step[k]) and step[k] >= 0 for k in figures), (name, step)
            assert step["logprob_abs_diff_mean"] <= step["logprob_abs_diff_max"], (name, step)
            assert len({step[k] == 0 for k in figures}) == 1, (name, step)  # no gap means no KL, and the reverse
            assert step["seconds"] > 0 and math.isfinite(step["loss"]) and step["grad_norm"] > 0, (name, step)
        assert run["bitwise_on_policy"] == all(s["logprob_abs_diff_max"] == 0 for s in run["per_step"])
        assert run["step_seconds_median"] > 0
        # no op is compiled for the step (torch_adam); only DeepSpeed's CPU shared-memory comm op on this CPU
        assert all("shm_comm" in op for op in run["jit_ops"]), run["jit_ops"]
        assert run["precision_report"]["actual"]["trainer"]["dtype"] == run["precision"][:4]
    assert runs["train-bf16_fp32head-zero0"]["precision_report"]["actual"]["trainer"]["head_dtype"] == "fp32"
    assert runs["train-bf16-zero0"]["precision_report"]["actual"]["trainer"]["head_dtype"] == "bf16"
    # what a size cannot be checked against, the same run can: ZeRO-2 shards the optimizer, not the forward
    assert train["zero2_vs_zero0"]["same"], train["zero2_vs_zero0"]
    if "per_step" in runs["train-fp16-zero0"]:  # fp16 keeps 3 more mantissa bits than bf16
        mean = lambda name: sum(s["logprob_abs_diff_mean"] for s in runs[name]["per_step"])
        assert mean("train-fp16-zero0") <= mean("train-bf16-zero0")
