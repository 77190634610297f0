"""vLLM reports the precision it really runs (one engine at a time: each test closes its own)."""
import pytest

from rlmm.policy.precision import SidePrecision
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
    with pytest.raises(ValueError, match=r"sampler.batch_invariant: .*need a GPU .*\(allowed here: false; sampler=bitwise is the bitwise arm"):
        build_sampler("vllm", small_model_path, SidePrecision("bf16", False), sampling(), seed=0, batch_invariant=True)


def test_vllm_engine_options_resolve_per_device_and_are_recorded(small_model_path):
    """The null engine options pick the CPU's values and the run's report records what the engine got;
    max_model_len follows the run's longest prompt (+ max_new_tokens + 1, for a prefill re-scoring); seeded requests
    on a CPU prefill each prompt whole (vLLM-CPU cannot split a seeded request's prefill); sleep mode
    is refused on a CPU when asked for, and a no-op when left to the device (it says so once per process in the
    log)."""
    import pytest
    import torch

    from rlmm.policy.precision import SidePrecision
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
            "enable_chunked_prefill": False, "max_num_batched_tokens": 2048,  # seeded requests on a CPU: whole prefills
            "max_model_len": 21, "kv_cache_bytes": 2**30, "seed_per_request": True, "threads": None, "sleep_mode": False,
            "untied_head": False, "capture_routing": False, "kept_sets": "none (no truncation)", "device": "cpu"}
        sampler.sleep()
        assert sampler.generate([[1, 5, 6]], n=2).response_ids  # still generates after a skipped sleep
    finally:
        sampler.close()


def test_batch_invariant_kernels_are_reported_on_both_sides(small_model_path, monkeypatch):
    """vLLM's batch-invariant mode replaces aten ops for the whole process, so the trainer beside the sampler
    runs them too; the run's precision report must say so for the trainer, not only for the sampler. The
    sampler reads the mode vLLM has installed (its process-wide flag, set here as
    `enable_batch_invariant_mode` sets it: the kernels themselves need a GPU)."""
    from vllm.model_executor.determinism import batch_invariant

    from rlmm.policy.precision import PrecisionPolicy, check_precision
    from rlmm.samplers.vllm import batch_invariant_mode

    policy = PrecisionPolicy("bf16", "bf16", False, False, False)
    trainer = {"dtype": "bf16", "head_dtype": "bf16"}
    off = check_precision(policy, {"dtype": "bf16", "head_dtype": "bf16", "batch_invariant": "false"}, trainer)
    assert off["actual"]["trainer"]["batch_invariant"] == "false"
    assert not batch_invariant_mode()
    monkeypatch.setattr(batch_invariant, "_batch_invariant_MODE", True)
    assert batch_invariant_mode()
    on = check_precision(policy, {"dtype": "bf16", "head_dtype": "bf16", "batch_invariant": str(batch_invariant_mode()).lower()},
                         trainer)
    assert on["actual"]["sampler"]["batch_invariant"] == on["actual"]["trainer"]["batch_invariant"] == "true"
    assert "batch_invariant" not in trainer  # the trainer's own record is not changed in place


def test_the_kv_cache_is_sized_by_the_run_not_by_the_gpus_memory(tmp_path):
    """On a GPU vLLM's default KV cache is most of `gpu_memory_utilization` (about 65 GB of an H200) for a run
    that holds ~0.1M tokens: rlmm sizes it from the run, rows x (prompt + max_new_tokens) in whole 16-token
    blocks, at 2 x layers x KV heads x head dim x bytes a token (Qwen2.5-0.5B in bf16: 12,288 bytes)."""
    from transformers import Qwen2Config

    from rlmm.samplers.vllm import kv_cache_size

    Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2).save_pretrained(tmp_path)
    bf16 = SidePrecision("bf16", False)
    # scale=gpu's train step: 16 prompts x 8 samples of up to ~200 + 512 tokens
    gpu = kv_cache_size(str(tmp_path), bf16, max_model_len=712, max_rows=128, kv_cache_gb=None, cuda=True)
    assert gpu == 128 * 45 * 16 * 12288  # 45 blocks of 16 tokens hold 712
    assert gpu < 1.2e9
    assert kv_cache_size(str(tmp_path), bf16, 712, 8, kv_cache_gb=None, cuda=False) == 2**30  # CPU: at least 1 GiB
    assert kv_cache_size(str(tmp_path), bf16, 712, 128, kv_cache_gb=None, cuda=False) == gpu
    assert kv_cache_size(str(tmp_path), bf16, 712, 128, kv_cache_gb=2.5, cuda=True) == int(2.5 * 2**30)
    assert kv_cache_size(str(tmp_path), bf16, None, 128, kv_cache_gb=None, cuda=True) is None  # vLLM's own sizing
    with pytest.raises(ValueError, match=r"sampler.kv_cache_gb: must be > 0 or null"):
        build_sampler("vllm", str(tmp_path), bf16, sampling(), seed=0, kv_cache_gb=0)
    with pytest.raises(ValueError, match=r"sampler.sleep_level: unknown level 3 \(allowed: 1, 2\)"):
        build_sampler("vllm", str(tmp_path), bf16, sampling(), seed=0, sleep_level=3)
