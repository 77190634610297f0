"""The bf16 / fp16 ratio of each mismatch metric, paired by seed, from the experiment's sweep:

    .venv/bin/python experiments/fp16_vs_bf16/analyze.py multirun/experiments/fp16_vs_bf16/<date>_<time>

The claim is a factor (Qi et al. 2025: ~24x; rounding theory: 8x in |δ|, 64x in KL), so the comparison is
on the log scale: per seed, log(bf16 / fp16) of the metric, its mean and 95% paired-t interval over seeds
(scipy), reported back as a geometric-mean ratio. `rlmm table --baseline precision.sampler_dtype=bf16`
gives the same pairs as differences.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf
from scipy import stats

METRICS = {"logprob_abs_diff_mean": "mean abs δ", "kl_k3": "KL k3", "prob_abs_diff_max": "max abs Δp",
           "one_minus_pearson": "1 − Pearson(p)"}


def by_dtype(sweep: Path) -> dict[str, dict[int, dict]]:
    """sampler dtype -> seed -> the probe's sampler-vs-trainer metrics (with 1 − Pearson added)."""
    runs: dict[str, dict[int, dict]] = {}
    for record in sorted(sweep.glob("*/probe.json")):
        overrides = dict(o.split("=", 1) for o in OmegaConf.load(record.parent / ".hydra" / "overrides.yaml") if "=" in o)
        metrics = json.loads(record.read_text())["sampler_vs_trainer"]
        metrics["one_minus_pearson"] = 1 - metrics["prob_pearson"]
        runs.setdefault(overrides["precision.sampler_dtype"], {})[int(overrides["seed"])] = metrics
    return runs


def main(sweep: str) -> None:
    runs = by_dtype(Path(sweep))
    for high, low in (("bf16", "fp16"), ("fp16", "fp32")):
        seeds = sorted(set(runs[high]) & set(runs[low]))
        print(f"\n{high} / {low}, {len(seeds)} paired seeds\n")
        print("| metric | geometric-mean ratio | 95% CI | per-seed range |")
        print("| --- | --- | --- | --- |")
        for key, label in METRICS.items():
            logs = np.log([runs[high][s][key] / runs[low][s][key] for s in seeds])
            low_ci, high_ci = stats.ttest_1samp(logs, 0).confidence_interval(0.95)
            print(f"| {label} | {np.exp(logs.mean()):.3g}x | [{np.exp(low_ci):.3g}, {np.exp(high_ci):.3g}] | "
                  f"{np.exp(logs.min()):.3g}–{np.exp(logs.max()):.3g} |")


if __name__ == "__main__":
    main(sys.argv[1])
