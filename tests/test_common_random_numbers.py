"""Common random numbers: two arms of one seed differ only in the axis being compared. Before the first
update they see the same starting model (the same greedy evaluation), the same prompts and the same
sampler draws, so a sweep's comparison between arms is paired."""
from __future__ import annotations

import subprocess
import sys

from tests.conftest import subprocess_env


def test_two_arms_of_one_seed_draw_the_same_prompts_and_responses(small_model_path, tmp_path):
    arms = {}
    for correction in ("none", "icepop"):
        record = tmp_path / f"{correction}.tsv"
        result = subprocess.run(
            [sys.executable, "-m", "rlmm.cli", "train", "model=hf", f"model.path={small_model_path}", "sampler=hf",
             "trainer=torch", f"correction={correction}", "seed=5", "task._target_=tests.recording.RecordedDraws",
             f"+task.record_file={record}", "debug=train", f"hydra.run.dir={tmp_path / correction}"],
            capture_output=True, text=True, timeout=600, env=subprocess_env(), stdin=subprocess.DEVNULL)
        assert result.returncode == 0, result.stderr[-3000:]
        arms[correction] = record.read_text().splitlines()
    # debug=train: step 0's evaluation on 4 prompts by both policies (the sampler, the trainer's weights),
    # then step 1's 2 prompts x 2 samples
    before_the_first_update = 2 * 4 + 2 * 2
    assert len(arms["none"]) > before_the_first_update
    assert arms["none"][:before_the_first_update] == arms["icepop"][:before_the_first_update]
    assert len({line.split("\t")[0] for line in arms["none"][8:12]}) == 2  # two prompts, two samples each
