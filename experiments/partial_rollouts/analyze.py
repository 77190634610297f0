"""Partial rollouts against whole responses at the same pipeline depth, from the experiment's sweep:

    .venv/bin/python experiments/partial_rollouts/analyze.py SWEEP

SWEEP: the sweep directory of `rlmm train -m experiment=partial_rollouts` (k = 4, chunks of 1 token; 5 corrections
x whole / partial x 8 seeds).

1. Held-out accuracy at the last step (summary.json: the trained weights and the deployed sampler): per correction,
   partial rollouts against whole responses, paired by seed (mean, 95% paired-t interval, p: rlmm/table/paired.py's
   `difference_stats`; Holm's p over the corrections: statsmodels).
2. Within each mode, each correction against TIS (the recomputed pi_old with token IS: decoupled PPO as rlmm runs it),
   paired by seed, Holm over the 8 comparisons: does sequence TIS lose on mixed responses (seq_tis − tis under
   partial rollouts, beside the same under whole responses, and their difference: the interaction), does the
   approximated proximal policy cost accuracy (prox_loglinear − tis)?
3. What each arm trained with (means over its steps, then over seeds): token staleness, the share of responses that
   straddle a sync, the mismatch (mean |δ|, KL k3), the tokens its correction dropped, and prox_loglinear's error
   against the recomputed pi_old.
Writes partial_rollouts.png beside the sweep: the paired differences of (1) and (2) with their intervals.
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
STEPS = {"rollout/token_staleness_mean": "token staleness", "rollout/frac_responses_mixed": "mixed responses",
         "mismatch/logprob_abs_diff_mean": "mean |δ|", "mismatch/kl_k3": "KL k3",
         "correction/frac_tokens_masked": "dropped (batch)", "correction/frac_tokens_dropped": "dropped (update)",
         "correction/logp_abs_error": "prox |error|"}
CORRECTIONS = ["none", "tis", "seq_tis", "token_staleness_mask", "prox_loglinear"]
MODES = ("whole", "partial")


def runs_of(sweep: str) -> pd.DataFrame:
    rows = []
    for run in sorted(p for p in Path(sweep).iterdir() if (p / "summary.json").exists()):
        overrides = read_overrides(run)
        summary = json.loads((run / "summary.json").read_text())
        steps = pd.DataFrame([s for s in read_steps(run) if s["step"] > 0])
        rows.append({"mode": "partial" if str(overrides["train.partial_rollouts"]).lower() == "true" else "whole",
                     "correction": overrides["correction"], "seed": int(overrides["seed"]),
                     **{key: summary.get(key) for key in ACCURACY},
                     **{key: steps[key].mean() if key in steps else float("nan") for key in STEPS}})
    return pd.DataFrame(rows)


def holm(table: pd.DataFrame) -> pd.DataFrame:
    tested = table["p"].notna()
    table["p_holm"] = float("nan")
    if tested.any():
        table.loc[tested, "p_holm"] = multipletests(table.loc[tested, "p"], method="holm")[1]
    return table


def paired(a: pd.Series, b: pd.Series) -> dict:
    seeds = sorted(set(a.index) & set(b.index))
    return {"a": a.loc[seeds].mean(), "b": b.loc[seeds].mean(),
            **difference_stats(a.loc[seeds].to_numpy(), b.loc[seeds].to_numpy())}


def partial_vs_whole(runs: pd.DataFrame, key: str) -> pd.DataFrame:
    arm = {(m, c): part.set_index("seed")[key] for (m, c), part in runs.groupby(["mode", "correction"])}
    return holm(pd.DataFrame([{"correction": c, **paired(arm["partial", c], arm["whole", c])}
                              for c in CORRECTIONS if ("partial", c) in arm and ("whole", c) in arm]))


def against_tis(runs: pd.DataFrame, key: str) -> pd.DataFrame:
    arm = {(m, c): part.set_index("seed")[key] for (m, c), part in runs.groupby(["mode", "correction"])}
    return holm(pd.DataFrame([{"mode": m, "correction": c, **paired(arm[m, c], arm[m, "tis"])}
                              for m in MODES for c in CORRECTIONS if c != "tis" and (m, c) in arm and (m, "tis") in arm]))


def interaction(runs: pd.DataFrame, key: str) -> pd.DataFrame:
    """(c − tis under partial rollouts) − (c − tis under whole responses), paired by seed: what mixing versions in a
    response changes in a correction's gap to TIS."""
    arm = {(m, c): part.set_index("seed")[key] for (m, c), part in runs.groupby(["mode", "correction"])}
    gap = {m: {c: arm[m, c] - arm[m, "tis"] for c in CORRECTIONS if c != "tis" and (m, c) in arm} for m in MODES}
    return holm(pd.DataFrame([{"correction": c, **paired(gap["partial"][c], gap["whole"][c])}
                              for c in gap["partial"] if c in gap["whole"]]))


def row(r) -> str:
    return (f"{r.n} | {r.a:.4f} | {r.b:.4f} | {r.mean_diff:+.4f} [{r.ci_low:+.4f}, {r.ci_high:+.4f}] | {r.p:.2g} | "
            f"{r.p_holm:.2g} |")


def main(sweep: str) -> None:
    runs = runs_of(sweep)
    print(f"{len(runs)} runs, seeds {sorted(set(runs.seed))}")
    for key, label in ACCURACY.items():
        print(f"\n{label} ({key}): partial rollouts − whole responses, paired by seed, Holm over the corrections\n")
        print("| correction | n | partial | whole | Δ [95% CI] | p | p (Holm) |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for r in partial_vs_whole(runs, key).itertuples():
            print(f"| {r.correction} | " + row(r))
        print(f"\n{label}: each correction − tis in the same mode, paired by seed, Holm over the table\n")
        print("| rollouts | correction | n | correction | tis | Δ [95% CI] | p | p (Holm) |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in against_tis(runs, key).itertuples():
            print(f"| {r.mode} | {r.correction} | " + row(r))
        print(f"\n{label}: (correction − tis | partial) − (correction − tis | whole), paired by seed, Holm\n")
        print("| correction | n | gap, partial | gap, whole | Δ [95% CI] | p | p (Holm) |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for r in interaction(runs, key).itertuples():
            print(f"| {r.correction} | " + row(r))
    print("\nwhat each arm trained with (means over its steps, then over seeds)\n")
    print("| rollouts | correction | runs | " + " | ".join(STEPS.values()) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in STEPS) + " |")
    for (mode, correction), part in runs.groupby(["mode", "correction"]):
        print(f"| {mode} | {correction} | {len(part)} | " + " | ".join(f"{part[k].mean():.3g}" for k in STEPS) + " |")
    plot(runs, Path(sweep) / "partial_rollouts.png")


def plot(runs: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    key = "eval_accuracy_trained_end"
    for ax, (table, names, title) in zip(axes, [
            (t := partial_vs_whole(runs, key), [c.replace("_", "\n") for c in t["correction"]],
             "partial − whole responses, same correction"),
            (u := against_tis(runs, key), [f"{m}\n{c.replace('_', chr(10))}" for m, c in zip(u["mode"], u["correction"])],
             "correction − tis, same rollouts")]):
        ax.errorbar(range(len(table)), table["mean_diff"],
                    yerr=[table["mean_diff"] - table["ci_low"], table["ci_high"] - table["mean_diff"]], fmt="o")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xticks(range(len(table)), names, fontsize=7)
        ax.set_title(title)
    axes[0].set_ylabel("Δ held-out accuracy, trained weights (95% CI)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:][0])
