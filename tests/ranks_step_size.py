"""The step-size factor on two ranks: each rank scores its own rows (`OldPolicy.score`), and both must step with
the same factor, the whole batch's. Run by tests/test_corrections_step_size.py:

    torchrun --nproc_per_node 2 tests/ranks_step_size.py

Checks, on each rank: VCPO's factor is the one a single process computes from every row (the sequences of both
ranks weigh in the ESS); a correction whose answer depends on the rank gets the smallest of the ranks' answers.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from rlmm.corrections.base import Correction, StepSize
from rlmm.corrections.vcpo import EffectiveSampleSizeStep, ess_ratio
from rlmm.run.step import OldPolicy


class RankDependent(Correction):
    """0.5 on rank 0, 0.8 on rank 1: what ranks that disagreed would answer."""

    def step_size(self, batch):
        return StepSize(scale=0.5 if dist.get_rank() == 0 else 0.8)


def rows(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank 0: three rows with S = 0 (w = 1); rank 1: one row with S = log 9 and width 4 (the ranks' shapes differ)."""
    if rank == 0:
        trainer = torch.full((3, 2), -1.0)
        return trainer, trainer.clone(), torch.ones(3, 2, dtype=torch.bool)
    trainer = torch.tensor([[-1.0 + math.log(9), -1.0, -1.0, -1.0]])
    return trainer, torch.full((1, 4), -1.0), torch.ones(1, 4, dtype=torch.bool)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    trainer, sampler, mask = rows(rank)
    advantages = torch.zeros_like(trainer)

    def factor(correction) -> float:
        return OldPolicy.score(trainer, sampler, mask, advantages, torch.ones(mask.size(0)), correction,
                               ratio_cap=2.0, also_checked={}).lr_scale

    # every row in one process: w = (1, 1, 1, 9), rho = 12^2 / (4 x 84) = 3/7
    whole = ess_ratio(torch.tensor([[-1.0, -1.0, -1.0, -1.0]] * 3 + [[-1.0 + math.log(9), -1.0, -1.0, -1.0]]),
                      torch.full((4, 4), -1.0), torch.tensor([[1, 1, 0, 0]] * 3 + [[1, 1, 1, 1]], dtype=torch.bool))
    assert abs(whole - 3 / 7) < 1e-6, whole  # log 9 in float32
    got = factor(EffectiveSampleSizeStep(rho_target=1.0, power=0.5, cap=None))
    assert abs(got - math.sqrt(whole)) < 1e-12, (rank, got, math.sqrt(whole))
    assert factor(RankDependent()) == 0.5, rank
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
