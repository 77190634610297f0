"""The figures: `curves.png` (each metric over steps, one line per configuration, CI band), `bars.png`
(the headline metric per configuration, CI error bars) and `paired.png` (the paired differences from a
baseline with their intervals, the significant ones marked). matplotlib is imported on first use."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from rlmm.table.frames import parse_metric
from rlmm.table.stats import CONFIDENCE, ci_half_width


def config_label(row, by: list[str]) -> str:
    return " ".join(f"{k}={row[k]}" for k in by) or "all runs"


def plot_curves(df: pd.DataFrame, steps: pd.DataFrame, metrics: list[str], path: Path, by: list[str],
                include_incomplete: bool = False) -> bool:
    """Each metric over steps, one line per configuration: mean over its counted runs at each step,
    shaded band = the 95% CI at that step (where ≥ 2 runs logged it). False if no run has steps."""
    # One panel per metric: `--metric X:final --metric X:best` plot the same curve.
    names = list(dict.fromkeys(n for n, _ in (parse_metric(m) for m in metrics) if n in steps.columns))
    if steps.empty or not names:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counted = df[df["status"].isin(["complete", "incomplete"] if include_incomplete else ["complete"])]
    groups = counted.groupby(by, sort=False, dropna=False) if by else [((), counted)]
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.8), squeeze=False)
    for ax, name in zip(axes[0], names):
        lowest_mean = float("inf")
        for _, group in groups:
            rows = steps[steps["run"].isin(group["run"])].dropna(subset=[name])
            if rows.empty:
                continue
            per_step = rows.groupby("step")[name]
            mean = per_step.mean()
            ci = per_step.apply(lambda v: ci_half_width(list(v)))
            line, = ax.plot(mean.index, mean.values, marker="o" if len(mean) < 12 else None, markersize=3,
                            label=config_label(group.iloc[0], by))
            ax.fill_between(mean.index, mean - ci.fillna(0), mean + ci.fillna(0), alpha=0.2, color=line.get_color())
            if (mean > 0).any():
                lowest_mean = min(lowest_mean, float(mean[mean > 0].min()))
        if _log_if_spread(steps.loc[steps["run"].isin(counted["run"]), name]):
            ax.set_yscale("log")
            if lowest_mean < float("inf"):  # a band reaching 0 would stretch the axis down to 1e-14
                ax.set_ylim(bottom=lowest_mean / 10)
        ax.set_title(name)
        ax.set_xlabel("step")
    if axes[0][0].get_legend_handles_labels()[0]:
        axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _log_if_spread(values: pd.Series) -> bool:
    """Whether to use a log scale: positive values spread over more than two decades (KL across precisions)."""
    values = values.dropna()
    return bool(len(values)) and bool((values > 0).all()) and values.max() > 100 * values.min()


def plot_bars(agg: pd.DataFrame, path: Path, by: list[str]) -> None:
    """The headline (first) metric per configuration, error bars = 95% CI half-width."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    head = agg[(agg["metric"] == agg["metric"].iloc[0]) & (agg["reduction"] == agg["reduction"].iloc[0])]
    labels = [f"{config_label(row, by)} (n={row['n']})" for _, row in head.iterrows()]
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.35 * len(head)))
    ax.barh(range(len(head)), head["mean"].fillna(0), xerr=head["ci95"].to_numpy(), capsize=3, color="C0")
    ax.set_yticks(range(len(head)), labels, fontsize=8)
    ax.invert_yaxis()  # first configuration on top, as in the table
    if _log_if_spread(head["mean"]):
        ax.set_xscale("log")
    ax.set_xlabel(f"{head['metric'].iloc[0]} ({head['reduction'].iloc[0]})")
    ax.set_title(f"mean ± {CONFIDENCE:.0%} CI over seeds", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_paired(paired: pd.DataFrame, path: Path, key: str, baseline: str) -> None:
    """One panel per metric: each arm's (and configuration's) mean paired difference from the baseline,
    error bars = its 95% interval, a line at 0; red with a star where Holm-adjusted p < 0.05."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(paired.groupby(["metric", "reduction"], sort=False))
    rows = max((len(p) for _, p in panels), default=1)
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(2.5 + 3.5 * max(len(panels), 1), 1.4 + 0.4 * rows),
                             squeeze=False, sharey=True)  # every metric has the same rows
    for ax, ((metric, reduction), panel) in zip(axes[0], panels):
        y = range(len(panel))
        mean = panel["mean_diff"].to_numpy()
        err = [(panel["mean_diff"] - panel["ci_low"]).fillna(0).to_numpy(),
               (panel["ci_high"] - panel["mean_diff"]).fillna(0).to_numpy()]
        for i, significant in enumerate(panel["significant"]):
            color = "C3" if significant else "C0"
            ax.errorbar(mean[i], i, xerr=[[err[0][i]], [err[1][i]]], fmt="o", color=color, capsize=3)
            if significant:
                ax.annotate("*", (mean[i], i), textcoords="offset points", xytext=(0, 4), ha="center", color=color)
        ax.axvline(0, color="grey", linewidth=0.8)
        ax.ticklabel_format(axis="x", style="sci", scilimits=(-2, 3))
        labels = [" ".join(f"{k}={r[k]}" for k in paired.attrs["axes"]) for _, r in panel.iterrows()]
        ax.set_yticks(list(y), labels, fontsize=8)
        ax.set_ylim(len(panel) - 0.5, -0.5)  # first row on top, as in the table
        ax.set_title(f"{metric} ({reduction})", fontsize=9)
    fig.suptitle(f"Δ = arm − {key}={baseline}, paired by seed, {CONFIDENCE:.0%} CI; red *: Holm-adjusted p < 0.05",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
