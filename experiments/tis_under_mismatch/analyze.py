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
import math

import pandas as pd
from scipy import stats

from rlmm.table.frames import load_runs

# summary.json's numbers, as rlmm table reads them
METRICS = {"summary/eval_accuracy_trained_end:final": "trained weights",
           "summary/eval_accuracy_end:final": "deployed sampler"}


def by_seed(sweeps: list[str], metric: str) -> pd.DataFrame:
    """seed x correction: the metric of every complete run of the sweeps (rlmm.table's reader)."""
    runs = load_runs(sweeps)
    runs = runs[runs.status == "complete"]
    return runs.pivot(index="seed", columns="correction", values=metric)[list(dict.fromkeys(runs.correction))]


def mean(values: pd.Series) -> float:
    """Exactly rounded (math.fsum), so the printed figures do not depend on the runs' order."""
    values = values.dropna()
    return math.fsum(values) / len(values)


def paired(a: pd.Series, b: pd.Series) -> tuple[float, float, float, int, float]:
    """Mean of the per-seed differences a - b, its 95% paired-t interval, the number of pairs, and the
    two-sided paired t-test's p."""
    d = (a - b).dropna()
    test = stats.ttest_1samp(d, 0)
    low, high = test.confidence_interval(0.95)
    return mean(d), low, high, len(d), test.pvalue


def main(sweeps: list[str], references: list[str]) -> None:
    for metric, label in METRICS.items():
        arms, ref = by_seed(sweeps, metric), by_seed(references, metric)["none"]
        print(f"\nheld-out accuracy at the last step, {label} ({metric.removeprefix('summary/').removesuffix(':final')}); "
              f"reference (no mismatch) {mean(ref):.4f}\n")
        print("| correction | n | mean | Δ vs none [95% CI] | Δ vs reference [95% CI] | gap closed |")
        print("| --- | --- | --- | --- | --- | --- |")
        gap = paired(ref, arms["none"])[0]
        for arm in arms:
            vs_none, vs_ref = paired(arms[arm], arms["none"]), paired(arms[arm], ref)
            print(f"| {arm} | {vs_ref[3]} | {mean(arms[arm]):.4f} | {vs_none[0]:+.4f} [{vs_none[1]:+.4f}, {vs_none[2]:+.4f}] | "
                  f"{vs_ref[0]:+.4f} [{vs_ref[1]:+.4f}, {vs_ref[2]:+.4f}] | {vs_none[0] / gap:.0%} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", nargs="+", help="the experiment's sweep directories (arms split over several is fine)")
    parser.add_argument("--reference", required=True, nargs="+",
                        help="the sweep(s) of sampler.perturb=0 correction=none, the same seeds")
    args = parser.parse_args()
    main(args.sweeps, args.reference)
