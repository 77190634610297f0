"""Why `bypass` hurts PPO here: the same runs with PPO's clip range changed, paired by seed.

    .venv/bin/python experiments/tis_under_mismatch/analyze_clip.py SWEEP [SWEEP ...]

The sweeps' PPO runs (`algo=ppo`) are grouped into arms by correction and clip range (`algo.objective.clip_low`,
`algo.objective.clip_high`, or `algo.clip_low`, `algo.clip_high` as runs before issue 51 spelled them; a run without
them has conf/algo/ppo.yaml's). Per arm: mean over seeds of the run's mean share of tokens
whose gradient the clip removed (`loss/clipfrac`), of the mean sampled reward, and of the trained weights'
mean held-out accuracy; then each bypass arm's per-seed difference from `correction=none` and from
`bypass` at the default clip, mean and 95% paired-t interval with its p (scipy), as in analyze.py.
"""
from __future__ import annotations

import sys

import pandas as pd
from omegaconf import OmegaConf

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from analyze import mean, paired  # noqa: E402  (this folder's analyze.py)

from rlmm.config.options import CONF_DIR  # noqa: E402
from rlmm.table.frames import load_runs  # noqa: E402

METRICS = {"loss/clipfrac:mean": "clipped", "rollout/reward_mean:mean": "reward",
           "eval/accuracy_trained:mean": "trained acc."}


def main(sweeps: list[str]) -> None:
    runs = load_runs(sweeps)
    runs = runs[(runs.status == "complete") & (runs.algo == "ppo")]
    ppo = OmegaConf.load(CONF_DIR / "algo" / "ppo.yaml")  # the clip a run without the override had
    unset = pd.Series("(default)", index=runs.index)
    for key in ("clip_low", "clip_high"):
        new, old = runs.get(f"algo.objective.{key}", unset), runs.get(f"algo.{key}", unset)  # old: before issue 51
        runs[key] = new.where(new != "(default)", old).replace("(default)", str(ppo.objective[key]))
    runs["arm"] = runs.correction + " clip " + runs.clip_low + "/" + runs.clip_high
    default_clip = f"clip {ppo.objective.clip_low}/{ppo.objective.clip_high}"
    arms = {arm: group.set_index("seed") for arm, group in runs.groupby("arm", sort=False)}
    print("| arm | n | " + " | ".join(METRICS.values()) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in METRICS) + " |")
    for arm, group in arms.items():
        print(f"| {arm} | {len(group)} | " + " | ".join(f"{mean(group[m]):.4f}" for m in METRICS) + " |")
    print("\n| arm | against | metric | Δ mean [95% CI] | p |")
    print("| --- | --- | --- | --- | --- |")
    for arm, group in arms.items():
        for against in (f"none {default_clip}", f"bypass {default_clip}"):
            if not arm.startswith("bypass") or arm == against or against not in arms:
                continue
            for metric in list(METRICS)[1:]:
                delta, low, high, _, p = paired(group[metric], arms[against][metric])
                print(f"| {arm} | {against} | {METRICS[metric]} | {delta:+.4f} [{low:+.4f}, {high:+.4f}] | {p:.2g} |")


if __name__ == "__main__":
    main(sys.argv[1:])
