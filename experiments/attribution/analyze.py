"""Where the mismatch comes from, from the experiment's sweeps (experiments/attribution/README.md):

    .venv/bin/python experiments/attribution/analyze.py multirun/experiments/attribution/<date>_<time> \
        [--training multirun/experiments/attribution_training/<date>_<time>] [--probe-runs <dir> ...]

1. Op classes (probe.json `attribution`): per model and sampler dtype, each op class's share of the gap raised to
   fp32 alone and lowered alone (mean |δ| and KL k3), as the mean over seeds with the seeds' range, and the
   interaction (Σ shares - 1).
2. Layers (probe.json `layers`): per model and dtype, the first departing site of each comparison (kernels:
   sampler vs trainer at equal dtype; precision: the trainer's rounding alone; total), the relative error of the
   stream after layer 0 and at the final norm, and inside the first departing layer each part's error.
3. With --training: the op-class shares and the all-low gap over the steps of each learning-rate arm, and the
   statistics beside them (largest attention score, LM head logit range, weight RMS).
--probe-runs adds single probe runs (e.g. the 0.5B checkpoint's) to tables 1 and 2, named by their directory.
Writes attribution_shares.png, attribution_layers.png (and attribution_training.png) beside the first sweep.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd

from rlmm.mismatch.attribution import OP_CLASSES
from rlmm.run.records import read_steps
from rlmm.table.discovery import read_overrides

GAP = {"logprob_abs_diff_mean": "mean |δ|", "kl_k3": "KL k3"}


def probe_rows(sweep: Path, named: bool = False) -> list[dict]:
    """The sweep's runs, or (`named`) one run directory named `<model>` or `<model>-seed<N>`."""
    rows = []
    runs = sorted((p for p in sweep.iterdir() if (p / "probe.json").exists()), key=lambda p: int(p.name))
    for run in runs if not named else [sweep]:
        record = json.loads((run / "probe.json").read_text())
        if named:
            model, _, seed = re.fullmatch(r"(.+?)(-seed(\d+))?", run.name).groups()
            overrides = {"model": model, "seed": seed or 0}
        else:
            overrides = read_overrides(run)
        rows.append({"model": overrides.get("model", "tiny"), "dtype": record["attribution"]["dtype"],
                     "seed": int(overrides.get("seed", 0)), "record": record})
    return rows


def op_table(rows: list[dict]) -> pd.DataFrame:
    table = []
    for row in rows:
        attribution = row["record"]["attribution"]
        for op, parts in attribution["ops"].items():
            for key in GAP:
                table.append({"model": row["model"], "dtype": row["dtype"], "seed": row["seed"], "op": op,
                              "gap": key, "raised": parts["share_raised"][key], "lowered": parts["share_lowered"][key],
                              "all_low": attribution["all_low"][key]})
        for key in GAP:
            table.append({"model": row["model"], "dtype": row["dtype"], "seed": row["seed"], "op": "Σ - 1",
                          "gap": key, "raised": attribution["interaction"]["raised"][key],
                          "lowered": attribution["interaction"]["lowered"][key],
                          "all_low": attribution["all_low"][key]})
    return pd.DataFrame(table)


def spread(values: pd.Series) -> str:
    if len(values) == 1:
        return f"{values.iloc[0]:+.0%}"
    return f"{values.mean():+.0%} [{values.min():+.0%}, {values.max():+.0%}]"


def print_ops(ops: pd.DataFrame) -> None:
    for (model, dtype), part in ops.groupby(["model", "dtype"], sort=False):
        seeds = part["seed"].nunique()
        low = part[part["op"] != "Σ - 1"].groupby("gap")["all_low"].mean()
        print(f"\n### {model}, {dtype} sampler dtype ({seeds} seed{'s' * (seeds > 1)}; every op {dtype}: mean |δ| "
              f"{low['logprob_abs_diff_mean']:.3g}, KL k3 {low['kl_k3']:.3g})\n")
        print("| op class | raised alone: share of mean \\|δ\\| removed | of KL k3 | lowered alone: share of mean "
              "\\|δ\\| brought back | of KL k3 |")
        print("|---|---|---|---|---|")
        for op in part["op"].unique():
            cells = [spread(part[(part["op"] == op) & (part["gap"] == key)][direction])
                     for direction in ("raised", "lowered") for key in GAP]
            print(f"| {op} | " + " | ".join(cells) + " |")


def print_layers(rows: list[dict]) -> None:
    print("\n| model | dtype | comparison | first departing site (seeds) | stream after layer 0 | at the final norm | "
          "growth | inside the first departing layer (kernels: each part's relative error, share identical) |")
    print("|---|---|---|---|---|---|---|---|")
    frame = pd.DataFrame(rows)
    for (model, dtype), part in frame.groupby(["model", "dtype"], sort=False):
        for name in ("kernels", "precision", "total"):
            figures = [r["layers"]["comparisons"].get(name) for r in part["record"]]
            if any(f is None for f in figures):
                continue
            sites = part["record"].iloc[0]["layers"]["sites"]
            firsts = pd.Series([f["first_departing"] for f in figures]).value_counts()
            after0 = np.mean([f["rel_error"][sites.index("layer_0")] for f in figures])
            final = np.mean([f["rel_error"][-1] for f in figures])
            growth = np.mean([f["growth"] for f in figures])
            inside = ""
            if name == "kernels" and firsts.index[0] is not None:
                layer = firsts.index[0].split(".")[0]
                inside = ", ".join(
                    f"{site.split('.')[-1] if '.' in site else 'stream'} "
                    f"{np.mean([f['rel_error'][i] for f in figures]):.1e} "
                    f"({np.mean([f['frac_identical'][i] for f in figures]):.0%})"
                    for i, site in enumerate(sites) if site.split(".")[0] == layer)
            first = ", ".join(f"{site} ({n})" for site, n in firsts.items())
            print(f"| {model} | {dtype} | {name} | {first} | {after0:.2e} | {final:.2e} | {growth:.2g}x | {inside} |")


def plot_shares(ops: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(ops.groupby(["model", "dtype"], sort=False))
    columns = min(3, len(groups))
    rows = -(-len(groups) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 3.8 * rows), squeeze=False)
    order = [op for op in OP_CLASSES if op in set(ops["op"])]  # one order for every panel, the router where it is
    for ax, ((model, dtype), part) in zip(axes.flat, groups):
        part = part[(part["gap"] == "logprob_abs_diff_mean") & (part["op"] != "Σ - 1")]
        for offset, direction, label in ((-0.2, "raised", "raised to fp32 alone: share removed"),
                                         (0.2, "lowered", f"lowered alone: share brought back")):
            mean = part.groupby("op")[direction].mean().reindex(order)
            low = mean - part.groupby("op")[direction].min().reindex(order)
            high = part.groupby("op")[direction].max().reindex(order) - mean
            ax.barh(np.arange(len(order)) + offset, mean, height=0.4, xerr=[low, high], label=label, capsize=2)
        ax.axvline(0, color="0.3", linewidth=0.8)
        ax.set_yticks(range(len(order)), order)
        ax.invert_yaxis()
        ax.set_title(f"{model}, {dtype} ({part['seed'].nunique()} seeds)", fontsize=10)
        ax.set_xlabel("share of the all-low mean |δ|")
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.suptitle("op-class attribution (mean over seeds, bars: the seeds' range)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_layers(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frame = pd.DataFrame(rows)
    groups = list(frame.groupby(["model", "dtype"], sort=False))
    columns = min(3, len(groups))
    fig, axes = plt.subplots(-(-len(groups) // columns), columns, figsize=(4.6 * columns, 7.6), squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    for ax, ((model, dtype), part) in zip(axes.flat, groups):
        sites = part["record"].iloc[0]["layers"]["sites"]
        stream = [i for i, s in enumerate(sites) if "." not in s]
        for name, style in (("kernels", "o-"), ("precision", "s-"), ("total", "^-")):
            curves = [r["layers"]["comparisons"][name]["rel_error"] for r in part["record"]
                      if name in r["layers"]["comparisons"]]
            if curves:
                ax.plot(range(len(stream)), np.mean(curves, 0)[stream], style, label=name)
        ax.set_yscale("symlog", linthresh=1e-6)
        ax.set_xticks(range(len(stream)), [sites[i] for i in stream], rotation=60, fontsize=7)
        ax.set_title(f"{model}, {dtype}", fontsize=10)
    axes[0][0].set_ylabel("mean ||Δh|| / ||h|| of the stream")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("layer attribution: the residual stream's relative error by depth (mean over seeds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def training(sweep: Path, path: Path) -> None:
    """Per learning-rate arm: the op-class shares (mean |δ|; the plot: lowered, the steadier direction on ~60 tokens)
    and the all-low gap at each measured step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for run in sorted(p for p in sweep.iterdir() if (p / "steps.jsonl").exists()):
        overrides = read_overrides(run)
        for step in read_steps(run):
            if "attribution/all_low/logprob_abs_diff_mean" in step:
                rows.append({"lr": overrides["trainer.lr"], "seed": int(overrides["seed"]), **step})
    frame = pd.DataFrame(rows)
    ops = sorted({k.split("/")[1] for k in frame.columns if k.startswith("attribution/") and "/share_raised/" in k})
    print("\n| lr | step | every op bf16: mean \\|δ\\| | KL k3 | " + " | ".join(f"{op} raised / lowered" for op in ops)
          + " | attention max | LM head range | layer 0 weight RMS |")
    print("|" + "---|" * (6 + len(ops)))
    for (lr, step), part in frame.groupby(["lr", "step"]):
        cells = [f"{part['attribution/all_low/logprob_abs_diff_mean'].mean():.3g}",
                 f"{part['attribution/all_low/kl_k3'].mean():.3g}"]
        cells += [f"{part[f'attribution/{op}/share_raised/logprob_abs_diff_mean'].mean():+.0%} / "
                  f"{part[f'attribution/{op}/share_lowered/logprob_abs_diff_mean'].mean():+.0%}" for op in ops]
        cells += [f"{part['logits/attention_max'].mean():.3g}", f"{part['logits/lm_head_range_mean'].mean():.3g}",
                  f"{part['weights/layer_0/rms'].mean():.4g}"]
        print(f"| {lr} | {step} | " + " | ".join(cells) + " |")
    lrs = sorted(frame["lr"].unique(), key=float)
    fig, axes = plt.subplots(1, len(lrs) + 1, figsize=(5 * (len(lrs) + 1), 4))
    for ax, lr in zip(axes, lrs):
        part = frame[frame["lr"] == lr].groupby("step").mean(numeric_only=True)
        for op in ops:
            ax.plot(part.index, part[f"attribution/{op}/share_lowered/logprob_abs_diff_mean"], "o-", label=op)
        ax.set_title(f"trainer.lr={lr}: share of mean |δ| lowering each op alone brings back", fontsize=9)
        ax.set_xlabel("step")
    axes[0].legend(fontsize=7)
    for lr in lrs:
        part = frame[frame["lr"] == lr].groupby("step").mean(numeric_only=True)
        axes[-1].plot(part.index, part["attribution/all_low/logprob_abs_diff_mean"], "o-", label=f"lr {lr}")
    axes[-1].set_title("every op bf16 vs fp32: mean |δ|", fontsize=9)
    axes[-1].set_yscale("log")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--training", type=Path)
    parser.add_argument("--probe-runs", type=Path, nargs="*", default=[])
    args = parser.parse_args()
    rows = probe_rows(args.sweep) + [r for run in args.probe_runs for r in probe_rows(run, named=True)]
    ops = op_table(rows)
    print("## Op classes")
    print_ops(ops)
    print("\n## Layers")
    print_layers(rows)
    plot_shares(ops, args.sweep / "attribution_shares.png")
    plot_layers(rows, args.sweep / "attribution_layers.png")
    if args.training:
        print("\n## Over training")
        training(args.training, args.sweep / "attribution_training.png")


if __name__ == "__main__":
    main()
