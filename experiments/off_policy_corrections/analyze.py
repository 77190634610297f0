"""One-step off-policy corrections, from the experiment's sweep(s) (issue 49):

    .venv/bin/python experiments/off_policy_corrections/analyze.py SWEEP [SWEEP ...]

SWEEP: `rlmm train -m experiment=off_policy_corrections` (correction x seed; the seeds may be split over sweeps).

1. Held-out accuracy at the last step (trained weights and the deployed sampler; summary.json) per correction: the
   mean over seeds, and each arm's paired difference from `tis` by seed (mean, 95% paired-t interval, Holm-adjusted p
   over the table's comparisons, statsmodels' `multipletests`).
2. Does the gap blow up? Per run, the sampler-vs-trainer gap the update trained on (mismatch/kl_k3 and
   mismatch/logprob_abs_diff_mean, steps.jsonl) over the last quarter of its steps divided by the first quarter's,
   and its largest value; the same split into its numerical part and its policy-lag part (train.decompose_staleness:
   mismatch/numerical/, mismatch/policy_lag/); paired against tis, Holm over these comparisons.
3. What each arm did (each run's mean over its steps, then the mean over runs): the share of tokens it dropped,
   its weights' mean, the step-size factor, and prime-rl's split of the
   mismatch over dropped and kept tokens with the advantage sign of the dropped ones.
Writes off_policy_corrections.png beside the first SWEEP: the gap over the steps per arm, and the accuracy bars.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from statsmodels.stats.multitest import multipletests

from rlmm.run.records import read_steps
from rlmm.table.discovery import read_overrides
from rlmm.table.paired import difference_stats

BASELINE = "tis"
ACCURACY = {"eval_accuracy_trained_end": "trained weights", "eval_accuracy_end": "deployed sampler"}
GAPS = {"mismatch/kl_k3": "KL k3", "mismatch/logprob_abs_diff_mean": "mean |δ|",
        "mismatch/numerical/kl_k3": "numerical KL k3", "mismatch/policy_lag/kl_k3": "policy-lag KL k3"}
WHAT_IT_DID = {"correction/frac_tokens_masked": "dropped before", "correction/frac_tokens_dropped": "dropped inside",
               "correction/weight_mean": "weight mean", "correction/lr_scale": "lr factor",
               "correction/kl_k3_dropped": "k3 dropped", "correction/kl_k3_kept": "k3 kept",
               "correction/dropped_advantage_positive": "dropped A>0",
               "correction/dropped_advantage_negative": "dropped A<0"}


def runs_of(sweeps: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    rows, curves = [], []
    for sweep in sweeps:
        for run in sorted(p for p in Path(sweep).iterdir() if (p / "summary.json").exists()):
            overrides = read_overrides(run)
            summary = json.loads((run / "summary.json").read_text())
            steps = pd.DataFrame([s for s in read_steps(run) if s["step"] > 0]).set_index("step")
            quarter = max(1, len(steps) // 4)
            setting = " ".join(f"{k}={v}" for k, v in sorted(overrides.items())
                               if k not in ("correction", "seed", "experiment", "logger"))
            row = {"correction": overrides["correction"], "seed": int(overrides["seed"]), "setting": setting or "-",
                   "steps": len(steps), "skipped": steps["train/skipped"].sum()}
            row |= {key: summary.get(key) for key in ACCURACY}
            for key in GAPS:
                if key in steps:
                    series = steps[key].astype(float)
                    row[f"{key}:growth"] = series.iloc[-quarter:].mean() / series.iloc[:quarter].mean()
                    row[f"{key}:max"] = series.max()
                    row[f"{key}:mean"] = series.mean()
            row |= {key: steps[key].astype(float).mean() for key in WHAT_IT_DID if key in steps}
            rows.append(row)
            curves.append(steps[[k for k in GAPS if k in steps]].assign(correction=row["correction"],
                                                                        seed=row["seed"]).reset_index())
    return pd.DataFrame(rows), pd.concat(curves) if curves else pd.DataFrame()


def paired_against_baseline(runs: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Each arm against `BASELINE` by seed for every key, Holm-adjusted together."""
    found = []
    for key in keys:
        table = runs.pivot_table(index="seed", columns="correction", values=key)
        for arm in table.columns:
            if arm != BASELINE and BASELINE in table:
                pair = table[[arm, BASELINE]].dropna()
                found.append({"key": key, "arm": arm, **difference_stats(pair[arm].values, pair[BASELINE].values)})
    frame = pd.DataFrame(found)
    tested = frame["p"].notna()
    frame["p_holm"] = np.nan
    if tested.any():
        frame.loc[tested, "p_holm"] = multipletests(frame.loc[tested, "p"], method="holm")[1]
    return frame


def print_paired(frame: pd.DataFrame, label) -> None:
    print("| arm | " + ("metric | " if frame.key.nunique() > 1 else "") + "n | Δ mean vs tis [95% CI] | p | p_Holm |")
    print("| --- | " + ("--- | " if frame.key.nunique() > 1 else "") + "--- | --- | --- | --- |")
    for _, r in frame.iterrows():
        metric = f"{label(r.key)} | " if frame.key.nunique() > 1 else ""
        print(f"| {r.arm} | {metric}{r.n} | {r.mean_diff:+.4g} [{r.ci_low:+.4g}, {r.ci_high:+.4g}] | {r.p:.2g} | "
              f"{r.p_holm:.2g} |")


def main(sweeps: list[str]) -> None:
    runs, curves = runs_of(sweeps)
    arms = [BASELINE, *sorted(set(runs.correction) - {BASELINE})]
    if runs.setting.nunique() > 1:
        raise SystemExit(f"sweeps of different settings ({sorted(set(runs.setting))}): analyse each on its own")
    print(f"{len(runs)} runs ({runs.setting.iloc[0]}), arms {arms}, seeds {sorted(int(s) for s in runs.seed.unique())}, "
          f"steps {sorted(int(s) for s in set(runs.steps))}, "
          f"skipped steps {int(runs.skipped.sum())}")
    for key, label in ACCURACY.items():
        print(f"\nheld-out accuracy at the last step, {label} ({key})\n")
        print("| correction | mean | s.d. over seeds |\n| --- | --- | --- |")
        for arm in arms:
            values = runs[runs.correction == arm][key]
            print(f"| {arm} | {values.mean():.4f} | {values.std():.4f} |")
        print(f"\npaired differences from {BASELINE} (Holm over this table)\n")
        print_paired(paired_against_baseline(runs, [key]), str)
    growth = [f"{key}:growth" for key in GAPS if f"{key}:growth" in runs]
    print("\nthe gap over the run: last quarter's mean / first quarter's, and its largest value (mean over seeds)\n")
    print("| correction | " + " | ".join(f"{GAPS[k.split(':')[0]]} growth" for k in growth)
          + " | KL k3 max | KL k3 mean |")
    print("| --- |" + " --- |" * (len(growth) + 2))
    for arm in arms:
        part = runs[runs.correction == arm]
        print(f"| {arm} | " + " | ".join(f"{part[k].mean():.3g}" for k in growth)
              + f" | {part['mismatch/kl_k3:max'].mean():.3g} | {part['mismatch/kl_k3:mean'].mean():.3g} |")
    print("\npaired differences of the growth from tis (Holm over this table)\n")
    print_paired(paired_against_baseline(runs, growth), lambda k: GAPS[k.split(":")[0]] + " growth")
    shown = [k for k in WHAT_IT_DID if k in runs]
    print("\nwhat each arm did (each run's mean over its steps, then the mean over runs)\n")
    print("| correction | " + " | ".join(WHAT_IT_DID[k] for k in shown) + " |")
    print("| --- |" + " --- |" * len(shown))
    for arm in arms:
        part = runs[runs.correction == arm]
        print(f"| {arm} | " + " | ".join(f"{part[k].mean():.4g}" for k in shown) + " |")
    plot(runs, curves, arms, Path(sweeps[0]) / "off_policy_corrections.png")


def plot(runs: pd.DataFrame, curves: pd.DataFrame, arms: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.4))
    for i, arm in enumerate(arms):
        part = curves[curves.correction == arm]
        for ax, key in zip(axes[:2], ("mismatch/kl_k3", "mismatch/numerical/kl_k3")):
            if key in part:
                mean = part.groupby("step")[key].mean()
                ax.plot(mean.index, mean, color=f"C{i}", label=arm)
    axes[0].set(xlabel="step", ylabel="KL k3 (sampler vs trainer, as trained on)", yscale="log",
                title="the whole gap: numerics + one step of policy lag")
    axes[1].set(xlabel="step", ylabel="KL k3, numerical part", yscale="log",
                title="the engines' part (same weights on both sides)")
    axes[0].legend(fontsize=8)
    values = [runs[runs.correction == a]["eval_accuracy_trained_end"] for a in arms]
    axes[2].bar(np.arange(len(arms)), [v.mean() for v in values],
                yerr=[v.std() / np.sqrt(max(1, len(v))) for v in values], color=[f"C{i}" for i in range(len(arms))],
                capsize=3)
    axes[2].set(xticks=np.arange(len(arms)), ylabel="held-out accuracy, trained weights (last step)",
                title="accuracy ± s.e. over seeds")
    axes[2].set_xticklabels(arms, rotation=20, fontsize=8)
    low = min(v.mean() for v in values)
    axes[2].set_ylim(max(0.0, low - 0.15), min(1.0, max(v.mean() for v in values) + 0.08))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nplot: {path}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main(sys.argv[1:])
