"""Several ranks sample what one rank samples: each request is seeded by its prompt's place in the whole
step (rlmm/samplers/base.py::request_seed), not by its place in the rank's share, so the split over ranks
changes no draw and no two requests of a step share their random numbers."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from tests.conftest import torchrun


def draws(path: Path) -> list[tuple[str, str]]:
    """The (prompt, completion) pairs a rank rewarded in training (the greedy evaluation's left out)."""
    from rlmm.tasks.arithmetic import _in_test_split

    pairs = [tuple(line.split("\t")) for line in path.read_text().splitlines()]
    return [(prompt, completion) for prompt, completion in pairs if not _in_test_split(prompt)]


def run_first_step(model_path: str, record_dir: Path, ranks: int, run_dir: Path) -> None:
    record_dir.mkdir()
    torchrun(["-m", "rlmm.cli", "train", "model=hf", f"model.path={model_path}",
              "task._target_=tests.recording.RepeatedPromptDraws", f"+task.record_dir={record_dir}", "train.steps=1",
              "train.eval_prompts=4", "train.eval_trained_weights=false", "train.prompts_per_step=4",
              "algo.group_size=8", "sampling.temperature=1.5", "precision=fp32", "logger=none",
              "train.checkpoint_every=0", f"hydra.run.dir={run_dir}"], ranks=ranks)


def test_two_ranks_sample_what_one_rank_samples_and_never_share_noise(small_model_path, tmp_path):
    """Step 1 of a run whose prompts are [P, P, Q, R]: one rank draws 8 responses to each; two ranks draw
    (P, Q) on rank 0 and (P, R) on rank 1. The two runs must draw the same responses to each prompt (the
    sampler is fp32 vLLM with seeded requests; the first step samples the checkpoint's weights), and the two
    ranks' responses to P must differ (before the fix rank 1's first request had rank 0's seed and drew the
    same 8 responses)."""
    run_first_step(small_model_path, tmp_path / "one", 1, tmp_path / "run1")
    run_first_step(small_model_path, tmp_path / "two", 2, tmp_path / "run2")
    one = draws(tmp_path / "one" / "rank0.txt")
    rank0, rank1 = draws(tmp_path / "two" / "rank0.txt"), draws(tmp_path / "two" / "rank1.txt")
    assert len(one) == 32 and len(rank0) == len(rank1) == 16
    assert Counter(one) == Counter(rank0 + rank1), "a 2-rank step drew other responses than the 1-rank step"
    shared = rank0[0][0]
    assert rank1[0][0] == shared  # both ranks were given P
    on_rank0 = Counter(c for p, c in rank0 if p == shared)
    on_rank1 = Counter(c for p, c in rank1 if p == shared)
    assert on_rank0 != on_rank1, f"both ranks drew the same responses to {shared!r}: {on_rank0}"
