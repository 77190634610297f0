"""What the mismatch costs each correction, measured against zero mismatch, from the experiment's sweeps:

    .venv/bin/python experiments/bitwise_control/analyze.py SWEEP [SWEEP ...]

SWEEP: the sweep directories of `rlmm train -m experiment=bitwise_control` (vLLM bf16, plain), the same with
`sampler.perturb=0.2` (amplified) and with `sampler=bitwise correction=none` (the control), in any order.

1. Held-out accuracy at the last step (summary.json): the trained weights (`eval_accuracy_trained_end`, the same
   evaluation engine for every arm) and the deployed sampler (`eval_accuracy_end`). For each vLLM arm (condition x
   correction): the mean and the paired difference from the control (by seed: mean, 95% paired-t interval, p, and
   Holm's p over the arms of the table: rlmm/table/paired.py's `difference_stats` and statsmodels' Holm).
2. The mismatch each arm trained with (mean |δ|, KL k3 over its steps) and its share of bitwise-identical tokens
   (`agreement/frac_tokens_identical`; the control's is 1 at every step, or it would have stopped).
Writes bitwise_control.png beside the first sweep: the paired differences with their intervals.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
from statsmodels.stats.multitest import multipletests

from rlmm.run.records import read_steps
from rlmm.table.discovery import read_overrides
from rlmm.table.paired import difference_stats

ACCURACY = {"eval_accuracy_trained_end": "trained weights", "eval_accuracy_end": "deployed sampler"}
STEPS = {"mismatch/logprob_abs_diff_mean": "mean |δ|", "mismatch/kl_k3": "KL k3",
         "agreement/frac_tokens_identical": "bitwise tokens"}
CONTROL = "bitwise"


def runs_of(sweeps: list[str]) -> pd.DataFrame:
    rows = []
    for sweep in sweeps:
        for run in sorted(p for p in Path(sweep).iterdir() if (p / "summary.json").exists()):
            overrides = read_overrides(run)
            sampler = overrides.get("sampler", "vllm")
            perturb = float(overrides.get("sampler.perturb", 0))
            arm = CONTROL if sampler == "bitwise" else ("vllm, perturb 0.2" if perturb else "vllm")
            summary = json.loads((run / "summary.json").read_text())
            steps = pd.DataFrame([s for s in read_steps(run) if s["step"] > 0])
            rows.append({"arm": arm, "correction": overrides.get("correction", "none"), "seed": int(overrides["seed"]),
                         **{key: summary.get(key) for key in ACCURACY},
                         **{key: steps[key].mean() if key in steps else float("nan") for key in STEPS}})
    return pd.DataFrame(rows)


def compared(runs: pd.DataFrame, key: str) -> pd.DataFrame:
    """Each vLLM arm x correction against the control, paired by seed, Holm over the table's rows."""
    control = runs[runs["arm"] == CONTROL].set_index("seed")[key]
    rows = []
    for (arm, correction), part in runs[runs["arm"] != CONTROL].groupby(["arm", "correction"], sort=False):
        here = part.set_index("seed")[key]
        seeds = sorted(set(here.index) & set(control.index))
        stats = difference_stats(here.loc[seeds].to_numpy(), control.loc[seeds].to_numpy())
        rows.append({"arm": arm, "correction": correction, "mean": here.loc[seeds].mean(),
                     "control": control.loc[seeds].mean(), **stats})
    table = pd.DataFrame(rows)
    tested = table["p"].notna()
    table["p_holm"] = float("nan")
    if tested.any():
        table.loc[tested, "p_holm"] = multipletests(table.loc[tested, "p"], method="holm")[1]
    return table


def main(sweeps: list[str]) -> None:
    runs = runs_of(sweeps)
    print(f"{len(runs)} runs: " + ", ".join(f"{arm} x {sorted(set(part.correction))} ({len(part)})"
                                            for arm, part in runs.groupby("arm")))
    control = runs[runs["arm"] == CONTROL]
    for key, label in ACCURACY.items():
        table = compared(runs, key)
        print(f"\nheld-out accuracy at the last step, {label} ({key}); control (sampler=bitwise, no correction): "
              f"{control[key].mean():.4f} over {len(control)} seeds\n")
        print("| rollouts | correction | n | mean | control, same seeds | Δ vs the bitwise control [95% CI] | p | "
              "p (Holm) |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for row in table.itertuples():
            print(f"| {row.arm} | {row.correction} | {row.n} | {row.mean:.4f} | {row.control:.4f} | {row.mean_diff:+.4f} "
                  f"[{row.ci_low:+.4f}, {row.ci_high:+.4f}] | {row.p:.2g} | {row.p_holm:.2g} |")
    print("\nwhat each arm trained with (means over its steps, then over seeds)\n")
    print("| rollouts | correction | runs | " + " | ".join(STEPS.values()) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in STEPS) + " |")
    for (arm, correction), part in runs.groupby(["arm", "correction"], sort=False):
        print(f"| {arm} | {correction} | {len(part)} | " + " | ".join(f"{part[k].mean():.3g}" for k in STEPS) + " |")
    plot(runs, Path(sweeps[0]) / "bitwise_control.png")


def plot(runs: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ACCURACY), figsize=(12, 4.2), sharey=True)
    for ax, (key, label) in zip(axes, ACCURACY.items()):
        table = compared(runs, key)
        names = [f"{'vLLM + noise' if 'perturb' in r.arm else 'vLLM'}\n{r.correction}" for r in table.itertuples()]
        ax.errorbar(range(len(table)), table["mean_diff"],
                    yerr=[table["mean_diff"] - table["ci_low"], table["ci_high"] - table["mean_diff"]], fmt="o")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xticks(range(len(table)), names, fontsize=7)
        ax.set_title(f"{label}: Δ accuracy vs the bitwise control")
    axes[0].set_ylabel("held-out accuracy − control (95% CI)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
