"""vLLM reports the precision it really runs (one engine at a time: each test closes its own)."""
import pytest

from rlmm.precision import SidePrecision
from tests.conftest import sampling


@pytest.mark.parametrize("dtype,fp32_head", [("bf16", False), ("fp16", False), ("bf16", True)])
def test_vllm_runs_the_precision_it_is_asked_for(small_model_path, dtype, fp32_head):
    """Each engine reports what it loaded; on this CPU build fp16 stays fp16 (older ones cast it to bf16)."""
    from rlmm.samplers.vllm import VLLMSampler

    sampler = VLLMSampler(small_model_path, SidePrecision(dtype, fp32_head), sampling(), seed=0)
    try:
        assert sampler.actual_precision["dtype"] == dtype
        assert sampler.actual_precision["head_dtype"] == ("fp32" if fp32_head else dtype)
    finally:
        sampler.close()


def test_batch_invariant_mode_is_refused_without_a_gpu(small_model_path):
    import torch

    from rlmm.samplers.vllm import VLLMSampler

    if torch.cuda.is_available():
        pytest.skip("GPU machine: batch-invariant kernels can run")
    with pytest.raises(ValueError, match=r"sampler.batch_invariant: .*need a GPU .*\(allowed here: false\)"):
        VLLMSampler(small_model_path, SidePrecision("bf16", False), sampling(), seed=0, batch_invariant=True)
