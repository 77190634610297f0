"""DeepSpeed with several ranks, run under torchrun by tests/test_deepspeed_ranks.py (2 gloo ranks; called
in-process with one rank too):

    torchrun --nproc_per_node 2 tests/deepspeed_ranks.py MODEL_PATH OUT_DIR

- ZeRO 0, 1 and 2 (and ZeRO-1 summing in fp32, scale=gpu's: DeepSpeed's BF16_Optimizer), a bf16 body with an
  fp32 head: one step, each rank on rows of its own; every collective that carries the head's gradient is
  counted (`head_reductions`), and each rank writes its local head gradient and the reduced one to
  OUT_DIR/head-<layout>-rank<rank>.pt.
- ZeRO-3 (`zero3_weights`): after a step, the weights as `trainer.state_dict()` hands them out (gathered one
  at a time as they are read) against the old full gather of every parameter; OUT_DIR/zero3-rank<rank>.json.
"""
from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from rlmm.runtime.runtime_env import set_runtime_env

set_runtime_env()

import torch  # noqa: E402

from rlmm.config.options import from_yaml  # noqa: E402
from rlmm.policy.precision import SidePrecision  # noqa: E402
from rlmm.policy.rollouts import Rollouts  # noqa: E402

COLLECTIVES = ("all_reduce", "reduce", "reduce_scatter_tensor", "all_reduce_coalesced")
# name -> ZeRO stage and other trainer values
HEAD_LAYOUTS = {"zero0": {"zero_stage": 0}, "zero1": {"zero_stage": 1}, "zero2": {"zero_stage": 2},
                "zero1-fp32-sums": {"zero_stage": 1, "grad_accum_dtype": "fp32", "reduce_dtype": "fp32"}}


def rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def own_rows(rank: int) -> Rollouts:
    """4 rows whose responses depend on the rank, so the ranks' gradients differ."""
    responses = [[8 + rank, 9 + i, 10 + rank * i, 11] for i in range(4)]
    return Rollouts(prompt_ids=[[1, 5, 6, 7]] * 4, response_ids=responses, sampler_logprobs=[torch.zeros(4)] * 4,
                    finish_reasons=["stop"] * 4)


@contextlib.contextmanager
def head_reductions(param: torch.nn.Parameter, counted: list[str]):
    """Count the collectives (torch.distributed's, which DeepSpeed's TorchBackend and rlmm both call) whose
    tensor is the head's gradient or a copy of it (DeepSpeed flattens a bucket, casts it to
    `communication_data_type` and divides it by the world size first)."""
    import torch.distributed as dist

    world = rank_and_world()[1]
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def carries(tensor) -> bool:
        grad = param.grad
        if not isinstance(tensor, torch.Tensor) or grad is None or tensor.numel() != grad.numel():
            return False
        sent, own = tensor.detach().double().flatten(), grad.detach().double().flatten()
        tolerance = 1e-2 * own.abs().max().item()
        return any(torch.allclose(sent * factor, own, rtol=1e-2, atol=tolerance) for factor in {1, world})

    def counting(name, original):
        def collective(*args, **kwargs):
            tensors = [*args[:2], *kwargs.values()]
            flat = [t for x in tensors for t in (x if isinstance(x, (list, tuple)) else [x])]
            if any(carries(t) for t in flat):
                counted.append(name)
            return original(*args, **kwargs)
        return collective

    for name, original in originals.items():
        setattr(dist, name, counting(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def head_step(model_path: str, layout: str) -> dict:
    """One step with an fp32 head, the trainer as `HEAD_LAYOUTS[layout]`; returns the count of head reductions
    and the head's local (this rank's, summed over its micro-batches) and reduced gradients."""
    rank, world = rank_and_world()
    trainer = from_yaml("trainer", "deepspeed", model_path=model_path, precision=SidePrecision("bf16", True),
                        sampling=_options(), micro_batch_size=2, lr=1e-3, **HEAD_LAYOUTS[layout])
    try:
        param = trainer.head_optimizer.param
        local = {}
        hook = param.register_post_accumulate_grad_hook(lambda p: local.update(grad=p.grad.detach().clone()))
        rollouts, counted = own_rows(rank), []
        update = trainer.begin_update(rollouts, list(range(len(rollouts))))
        with head_reductions(param, counted):
            for micro in update.micro_batches:
                logprobs, _ = update.forward(micro)
                update.backward(-logprobs.sum() / (4 * world))
        reduced = param.grad.detach().clone()
        hook.remove()
        metrics = update.step()
        assert metrics["skipped"] == 0
        return {"count": len(counted), "names": counted, "local": local["grad"], "reduced": reduced}
    finally:
        trainer.close()


def zero3_weights(model_path: str) -> dict:
    """After one step at ZeRO-3: do the weights read one at a time equal the old full gather, name for name
    in the same order, and does the NaN guard pass them?"""
    import deepspeed

    from rlmm.trainers.weight_sync import weights_finite

    rank, _ = rank_and_world()
    trainer = from_yaml("trainer", "deepspeed", model_path=model_path, precision=SidePrecision("fp32", False),
                        sampling=_options(), micro_batch_size=2, zero_stage=3, lr=1e-3)
    try:
        from rlmm.trainers.update import minibatch_step

        rollouts = own_rows(rank)
        minibatch_step(trainer, rollouts, list(range(4)), lambda m, lp, e: (-lp.sum() / 8, {}))
        lazy = trainer.state_dict()
        finite = weights_finite(lazy)
        read = [(name, value.clone()) for name, value in lazy.items()]
        module = trainer.engine.module
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            full = [(k, v.detach().clone()) for k, v in module.state_dict().items()]
        return {"finite": finite, "same_names": [k for k, _ in read] == [k for k, _ in full],
                "same_values": all(torch.equal(a, b) for (_, a), (_, b) in zip(read, full)),
                "moved": bool(any(v.abs().sum() > 0 for _, v in read)), "names": len(read)}
    finally:
        trainer.close()


def _options():
    from rlmm.policy.rollouts import SamplingOptions

    return SamplingOptions(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=4, logprobs="processed",
                           support=from_yaml("support", "sampler"))


def main() -> None:
    from rlmm.runtime.devices import init_process_group

    model_path, out = sys.argv[1], Path(sys.argv[2])
    init_process_group()
    rank, _ = rank_and_world()
    for layout in HEAD_LAYOUTS:
        torch.save(head_step(model_path, layout), out / f"head-{layout}-rank{rank}.pt")
    (out / f"zero3-rank{rank}.json").write_text(json.dumps(zero3_weights(model_path)))


if __name__ == "__main__":
    main()
