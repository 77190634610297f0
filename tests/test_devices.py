"""Device, process-group and vLLM executor choices (rlmm/runtime/devices.py): the decisions a GPU node makes,
checked on a CPU as the pure functions they are."""
import os

import pytest
import torch

from rlmm.runtime.devices import process_group_backend, rank_device, vllm_executor_backend


def test_each_rank_gets_its_own_gpu_and_cpus_stay_cpus():
    assert rank_device(0, cuda_devices=0) == torch.device("cpu")
    assert rank_device(3, cuda_devices=0) == torch.device("cpu")
    assert [rank_device(r, cuda_devices=4) for r in range(4)] == [torch.device("cuda", r) for r in range(4)]
    with pytest.raises(ValueError, match="LOCAL_RANK 4: this node has 4 visible GPU"):
        rank_device(4, cuda_devices=4)


def test_process_group_carries_cpu_tensors_on_gpu_nodes():
    assert process_group_backend(cuda=False) == "gloo"
    assert process_group_backend(cuda=True) == "cpu:gloo,cuda:nccl"  # rlmm all-reduces CPU flags and metrics


def test_several_ranks_join_one_world_through_vllms_external_launcher():
    assert vllm_executor_backend(1) is None
    assert vllm_executor_backend(2) == vllm_executor_backend(8) == "external_launcher"


def test_this_machine_selects_the_cpu_and_a_gloo_group(monkeypatch):
    """On this CPU machine: select_device gives the CPU, and the group rlmm starts (if none runs yet) is gloo."""
    import torch.distributed as dist

    from rlmm.runtime.devices import init_process_group, select_device

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert select_device() == torch.device("cpu")
    init_process_group()
    assert dist.is_initialized() and dist.get_backend() == "gloo"


FREED_BLOCKS_STAY_RESIDENT = """
import ctypes, sys
import psutil
if sys.argv[1] == "rlmm":
    from rlmm.runtime.runtime_env import return_freed_blocks_to_the_os
    return_freed_blocks_to_the_os()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
rss = lambda: psutil.Process().memory_info().rss
libc.free(libc.malloc(8 << 20))  # freeing an mmapped 8 MiB block raises glibc's threshold past 2 MiB
blocks = [libc.malloc(2 << 20) for _ in range(200)]  # 400 MiB, like a step's activations
for block in blocks:
    ctypes.memset(block, 1, 2 << 20)
before = rss()
for block in blocks[:-1]:  # the last one stays (a heap cannot shrink below a live block)
    libc.free(block)
print((before - rss()) / 2 ** 20)
"""


def test_freed_blocks_go_back_to_the_os():
    """With glibc's default, 2 MiB blocks freed after a larger one come from its heap and stay resident;
    rlmm's mmap threshold returns them to the OS (2.3 GiB of the 0.5B fp32 train run's peak)."""
    import subprocess
    import sys

    from tests.conftest import subprocess_env

    # glibc's own malloc with its defaults: no threshold from this process, no preloaded allocator (vLLM's
    # CPU platform adds its tcmalloc to LD_PRELOAD where its wheel bundles one)
    env = {k: v for k, v in subprocess_env().items() if k not in ("MALLOC_MMAP_THRESHOLD_", "LD_PRELOAD")}

    def released_mib(mode):
        result = subprocess.run([sys.executable, "-c", FREED_BLOCKS_STAY_RESIDENT, mode], capture_output=True,
                                text=True, timeout=120, env=env, check=True)
        return float(result.stdout)

    assert released_mib("glibc") < 50  # the premise: without it they stay
    assert released_mib("rlmm") > 350


LONG_BF16_ATTENTION = """
import os
from rlmm.runtime.runtime_env import hold_onednn_below_amx_for_a_forced_capability
hold_onednn_below_amx_for_a_forced_capability()
import torch
q = torch.randn(2, 2, 320, 64, dtype=torch.bfloat16)
mask = torch.ones(2, 1, 320, 320, dtype=torch.bool).tril()
torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
print(torch.backends.cpu.get_cpu_capability(), os.environ.get("ONEDNN_MAX_CPU_ISA", "unset"))
"""


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_a_forced_aten_capability_runs_long_bf16_attention(capability):
    """ATEN_CPU_CAPABILITY alone leaves oneDNN on AMX where the CPU has it, and SDPA's bf16 flash kernel then
    fails at ~300 tokens (pack_vnni2 below AVX-512). rlmm holds oneDNN below AMX there, and only there."""
    import subprocess
    import sys

    from rlmm.runtime import cpu
    from rlmm.runtime.runtime_env import ONEDNN_ISA_BELOW_AMX
    from tests.conftest import subprocess_env

    env = {k: v for k, v in subprocess_env().items() if k != "ONEDNN_MAX_CPU_ISA"}
    env["ATEN_CPU_CAPABILITY"] = capability
    result = subprocess.run([sys.executable, "-c", LONG_BF16_ATTENTION], capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    expected_isa = ONEDNN_ISA_BELOW_AMX if cpu.features().amx else "unset"
    assert result.stdout.split()[-2:] == [capability.upper(), expected_isa]


COMPILED_COUNT = """
from rlmm.runtime.runtime_env import set_runtime_env
set_runtime_env()
import torch

@torch.compile
def count_above(x, y):  # a vectorized int64 reduction, like vLLM's sampler's compiled ops
    return (x > y[:, None]).sum(-1)

print(count_above(torch.ones(4, 100), torch.zeros(4)).tolist())
"""


@pytest.mark.slow  # two processes' torch.compile: ~40 s
def test_compiled_kernels_of_the_native_capability_are_not_reused_under_a_forced_one(tmp_path):
    """torch.compile's cache key leaves ATEN_CPU_CAPABILITY out: a kernel cached natively (vectorized for the
    CPU's ISA) failed to compile under `default` ("'at::vec' has not been declared"), and with it every vLLM
    test of a `default` run after a native one on the same machine. rlmm keeps each capability's cache apart."""
    import subprocess
    import sys

    from tests.conftest import subprocess_env

    env = {k: v for k, v in subprocess_env().items() if k not in ("ATEN_CPU_CAPABILITY", "TORCHINDUCTOR_CACHE_DIR")}
    env["TMPDIR"] = str(tmp_path)  # inductor's default cache folder is under it
    for capability in (None, "default"):
        run_env = env if capability is None else {**env, "ATEN_CPU_CAPABILITY": capability}
        result = subprocess.run([sys.executable, "-c", COMPILED_COUNT], capture_output=True, text=True, timeout=300,
                                env=run_env)
        assert result.returncode == 0, (capability, result.stderr[-2000:])
        assert result.stdout.split("\n")[-2] == "[100, 100, 100, 100]"
    assert len(list(tmp_path.glob("torchinductor_*"))) == 2  # the native cache and `default`'s


def test_a_forced_capability_has_its_own_compile_cache_unless_one_is_set(monkeypatch):
    from rlmm.runtime.runtime_env import set_runtime_env

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    set_runtime_env()
    assert os.path.basename(os.environ["TORCHINDUCTOR_CACHE_DIR"]).endswith("_default")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/mine")
    set_runtime_env()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/mine"
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    set_runtime_env()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def test_a_set_onednn_isa_or_the_machines_own_capability_is_left_alone(monkeypatch):
    from rlmm.runtime.runtime_env import hold_onednn_below_amx_for_a_forced_capability

    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    hold_onednn_below_amx_for_a_forced_capability()
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE"
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")
    hold_onednn_below_amx_for_a_forced_capability()
    assert "ONEDNN_MAX_CPU_ISA" not in os.environ


def test_ranks_that_exit_with_their_group_alive_exit_cleanly():
    # Without the group destroyed at exit, 7 in 10 of these five-rank runs aborted (SIGABRT) as they exited
    # here, so three clean runs in a row leave a broken rlmm.runtime.devices ~3% to pass.
    from tests.conftest import torchrun

    for _ in range(3):
        torchrun(["tests/gloo_exit.py"], ranks=5, timeout=120)
