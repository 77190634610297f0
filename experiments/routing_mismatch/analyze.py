"""The routing part of the sampler-vs-trainer gap on the built-in MoE model, per sampler precision, from the
experiment's sweep:

    .venv/bin/python experiments/routing_mismatch/analyze.py multirun/experiments/routing_mismatch/<date>_<time>

Every probe scores its rollouts both ways (the trainer routing itself, and replaying the sampler's experts), so
each seed gives one pair on the same tokens; the `routing=none` and `routing=r3` runs of a seed share their
rollouts (the same sampler seed), so the second is a check of the first: the r3 run's own scoring
(mismatch/*) must equal the none run's replayed one (routing/replayed/*). Per precision: the routing
disagreement, the gap with and without replay, and replay's effect as a paired difference (replayed − own,
paired t over seeds, scipy) and as the share removed, 1 − G_replayed / G_own. Writes routing.png beside it.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from scipy import stats

from rlmm.table.frames import load_runs

PRECISIONS = ("bf16", "fp16", "fp32")
GAPS = {"logprob_abs_diff_mean": "mean |δ|", "kl_k3": "KL k3", "seq_logratio_abs_max": "max |Σδ| of a sequence"}


def mean_ci(values: np.ndarray) -> str:
    if len(values) < 2 or np.all(values == values[0]):
        return f"{values.mean():.3g}"
    low, high = stats.ttest_1samp(values, values.mean()).confidence_interval(0.95)
    return f"{values.mean():.3g} [{low:.3g}, {high:.3g}]"


def main(sweep: str) -> None:
    runs = load_runs(sweep)
    runs = runs[runs.status == "complete"]
    none, r3 = (runs[runs.routing == mode].set_index(["precision.sampler_dtype", "seed"]) for mode in ("none", "r3"))
    shared = none.index.intersection(r3.index)
    # a sweep of routing=none alone (each probe scores both ways) has no pairs to check
    for gap in GAPS if len(shared) else ():  # the two runs of a seed score the same tokens with the same experts: the same numbers
        check = np.abs(r3.loc[shared, f"mismatch/{gap}:final"] - none.loc[shared, f"routing/replayed/{gap}:final"])
        print(f"check {gap}: r3 run's own scoring vs none run's replayed scoring, max |difference| {check.max():.3g}")

    print("\n| sampler | seeds | decisions differ | tokens differ (≥ 1 layer) | per layer | differing decisions that "
          "can move a scored log-prob |")
    print("| --- | --- | --- | --- | --- | --- |")
    for precision in PRECISIONS:
        part = none.loc[precision]
        layers = sorted(c for c in part.columns if c.startswith("routing/frac_decisions_differ_layer_") and c.endswith(":final"))
        print(f"| {precision} | {len(part)} | {mean_ci(part['routing/frac_decisions_differ:final'].to_numpy())} | "
              f"{mean_ci(part['routing/frac_tokens_differ:final'].to_numpy())} | "
              + ", ".join(f"{part[c].mean():.2%}" for c in layers) + " | "
              f"{part['routing/differing_decisions_reaching_scores:final'].sum():.0f} of "
              f"{part['routing/differing_decisions:final'].sum():.0f} |")

    print("\n| sampler | gap | own routing | replayed | replayed − own, paired [95% CI] | p | share removed |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for precision in PRECISIONS:
        part = none.loc[precision]
        for gap, label in GAPS.items():
            own, replayed = part[f"routing/own/{gap}:final"].to_numpy(), part[f"routing/replayed/{gap}:final"].to_numpy()
            diff = replayed - own
            if np.all(diff == 0):
                ci, p = "0 (every seed)", "—"
            else:
                test = stats.ttest_rel(replayed, own)
                low, high = test.confidence_interval(0.95)
                ci, p = f"{diff.mean():+.3g} [{low:+.3g}, {high:+.3g}]", f"{test.pvalue:.3g}"
            share = 1 - replayed.mean() / own.mean() if own.mean() else 0.0
            print(f"| {precision} | {label} | {own.mean():.4g} | {replayed.mean():.4g} | {ci} | {p} | {share:.1%} |")
    plot(none, Path(sweep) / "routing.png")


def plot(none, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    layers = sorted(c for c in none.columns if c.startswith("routing/frac_decisions_differ_layer_") and c.endswith(":final"))
    width = 0.8 / len(PRECISIONS)
    for i, precision in enumerate(PRECISIONS):
        part = none.loc[precision]
        left.bar(np.arange(len(layers)) + i * width, [100 * part[c].mean() for c in layers], width, label=precision)
        own, replayed = part["routing/own/kl_k3:final"], part["routing/replayed/kl_k3:final"]
        for a, b in zip(own, replayed):
            right.plot([i - 0.15, i + 0.15], [a, b], color="grey", alpha=0.5)
        right.scatter([i - 0.15] * len(own), own, color="C0", s=12, label="own routing" if i == 0 else None)
        right.scatter([i + 0.15] * len(replayed), replayed, color="C1", s=12, label="replayed (R3)" if i == 0 else None)
    left.set_xticks(np.arange(len(layers)) + width, [c.removesuffix(":final").rsplit("_", 1)[1] for c in layers])
    left.set(xlabel="MoE layer", ylabel="decisions differing (%)", title="sampler vs fp32 trainer: routing")
    left.legend(title="sampler")
    right.set_xticks(range(len(PRECISIONS)), PRECISIONS)
    right.set(yscale="log", xlabel="sampler precision", ylabel="KL k3 (sampler vs trainer)",
              title="the gap, trainer's own routing vs replayed (per seed)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nplot: {path}")


if __name__ == "__main__":
    main(sys.argv[1])
