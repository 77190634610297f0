"""Device, process-group and vLLM executor choices (rlmm/devices.py): the decisions a GPU node makes,
checked on a CPU as the pure functions they are."""
import pytest
import torch

from rlmm.devices import process_group_backend, rank_device, vllm_executor_backend


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

    from rlmm.devices import init_process_group, select_device

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert select_device() == torch.device("cpu")
    init_process_group()
    assert dist.is_initialized() and dist.get_backend() == "gloo"
