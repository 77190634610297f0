"""DeepSpeed across ranks: the fp32 head's gradient is averaged exactly once at every ZeRO stage it runs at,
and ZeRO-3's weights are gathered one tensor at a time as they are read (tests/deepspeed_ranks.py runs the
2-rank halves under torchrun)."""
from __future__ import annotations

import json

import pytest
import torch

from rlmm.config.options import from_yaml
from rlmm.policy.precision import SidePrecision
from rlmm.trainers.update import minibatch_step
from tests.conftest import sampling, torchrun


def test_the_fp32_heads_gradient_is_averaged_once_at_every_stage_and_not_at_all_on_one_rank(small_model_path,
                                                                                            tmp_path):
    """2 gloo ranks, a bf16 body with an fp32 head, each rank on rows of its own: at ZeRO 0, 1 and 2 (and ZeRO-1
    summing in fp32) exactly one collective carries the head's gradient, and every rank ends with the same head
    gradient, the mean of the ranks' own to fp32 rounding. Before: at ZeRO-0 two did (DeepSpeed's backward all-reduce walks every
    module parameter, the head included, then rlmm's FP32HeadOptimizer averaged it again), and the first,
    in DeepSpeed's communication_data_type (bf16), rounded the fp32 head's gradient to bf16. One rank: none."""
    from tests.deepspeed_ranks import HEAD_LAYOUTS, head_step

    alone = head_step(small_model_path, "zero0")
    assert alone["count"] == 0 and torch.equal(alone["reduced"], alone["local"])

    torchrun(["tests/deepspeed_ranks.py", small_model_path, str(tmp_path)], timeout=900)
    for layout in HEAD_LAYOUTS:
        ranks = [torch.load(tmp_path / f"head-{layout}-rank{r}.pt") for r in (0, 1)]
        assert [r["count"] for r in ranks] == [1, 1], (layout, [r["names"] for r in ranks])
        assert not torch.equal(ranks[0]["local"], ranks[1]["local"])  # the ranks' own gradients differ
        assert torch.equal(ranks[0]["reduced"], ranks[1]["reduced"]), layout
        mean = (ranks[0]["local"] + ranks[1]["local"]) / 2
        assert torch.allclose(ranks[0]["reduced"], mean, rtol=1e-6, atol=1e-9), (
            layout, (ranks[0]["reduced"] - mean).abs().max().item())
    for rank in (0, 1):  # the ZeRO-3 half, for test_zero3_weights_are_gathered_one_at_a_time_as_they_are_read
        report = json.loads((tmp_path / f"zero3-rank{rank}.json").read_text())
        assert report == {"finite": True, "same_names": True, "same_values": True, "moved": True,
                          "names": report["names"]} and report["names"] > 0, report


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_zero3_weights_are_gathered_one_at_a_time_as_they_are_read(small_model_path, arithmetic_task, tmp_path,
                                                                   monkeypatch, tied):
    """`trainer.state_dict()` at ZeRO-3 gathers each parameter only when it is read, one at a time, and its
    values and names (a tied head under both of its names) are those of the old full gather (two full copies
    at once: every parameter gathered, then cloned). The NaN guard reads this rank's partitions only."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from rlmm.trainers.weight_sync import weights_finite
    from tests.test_checkpoint import fixed_rollouts, loss_fn
    from tests.test_tied_weights import tied_model

    path = small_model_path
    if tied:
        from transformers import AutoTokenizer

        path = tied_model(tmp_path / "tied")
        AutoTokenizer.from_pretrained(small_model_path).save_pretrained(path)
    trainer = from_yaml("trainer", "deepspeed", model_path=path, precision=SidePrecision("fp32", False),
                        sampling=sampling(max_new_tokens=6), micro_batch_size=4,
                        zero_stage=3, lr=1e-3)
    try:
        minibatch_step(trainer, fixed_rollouts(small_model_path, arithmetic_task), list(range(8)), loss_fn)
        module = trainer.engine.module
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            full = {k: v.detach().clone() for k, v in module.state_dict().items()}

        gathered_at_once = []
        real = deepspeed.zero.GatheredParameters

        class Counting(real):
            def __enter__(self):
                entered = super().__enter__()
                gathered_at_once.append(sum(p.ds_status == ZeroParamStatus.AVAILABLE for p in module.parameters()))
                return entered

        monkeypatch.setattr(deepspeed.zero, "GatheredParameters", Counting)
        weights = trainer.state_dict()
        assert weights_finite(weights) and not gathered_at_once  # nothing gathered for the guard
        read = {}
        for name, value in weights.items():
            read[name] = value
            assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in module.parameters()), name
        assert list(read) == list(full)
        assert all(torch.equal(read[k], full[k]) for k in full)
        assert len(gathered_at_once) == len(full) and max(gathered_at_once) == 1, gathered_at_once
        if tied:
            assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(read)
            assert torch.equal(read["lm_head.weight"], read["model.embed_tokens.weight"])
        next(iter(module.parameters())).ds_tensor[0] = float("nan")
        assert not weights_finite(trainer.state_dict())
    finally:
        trainer.close()
