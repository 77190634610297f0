"""Two FSDP ranks: 2 optimizer steps, a checkpoint (each rank writes its own optimizer shard), 2 more steps;
then fresh trainers restored from the checkpoint take the same 2 steps. Rank 0 writes both results.
Run under torchrun by tests/test_checkpoint.py:

    torchrun --nproc_per_node 2 tests/fsdp_resume.py MODEL_PATH OUT_DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from rlmm.runtime.runtime_env import set_runtime_env

set_runtime_env()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from rlmm.config.options import from_yaml  # noqa: E402
from rlmm.policy.precision import SidePrecision  # noqa: E402
from rlmm.run import checkpoint  # noqa: E402
from rlmm.run.step import rank_share  # noqa: E402
from rlmm.runtime.devices import init_process_group  # noqa: E402
from rlmm.trainers.update import minibatch_step  # noqa: E402
from tests.conftest import sampling  # noqa: E402
from tests.test_checkpoint import RecordingSampler, fixed_rollouts, loss_fn  # noqa: E402


def trainer(model_path: str):
    return from_yaml("trainer", "fsdp", model_path=model_path, precision=SidePrecision("bf16", False),
                     sampling=sampling(max_new_tokens=6), micro_batch_size=2, lr=1e-3, warmup_steps=3)


def main() -> None:
    model_path, out = sys.argv[1], Path(sys.argv[2])
    init_process_group()
    rank = dist.get_rank()
    rollouts = fixed_rollouts(model_path, from_yaml("task", "arithmetic", seed=0, careless_demos=0.0))
    rows = rank_share(list(range(len(rollouts))), rank, dist.get_world_size())  # 4 rows: 2 micro-batches
    first = trainer(model_path)
    for _ in range(2):
        minibatch_step(first, rollouts, rows, loss_fn)
    checkpoint.save(out, 2, first, RecordingSampler())
    for _ in range(2):
        minibatch_step(first, rollouts, rows, loss_fn)
    uninterrupted = {k: v.clone() for k, v in first.state_dict().items()}
    first.close()
    second = trainer(model_path)
    checkpoint.load(checkpoint.latest(out), second, RecordingSampler())
    for _ in range(2):
        minibatch_step(second, rollouts, rows, loss_fn)
    resumed = dict(second.state_dict().items())  # every rank reads: each read is a gather
    if rank == 0:
        differing = [k for k in uninterrupted if not torch.equal(uninterrupted[k], resumed[k])]
        (out / "result.json").write_text(json.dumps({"differing": differing, "keys": len(uninterrupted)}))
    second.close()


if __name__ == "__main__":
    main()
