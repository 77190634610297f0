"""Truncated sampling and the trainer's support, from the experiment's two sweeps (issue 48):

    .venv/bin/python experiments/sampling_truncation/analyze.py SWEEP [BASELINE_SWEEP]

SWEEP: `rlmm train -m experiment=sampling_truncation` (top_p x support x correction x seed); BASELINE_SWEEP (optional):
the same with `sampling.top_p=1.0 support=sampler` (no truncation: every support is the same there).

1. Held-out accuracy at the last step (trained weights and the deployed sampler; summary.json) per arm: the mean,
   and the paired difference by seed (mean, 95% paired-t interval, Holm-adjusted p over every comparison of the
   table, statsmodels' `multipletests`) of each support from support=sampler with the same correction, of TIS from
   none with the same support, and of each truncated arm from no truncation with the same correction.
2. The bias per arm (steps.jsonl, the run's mean over steps 1..N): the trainer's mass S on the sampler's kept set
   (mean log S, the bias `full` carries), the signed gap log π − log μ with the trainer normalised over the
   vocabulary and over K_S (support/full/, support/sampler_set/logprob_diff_mean), the absolute gap the run trained
   on (mismatch/logprob_abs_diff_mean), the share of sampled tokens outside the trainer's own set, and
   with TIS the mean weight it gave a token (`correction/weight_mean`: TRL #6789's "share of the gradient kept").
Writes sampling_truncation.png beside SWEEP: the gap over the steps per support, and the accuracy bars.
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

ACCURACY = {"eval_accuracy_trained_end": "trained weights", "eval_accuracy_end": "deployed sampler"}
PER_STEP = {"support/log_kept_mass_sampler_set": "mean log S", "support/kept_mass_sampler_set": "S",
            "support/kept_size_sampler": "|K_S|", "support/frac_outside_trainer_set": "outside K_T",
            "support/full/logprob_diff_mean": "δ over V", "support/sampler_set/logprob_diff_mean": "δ over K_S",
            "mismatch/logprob_abs_diff_mean": "mean |δ| trained on",
            "mismatch/kl_k3": "KL k3", "correction/weight_mean": "TIS weight", "loss/entropy": "entropy"}
SUPPORTS = ("sampler", "trainer", "full")


def runs_of(sweep: str, truncated: bool) -> tuple[pd.DataFrame, pd.DataFrame]:
    rows, curves = [], []
    for run in sorted(p for p in Path(sweep).iterdir() if (p / "summary.json").exists()):
        overrides = read_overrides(run)
        summary = json.loads((run / "summary.json").read_text())
        steps = pd.DataFrame([s for s in read_steps(run) if s["step"] > 0]).set_index("step")
        arm = overrides["support"] if truncated else "no truncation"
        row = {"arm": arm, "top_p": float(overrides.get("sampling.top_p", 1.0)), "correction": overrides["correction"],
               "seed": int(overrides["seed"]), "skipped": steps["train/skipped"].sum()}
        row |= {key: summary.get(key) for key in ACCURACY}
        row |= {key: steps[key].mean() for key in PER_STEP if key in steps}
        rows.append(row)
        curves.append(steps[["mismatch/logprob_abs_diff_mean"]].assign(arm=arm, correction=row["correction"],
                                                                      seed=row["seed"]).reset_index())
    return pd.DataFrame(rows), pd.concat(curves) if curves else pd.DataFrame()


def comparisons(runs: pd.DataFrame, key: str) -> pd.DataFrame:
    """Every paired comparison of the accuracy `key`, Holm-adjusted together."""
    table = runs.pivot_table(index="seed", columns=["arm", "correction"], values=key)
    found = []

    def compare(arm, base, label):
        if arm in table and base in table:
            pair = table[[arm, base]].dropna()
            found.append({"arm": arm, "versus": label, **difference_stats(pair[arm].values, pair[base].values)})

    for correction in sorted(set(runs.correction)):
        for support in SUPPORTS[1:]:
            compare((support, correction), ("sampler", correction), "support=sampler")
        for support in SUPPORTS:
            compare((support, correction), ("no truncation", correction), "no truncation")
    for arm in [*SUPPORTS, "no truncation"]:
        compare((arm, "tis"), (arm, "none"), "correction=none")
    frame = pd.DataFrame(found)
    tested = frame["p"].notna()
    frame["p_holm"] = np.nan
    frame.loc[tested, "p_holm"] = multipletests(frame.loc[tested, "p"], method="holm")[1]
    return frame


def main(sweep: str, baseline: str | None = None) -> None:
    runs, curves = runs_of(sweep, truncated=True)
    if baseline:
        base_runs, base_curves = runs_of(baseline, truncated=False)
        runs, curves = pd.concat([runs, base_runs]), pd.concat([curves, base_curves])
    print(f"{len(runs)} runs, top_p {sorted(set(runs.top_p))}, seeds {sorted(runs.seed.unique())}, "
          f"skipped steps {int(runs.skipped.sum())}")
    arms = [a for a in ("no truncation", *SUPPORTS) if a in set(runs.arm)]
    for key, label in ACCURACY.items():
        print(f"\nheld-out accuracy at the last step, {label} ({key}): mean over seeds\n")
        print("| support | " + " | ".join(sorted(set(runs.correction))) + " |")
        print("| --- |" + " --- |" * len(set(runs.correction)))
        for arm in arms:
            means = [runs[(runs.arm == arm) & (runs.correction == c)][key].mean() for c in sorted(set(runs.correction))]
            print(f"| {arm} | " + " | ".join(f"{m:.4f}" for m in means) + " |")
        print(f"\npaired differences ({label}; Holm over the {len(comparisons(runs, key))} comparisons)\n")
        print("| arm | versus | n | Δ mean [95% CI] | p | p_Holm |")
        print("| --- | --- | --- | --- | --- | --- |")
        for _, r in comparisons(runs, key).iterrows():
            print(f"| {r.arm[0]}, {r.arm[1]} | {r.versus} | {r.n} | {r.mean_diff:+.4f} [{r.ci_low:+.4f}, "
                  f"{r.ci_high:+.4f}] | {r.p:.2g} | {r.p_holm:.2g} |")
    print("\nthe bias and the gap per arm (each run's mean over its steps, then the mean over runs)\n")
    shown = [k for k in PER_STEP if k in runs]
    print("| support | correction | " + " | ".join(PER_STEP[k] for k in shown) + " |")
    print("| --- | --- |" + " --- |" * len(shown))
    for arm in arms:
        for c in sorted(set(runs.correction)):
            part = runs[(runs.arm == arm) & (runs.correction == c)]
            print(f"| {arm} | {c} | " + " | ".join(f"{part[k].mean():.4g}" for k in shown) + " |")
    plot(runs, curves, arms, Path(sweep) / "sampling_truncation.png")


def plot(runs: pd.DataFrame, curves: pd.DataFrame, arms: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    corrections = sorted(set(runs.correction))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for i, arm in enumerate(arms):
        mean = curves[curves.arm == arm].groupby("step")["mismatch/logprob_abs_diff_mean"].mean()
        axes[0].plot(mean.index, mean.rolling(5, min_periods=1).mean(), color=f"C{i}", label=arm)
    axes[0].set(xlabel="step", ylabel="mean |δ|", yscale="log",
                title="sampler vs trainer as trained on (mean over runs, 5-step rolling)")
    axes[0].legend(title="support")
    width = 0.8 / len(corrections)
    for j, c in enumerate(corrections):
        values = [runs[(runs.arm == a) & (runs.correction == c)]["eval_accuracy_trained_end"] for a in arms]
        x = np.arange(len(arms)) + j * width
        axes[1].bar(x, [v.mean() for v in values], width, yerr=[v.std() / np.sqrt(max(1, len(v))) for v in values],
                    label=c, capsize=3)
    axes[1].set(xticks=np.arange(len(arms)) + width * (len(corrections) - 1) / 2, xticklabels=arms,
                ylabel="held-out accuracy, trained weights (last step)", title="accuracy ± s.e. over seeds",
                ylim=(0.6, 0.95))
    axes[1].legend(title="correction")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nplot: {path}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
