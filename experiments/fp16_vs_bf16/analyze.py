"""The bf16 / fp16 ratio of each mismatch metric, paired by seed, from the experiment's sweep:

    .venv/bin/python experiments/fp16_vs_bf16/analyze.py multirun/experiments/fp16_vs_bf16/<date>_<time>

The claim is a factor (Qi et al. 2025: ~24x; rounding theory: 8x in |δ|, 64x in KL), so the comparison is
on the log scale: per seed, log(bf16 / fp16) of the metric, its mean and 95% paired-t interval over seeds
(scipy), reported back as a geometric-mean ratio. `rlmm table --baseline precision.sampler_dtype=bf16`
gives the same pairs as differences.
"""
from __future__ import annotations

import sys

import numpy as np
from scipy import stats

from rlmm.table.frames import load_runs

METRICS = {"mismatch/logprob_abs_diff_mean:final": "mean abs δ", "mismatch/kl_k3:final": "KL k3",
           "mismatch/prob_abs_diff_max:final": "max abs Δp", "one_minus_pearson": "1 − Pearson(p)"}


def main(sweep: str) -> None:
    runs = load_runs(sweep)
    runs = runs[runs.status == "complete"].assign(one_minus_pearson=lambda r: 1 - r["mismatch/prob_pearson:final"])
    for high, low in (("bf16", "fp16"), ("fp16", "fp32")):
        seeds = sorted(set(runs.seed[runs["precision.sampler_dtype"] == high])
                       & set(runs.seed[runs["precision.sampler_dtype"] == low]), key=int)
        print(f"\n{high} / {low}, {len(seeds)} paired seeds\n")
        print("| metric | geometric-mean ratio | 95% CI | per-seed range |")
        print("| --- | --- | --- | --- |")
        for key, label in METRICS.items():
            by_seed = runs.pivot(index="seed", columns="precision.sampler_dtype", values=key).loc[seeds]
            logs = np.log(by_seed[high] / by_seed[low]).to_numpy()
            low_ci, high_ci = stats.ttest_1samp(logs, 0).confidence_interval(0.95)
            print(f"| {label} | {np.exp(logs.mean()):.3g}x | [{np.exp(low_ci):.3g}, {np.exp(high_ci):.3g}] | "
                  f"{np.exp(logs.min()):.3g}–{np.exp(logs.max()):.3g} |")


if __name__ == "__main__":
    main(sys.argv[1])
