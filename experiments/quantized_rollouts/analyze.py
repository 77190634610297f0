"""FlashRL's claim and AIS's, from the experiment's sweep:

    .venv/bin/python experiments/quantized_rollouts/analyze.py multirun/experiments/quantized_rollouts/<date>_<time>

1. Held-out accuracy at the last step (trained weights and the deployed, quantized sampler; summary.json) per
   rollout mode and correction: the mean, the paired difference (by seed; mean, 95% paired-t interval, p) of each
   quantized mode from bf16 rollouts with the same correction (FlashRL: below without a correction, level with
   TIS), and of TIS from none in the same mode.
2. The mismatch per mode (mean |δ|, KL k3; steps.jsonl, the correction arms pooled, as it is measured before any
   correction acts): over the whole run, early (steps 1-10) and late (steps 51-60), and the late/early ratio per
   run (geometric mean, 95% interval): does the quantization mismatch change as the policy concentrates (AIS),
   with the policy's entropy (`loss/entropy`) early and late beside it.
Writes quantized_rollouts.png beside the sweep: the mismatch over the steps per mode, and the accuracy bars.
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

ACCURACY = {"eval_accuracy_trained_end": "trained weights", "eval_accuracy_end": "deployed sampler"}
GAP = {"logprob_abs_diff_mean": "mean |δ|", "kl_k3": "KL k3"}
EARLY, LATE = range(1, 11), range(51, 61)
MODES = {("none", "auto"): "bf16", ("int8", "auto"): "int8", ("none", "fp8_e4m3"): "fp8 KV",
         ("int8", "fp8_e4m3"): "int8 + fp8 KV"}


def runs_of(sweep: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    rows, curves = [], []
    for run in sorted(p for p in Path(sweep).iterdir() if (p / "summary.json").exists()):
        overrides = read_overrides(run)
        # `quantization=` since issue 51; the sweep in README.md ran before, as `sampler.quantization=`
        weights = overrides["quantization"] if "quantization" in overrides else overrides["sampler.quantization"]
        mode = MODES[(weights, overrides["sampler.kv_cache_dtype"])]
        summary = json.loads((run / "summary.json").read_text())
        steps = pd.DataFrame([s for s in read_steps(run) if s["step"] > 0]).set_index("step")
        row = {"mode": mode, "correction": overrides["correction"], "seed": int(overrides["seed"])}
        row |= {key: summary.get(key) for key in ACCURACY}
        for key in [*GAP, "loss/entropy"]:
            column = key if key.startswith("loss/") else f"mismatch/{key}"
            row[f"{key}:mean"] = steps[column].mean()
            row[f"{key}:early"] = steps.loc[steps.index.isin(EARLY), column].mean()
            row[f"{key}:late"] = steps.loc[steps.index.isin(LATE), column].mean()
        rows.append(row)
        curves.append(steps[[f"mismatch/{k}" for k in GAP]].assign(mode=mode, correction=row["correction"],
                                                                  seed=row["seed"]).reset_index())
    return pd.DataFrame(rows), pd.concat(curves)


def paired(a: pd.Series, b: pd.Series) -> str:
    d = (a - b).dropna()
    if len(d) < 2 or (d == 0).all():
        return f"{d.mean():+.4f} (n={len(d)})"
    test = stats.ttest_1samp(d, 0)
    low, high = test.confidence_interval(0.95)
    return f"{d.mean():+.4f} [{low:+.4f}, {high:+.4f}] p={test.pvalue:.2g}"


def ratio(late: pd.Series, early: pd.Series) -> str:
    logs = np.log(late / early).dropna()
    low, high = stats.ttest_1samp(logs, 0).confidence_interval(0.95)
    return f"{np.exp(logs.mean()):.3g}x [{np.exp(low):.3g}, {np.exp(high):.3g}]"


def main(sweep: str) -> None:
    runs, curves = runs_of(sweep)
    modes = [m for m in MODES.values() if m in set(runs["mode"])]
    corrections = list(dict.fromkeys(runs.correction))
    print(f"{len(runs)} runs: modes {modes}, corrections {corrections}, seeds {sorted(runs.seed.unique())}")
    for key, label in ACCURACY.items():
        table = runs.pivot_table(index="seed", columns=["mode", "correction"], values=key)
        print(f"\nheld-out accuracy at the last step, {label} ({key})\n")
        print("| rollouts | correction | n | mean | Δ vs bf16, same correction [95% CI] | Δ tis vs none, same rollouts "
              "[95% CI] |")
        print("| --- | --- | --- | --- | --- | --- |")
        for mode in modes:
            for c in corrections:
                here = table[(mode, c)]
                versus_bf16 = "—" if mode == "bf16" else paired(here, table[("bf16", c)])
                versus_none = "—" if c == "none" else paired(here, table[(mode, "none")])
                print(f"| {mode} | {c} | {here.notna().sum()} | {here.mean():.4f} | {versus_bf16} | {versus_none} |")
    print("\nthe mismatch per rollout mode (sampler vs trainer before any correction; both corrections pooled)\n")
    print("| rollouts | runs | mean |δ| (run) | KL k3 (run) | mean |δ| late / early [95% CI] | KL k3 late / early "
          "[95% CI] | entropy early → late |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for mode in modes:
        part = runs[runs["mode"] == mode]
        print(f"| {mode} | {len(part)} | {part['logprob_abs_diff_mean:mean'].mean():.3g} | "
              f"{part['kl_k3:mean'].mean():.3g} | "
              f"{ratio(part['logprob_abs_diff_mean:late'], part['logprob_abs_diff_mean:early'])} | "
              f"{ratio(part['kl_k3:late'], part['kl_k3:early'])} | "
              f"{part['loss/entropy:early'].mean():.3g} → {part['loss/entropy:late'].mean():.3g} |")
    bf16 = runs[runs["mode"] == "bf16"].set_index(["correction", "seed"])
    print("\nper run, each quantized mode's mismatch over bf16 rollouts' (same correction and seed; geometric mean)\n")
    print("| rollouts | mean |δ| ratio [95% CI] | KL k3 ratio [95% CI] |")
    print("| --- | --- | --- |")
    for mode in modes[1:]:
        part = runs[runs["mode"] == mode].set_index(["correction", "seed"])
        print(f"| {mode} | {ratio(part['logprob_abs_diff_mean:mean'], bf16['logprob_abs_diff_mean:mean'])} | "
              f"{ratio(part['kl_k3:mean'], bf16['kl_k3:mean'])} |")
    plot(runs, curves, modes, corrections, Path(sweep) / "quantized_rollouts.png")


def plot(runs: pd.DataFrame, curves: pd.DataFrame, modes: list[str], corrections: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    for ax, key in zip(axes[:2], GAP):
        for i, mode in enumerate(modes):
            mean = curves[curves["mode"] == mode].groupby("step")[f"mismatch/{key}"].mean()
            ax.plot(mean.index, mean.rolling(5, min_periods=1).mean(), color=f"C{i}", label=mode)
        ax.set(xlabel="step", ylabel=GAP[key], yscale="log",
               title=f"sampler vs trainer, {GAP[key]} (mean over runs, 5-step rolling)")
        ax.legend()
    width = 0.8 / len(corrections)
    for j, c in enumerate(corrections):
        means = [runs[(runs["mode"] == m) & (runs.correction == c)]["eval_accuracy_trained_end"] for m in modes]
        x = np.arange(len(modes)) + j * width
        axes[2].bar(x, [m.mean() for m in means], width, yerr=[m.std() / np.sqrt(len(m)) for m in means],
                    label=c, capsize=3)
    axes[2].set(xticks=np.arange(len(modes)) + width * (len(corrections) - 1) / 2, xticklabels=modes,
                ylabel="held-out accuracy, trained weights (last step)", title="accuracy ± s.e. over seeds",
                ylim=(0.7, 0.9))
    axes[2].legend(title="correction")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nplot: {path}")


if __name__ == "__main__":
    main(sys.argv[1])
