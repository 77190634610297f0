"""What staleness costs, what each correction recovers, and where the policy lag overtakes the numerics, from the
experiment's sweep(s):

    .venv/bin/python experiments/staleness/analyze.py multirun/experiments/staleness/<date>_<time> [...]

1. Held-out accuracy at the last step (trained weights, deployed sampler; summary.json): per k and correction,
   the mean, the cost of k against k = 0 with the same correction, and the recovery of each correction against
   `none` at the same k, both paired by seed (mean and 95% paired-t interval, scipy).
2. The decomposition (docs/metrics.md, `staleness_decomposition`): per run, the mean over the updates that
   trained on rollouts exactly k updates old (`rollout/staleness` = k; all updates at k = 0) of the numerical
   part (sampler vs the trainer at the stale weights) and of the policy-lag part (the trainer then vs now), in
   mean |δ| and KL k3; per k, their ratio lag / numerical, paired within each run (geometric mean over runs and
   its 95% interval), the correction arms pooled (the gap is measured before any correction acts, but the
   weights it is measured at are each arm's own). Writes decomposition.png beside the first sweep.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from rlmm.run.records import read_steps
from rlmm.table.discovery import read_overrides

PARTS = {"logprob_abs_diff_mean": "mean |δ|", "kl_k3": "KL k3"}
ACCURACY = {"eval_accuracy_trained_end": "trained weights", "eval_accuracy_end": "deployed sampler"}


def runs_of(sweeps: list[str]) -> pd.DataFrame:
    rows = []
    for sweep in sweeps:
        for run in sorted(p for p in Path(sweep).iterdir() if (p / "summary.json").exists()):
            overrides = read_overrides(run)
            k = int(overrides["train.staleness"])
            summary = json.loads((run / "summary.json").read_text())
            steps = [s for s in read_steps(run) if "mismatch/numerical/kl_k3" in s]
            at_k = [s for s in steps if s.get("rollout/staleness", 0) == k] or steps
            row = {"k": k, "correction": overrides["correction"], "seed": int(overrides["seed"]), "run": str(run)}
            row |= {key: summary.get(key) for key in ACCURACY}
            for part in ("numerical", "policy_lag"):
                for key in PARTS:
                    row[f"{part}/{key}"] = np.mean([s[f"mismatch/{part}/{key}"] for s in at_k])
            rows.append(row)
    return pd.DataFrame(rows)


def paired(a: pd.Series, b: pd.Series) -> str:
    d = (a - b).dropna()
    if len(d) < 2:
        return f"{d.mean():+.4f} (n={len(d)})"
    test = stats.ttest_1samp(d, 0)
    low, high = test.confidence_interval(0.95)
    return f"{d.mean():+.4f} [{low:+.4f}, {high:+.4f}] p={test.pvalue:.2g}"


def main(sweeps: list[str]) -> None:
    runs = runs_of(sweeps)
    ks, corrections = sorted(runs.k.unique()), list(dict.fromkeys(runs.correction))
    print(f"{len(runs)} runs: k {ks}, corrections {corrections}, seeds {sorted(runs.seed.unique())}")
    for key, label in ACCURACY.items():
        table = runs.pivot_table(index=["k", "seed"], columns="correction", values=key)
        print(f"\nheld-out accuracy at the last step, {label} ({key})\n")
        print("| k | correction | n | mean | Δ vs k = 0, same correction [95% CI] | Δ vs none, same k [95% CI] |")
        print("| --- | --- | --- | --- | --- | --- |")
        for k in ks:
            for c in corrections:
                here = table.loc[k, c]
                cost = "—" if k == ks[0] else paired(here, table.loc[ks[0], c].reindex(here.index))
                gain = "—" if c == "none" else paired(here, table.loc[k, "none"])
                print(f"| {k} | {c} | {here.notna().sum()} | {here.mean():.4f} | {cost} | {gain} |")

    print("\nthe decomposition, over the updates on rollouts exactly k updates old (correction arms pooled)\n")
    print("| k | runs | numerical mean |δ| | policy lag mean |δ| | lag / numerical (mean |δ|) [95% CI] | "
          "numerical KL k3 | policy lag KL k3 | lag / numerical (KL) [95% CI] |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for k in ks:
        part = runs[runs.k == k]
        cells = []
        for key in PARTS:
            num, lag = part[f"numerical/{key}"], part[f"policy_lag/{key}"]
            if k == 0:
                cells += [f"{num.mean():.3g}", f"{lag.mean():.3g}", "— (no lag)"]
                continue
            logs = np.log(lag / num)
            low, high = stats.ttest_1samp(logs, 0).confidence_interval(0.95)
            cells += [f"{num.mean():.3g}", f"{lag.mean():.3g}",
                      f"{np.exp(logs.mean()):.3g}x [{np.exp(low):.3g}, {np.exp(high):.3g}]"]
        print(f"| {k} | {len(part)} | " + " | ".join(cells) + " |")
    plot(runs, ks, Path(sweeps[0]) / "decomposition.png")


def plot(runs: pd.DataFrame, ks: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key in zip(axes, PARTS):
        for part, color in (("numerical", "C0"), ("policy_lag", "C3")):
            at = [k for k in ks if part == "numerical" or k > 0]  # no lag at k = 0 (and no 0 on a log axis)
            values = [runs[runs.k == k][f"{part}/{key}"] for k in at]
            ax.scatter(np.repeat(at, [len(v) for v in values]), np.concatenate(values), color=color, s=10, alpha=0.5)
            ax.plot(at, [v.mean() for v in values], color=color, label=part.replace("_", " "))
        ax.set(xlabel="staleness k", ylabel=PARTS[key], yscale="log", xticks=ks,
               title=f"the gap's two parts: {PARTS[key]} (per run)")
        ax.legend()
    for c in dict.fromkeys(runs.correction):
        means = [runs[(runs.k == k) & (runs.correction == c)]["eval_accuracy_trained_end"].mean() for k in ks]
        axes[2].plot(ks, means, marker="o", label=c)
    axes[2].set(xlabel="staleness k", ylabel="held-out accuracy, trained weights (last step)",
                title="accuracy by k and correction", xticks=ks)
    axes[2].legend(title="correction")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nplot: {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
