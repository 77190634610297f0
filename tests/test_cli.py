"""Bad input gets one line naming the bad value and the allowed ones, before any work starts."""
import subprocess
import sys

import pytest

from tests.conftest import subprocess_env

CASES = [
    (["sampler=vlm"], "unknown sampler 'vlm' (allowed: hf, vllm)"),
    (["precision=fp8"], "unknown precision 'fp8' (allowed: bf16, bf16_fp32head,"),
    (["trainer=jax"], "unknown trainer 'jax' (allowed: deepspeed, torch)"),
    (["-m", "precision=bf16,fp61"], "unknown precision 'fp61'"),
    (["model=hf", "model.path=/no/such/checkpoint"],
     "model.path: '/no/such/checkpoint' does not exist and is not a Hugging Face hub id"),
    (["model=hf"], "model=hf: missing required key(s) path"),
    (["precision.sampler_dtype=fp8"], "precision.sampler_dtype: unknown precision 'fp8' (allowed: fp32, bf16, fp16)"),
    (["sampling.temprature=0.7"], "Key 'temprature' not in 'SamplingOptions'"),
    (["sampler.kv_cache=2"], "(allowed: batch_invariant, kv_cache_gb,"),
    (["+trainer.zero=3"], "trainer=deepspeed: unknown key 'zero' (allowed: micro_batch_size, zero_stage, lr,"),
    (["trainer.zero_stage=three"], "trainer=deepspeed: Value 'three' of type 'str' could not be converted to Integer"),
    (["probe.num_prompts=many"], "Value 'many' of type 'str' could not be converted to Integer"),
]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlmm.cli", *args], capture_output=True, text=True, timeout=120,
                          env=subprocess_env())


@pytest.mark.parametrize("args,message", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_one_line_error(args, message):
    result = run_cli("probe", *args)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlmm: error: "), result.stderr[-2000:]
    assert message in lines[0]


def test_unknown_command():
    result = run_cli("trian")
    assert result.returncode == 2 and "unknown command 'trian' (allowed: train, probe, table)" in result.stderr


def test_help_lists_commands():
    result = run_cli("--help")
    assert result.returncode == 0 and "probe" in result.stdout


def test_precision_the_trainer_cannot_run_fails_before_any_work():
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().is_fp16_supported():
        pytest.skip("this machine's DeepSpeed accelerator runs fp16")
    result = run_cli("probe", "precision=fp16", "trainer=deepspeed")
    assert result.returncode == 2
    assert result.stderr.strip() == ("rlmm: error: precision: trainer=deepspeed cannot run fp16 on this machine's cpu "
                                     "accelerator (allowed here: fp32, bf16; trainer=torch scores in any)")
