"""`rlmm probe` end to end: the real CLI, the built-in tiny model, real engines."""
import json
import subprocess
from pathlib import Path
import sys


from tests.conftest import subprocess_env

SMALL = ["probe.num_prompts=8", "probe.samples_per_prompt=2", "probe.trainer_micro_batch_sizes=[1,16]",
         "probe.batch_invariance.num_prompts=2", "probe.batch_invariance.num_completions=3",
         "probe.batch_invariance.max_batch_size=8"]


def run_probe(tmp_path, *overrides: str) -> dict:
    result = subprocess.run([sys.executable, "-m", "rlmm.cli", "probe", *SMALL, *overrides, f"hydra.run.dir={tmp_path}"],
                            capture_output=True, text=True, timeout=900, env=subprocess_env())
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert (tmp_path / "probe.png").stat().st_size > 10_000
    record = json.loads((tmp_path / "probe.json").read_text())
    record["stdout"] = result.stdout
    return record


def test_default_probe_vllm_deepspeed(tmp_path):
    """The built-in default: vLLM bf16 sampler, DeepSpeed fp32 trainer, W&B offline."""
    record = run_probe(tmp_path)
    assert record["choices"]["sampler"] == "vllm" and record["choices"]["trainer"] == "deepspeed"
    assert record["precision"]["actual"]["sampler"]["dtype"] == "bf16"
    assert record["precision"]["actual"]["trainer"]["dtype"] == "fp32"
    assert record["precision"]["silent_casts"] == []
    metrics = record["sampler_vs_trainer"]
    assert metrics["num_tokens"] > 0 and metrics["logprob_abs_diff_mean"] > 0  # bf16 vs fp32 differ
    assert record["trainer_vs_itself"]["logprob_abs_diff_mean"] < metrics["logprob_abs_diff_mean"]
    assert 0 <= record["rollouts"]["mean_reward"] <= 1
    assert "sampler vs trainer" in record["stdout"] and "kl_k3" in record["stdout"]
    assert list((tmp_path / "wandb").glob("offline-run-*")), "W&B offline run directory missing"
    assert "WANDB_API_KEY" not in (tmp_path / "probe.json").read_text()


def test_fp32_hf_sampler_vs_fp32_trainer_is_near_zero(tmp_path, small_model_path):
    """Any Hugging Face checkpoint directory works as model=hf."""
    record = run_probe(tmp_path, "model=hf", f"model.path={small_model_path}", "sampler=hf", "trainer=torch",
                       "precision=fp32", "logger=none")
    assert record["model_path"] == small_model_path
    assert record["precision"]["actual"]["sampler"] == {"dtype": "fp32", "head_dtype": "fp32"}
    assert record["sampler_vs_trainer"]["logprob_abs_diff_max"] < 1e-4
    assert record["sampler_vs_itself"]["unique_greedy_completions"] >= 1


def test_gsm8k_task_with_longer_answers(tmp_path, small_model_path):
    """Word problems from a local JSONL file (the arithmetic-trained model answers them badly, which is
    fine: the probe measures mismatch, not skill)."""
    data = Path(__file__).parent / "data" / "gsm8k_sample.jsonl"
    record = run_probe(tmp_path, "model=hf", f"model.path={small_model_path}", "task=gsm8k", f"task.path={data}",
                       "sampler=hf", "trainer=torch", "precision=bf16_sampler_fp32_trainer", "logger=none",
                       "sampling.max_new_tokens=32", "probe.num_prompts=2", "probe.split=test")
    profile = record["position_profile"]
    assert sum(profile["num_tokens"]) == record["sampler_vs_trainer"]["num_tokens"]  # every token in a bucket
    assert len(profile["bucket_start"]) <= 8
    assert record["sampler_vs_trainer"]["logprob_abs_diff_mean"] > 0
