"""How much of the mismatch's cost each correction recovers, per seed, from the experiment's sweep and
its no-mismatch reference (`sampler.perturb=0 correction=none`, the same seeds):

    .venv/bin/python experiments/tis_under_mismatch/analyze.py SWEEP [SWEEP ...] --reference REFERENCE_SWEEP [...]

For held-out accuracy at the last step, by the trained weights (`eval_accuracy_trained_end`) and by the
deployed sampler (`eval_accuracy_end`): each arm's paired difference from `correction=none` and from the
reference, mean and 95% paired-t interval over seeds (scipy), and the share of the gap
(reference − none) that the arm closes. `rlmm table --baseline` gives the first with Holm's adjustment;
the second pairs runs that differ in two overrides (correction and sampler.perturb), which it does not.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf
from scipy import stats

METRICS = {"eval_accuracy_trained_end": "trained weights", "eval_accuracy_end": "deployed sampler"}


def by_arm(*sweeps: Path) -> dict[str, dict[int, dict]]:
    """correction -> seed -> summary.json of each finished job of the sweeps."""
    arms: dict[str, dict[int, dict]] = {}
    for summary in sorted(s for sweep in sweeps for s in sweep.glob("*/summary.json")):
        overrides = dict(o.split("=", 1) for o in OmegaConf.load(summary.parent / ".hydra" / "overrides.yaml")
                         if "=" in o)
        arms.setdefault(overrides["correction"], {})[int(overrides["seed"])] = json.loads(summary.read_text())
    return arms


def paired(a: dict[int, dict], b: dict[int, dict], metric: str) -> tuple[float, float, float, int]:
    seeds = sorted(set(a) & set(b))
    d = np.array([a[s][metric] - b[s][metric] for s in seeds])
    low, high = stats.ttest_1samp(d, 0).confidence_interval(0.95)
    return d.mean(), low, high, len(seeds)


def main(sweeps: list[str], references: list[str]) -> None:
    arms, ref = by_arm(*map(Path, sweeps)), by_arm(*map(Path, references))["none"]
    for metric, label in METRICS.items():
        print(f"\nheld-out accuracy at the last step, {label} ({metric}); reference (no mismatch) "
              f"{np.mean([r[metric] for r in ref.values()]):.4f}\n")
        print("| correction | n | mean | Δ vs none [95% CI] | Δ vs reference [95% CI] | gap closed |")
        print("| --- | --- | --- | --- | --- | --- |")
        gap = paired(ref, arms["none"], metric)[0]
        for arm, runs in arms.items():
            mean = np.mean([r[metric] for r in runs.values()])
            vs_none, vs_ref = paired(runs, arms["none"], metric), paired(runs, ref, metric)
            print(f"| {arm} | {vs_ref[3]} | {mean:.4f} | {vs_none[0]:+.4f} [{vs_none[1]:+.4f}, {vs_none[2]:+.4f}] | "
                  f"{vs_ref[0]:+.4f} [{vs_ref[1]:+.4f}, {vs_ref[2]:+.4f}] | {vs_none[0] / gap:.0%} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", nargs="+", help="the experiment's sweep directories (arms split over several is fine)")
    parser.add_argument("--reference", required=True, nargs="+",
                        help="the sweep(s) of sampler.perturb=0 correction=none, the same seeds")
    args = parser.parse_args()
    main(args.sweeps, args.reference)
