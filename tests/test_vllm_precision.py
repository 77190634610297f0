"""vLLM reports the precision it really runs (one engine at a time: each test closes its own)."""
import pytest

from rlmm.precision import SidePrecision
from tests.conftest import build_sampler, sampling


@pytest.mark.parametrize("dtype,fp32_head", [("bf16", False), ("fp16", False), ("bf16", True)])
def test_vllm_runs_the_precision_it_is_asked_for(small_model_path, dtype, fp32_head):
    """Each engine reports what it loaded; on this CPU build fp16 stays fp16 (older ones cast it to bf16)."""
    sampler = build_sampler("vllm", small_model_path, SidePrecision(dtype, fp32_head), sampling(), seed=0)
    try:
        assert sampler.actual_precision["dtype"] == dtype
        assert sampler.actual_precision["head_dtype"] == ("fp32" if fp32_head else dtype)
    finally:
        sampler.close()


def test_batch_invariant_mode_is_refused_without_a_gpu(small_model_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("GPU machine: batch-invariant kernels can run")
    with pytest.raises(ValueError, match=r"sampler.batch_invariant: .*need a GPU .*\(allowed here: false\)"):
        build_sampler("vllm", small_model_path, SidePrecision("bf16", False), sampling(), seed=0, batch_invariant=True)


def test_vllm_engine_options_resolve_per_device_and_are_recorded(small_model_path):
    """The null engine options pick the CPU's values and the run's report records what the engine got;
    max_model_len follows the run's longest prompt; sleep mode is refused on a CPU when asked for, and
    a no-op when left to the device (it says so once per process in the log)."""
    import pytest
    import torch

    from rlmm.precision import SidePrecision
    from tests.conftest import build_sampler, sampling

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: the GPU check covers the GPU defaults")
    with pytest.raises(ValueError, match="sampler.sleep_mode: vLLM's sleep mode needs a CUDA GPU"):
        build_sampler("vllm", small_model_path, SidePrecision("bf16", False), sampling(), seed=0, sleep_mode=True)
    sampler = build_sampler("vllm", small_model_path, SidePrecision("bf16", False), sampling(max_new_tokens=8), seed=0,
                     prompt_tokens=12)
    try:
        assert sampler.actual_precision["engine"] == {
            "enforce_eager": True, "enable_prefix_caching": False, "distributed_executor_backend": None,
            "max_model_len": 20, "seed_per_request": True, "sleep_mode": False, "device": "cpu"}
        sampler.sleep()
        assert sampler.generate([[1, 5, 6]], n=2).response_ids  # still generates after a skipped sleep
    finally:
        sampler.close()
