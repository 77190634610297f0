"""What the mismatch costs each correction, measured against zero mismatch, from the experiment's sweeps:

    .venv/bin/python experiments/bitwise_control/analyze.py SWEEP [SWEEP ...]

SWEEP: the sweep directories of `rlmm train -m experiment=bitwise_control` (vLLM bf16, plain), the same with
`sampler.perturb=0.2` (amplified), with `train.staleness=2 train.decompose_staleness=true` (stale), and with
`sampler=bitwise correction=none` (the control; with the staleness also with `correction=tis|opsm`), in any order.
Each vLLM run is paired with the control at its own staleness (and correction, where run): the stale arms against a
bitwise control as stale, so the difference is the mismatch's alone.

1. Held-out accuracy at the last step (summary.json): the trained weights (`eval_accuracy_trained_end`, the same
   evaluation engine for every arm) and the deployed sampler (`eval_accuracy_end`). For each vLLM arm (condition x
   correction): the mean and the paired difference from the control (by seed: mean, 95% paired-t interval, p, and
   Holm's p over the arms of the table: rlmm/table/paired.py's `difference_stats` and statsmodels' Holm): a stale
   arm against the stale control with its own correction where that was run (`compared`). Then, with no mismatch at
   all: the stale control against the fresh one, and each stale control's correction against none.
2. The mismatch each arm trained with (mean |δ|, KL k3 over its steps; a stale arm's numerical part too) and its share of bitwise-identical tokens
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
         # stale arms (train.decompose_staleness): the sampler against the trainer at the weights that sampled
         "mismatch/numerical/kl_k3": "numerical KL k3", "agreement/frac_tokens_identical": "bitwise tokens"}
CONTROL = "bitwise"


def arm_of(overrides: dict) -> tuple[str, int]:
    """The run's arm (its label) and its staleness, which picks its control."""
    staleness = int(overrides.get("train.staleness", 0))
    stale = f", staleness {staleness}" if staleness else ""
    if overrides.get("sampler", "vllm") == "bitwise":
        return CONTROL + stale, staleness
    return ("vllm, perturb 0.2" if float(overrides.get("sampler.perturb", 0)) else "vllm") + stale, staleness


def runs_of(sweeps: list[str]) -> pd.DataFrame:
    rows = []
    for sweep in sweeps:
        for run in sorted(p for p in Path(sweep).iterdir() if (p / "summary.json").exists()):
            overrides = read_overrides(run)
            arm, staleness = arm_of(overrides)
            summary = json.loads((run / "summary.json").read_text())
            steps = pd.DataFrame([s for s in read_steps(run) if s["step"] > 0])
            rows.append({"arm": arm, "staleness": staleness, "control": arm.startswith(CONTROL),
                         "correction": overrides.get("correction", "none"), "seed": int(overrides["seed"]),
                         **{key: summary.get(key) for key in ACCURACY},
                         **{key: steps[key].mean() if key in steps else float("nan") for key in STEPS}})
    return pd.DataFrame(rows)


def controls_of(runs: pd.DataFrame, key: str) -> dict[tuple[int, str], pd.Series]:
    """The control runs' `key` by seed, for each (staleness, correction) the control was run with."""
    return {(staleness, correction): part.set_index("seed")[key]
            for (staleness, correction), part in runs[runs["control"]].groupby(["staleness", "correction"])}


def compared(runs: pd.DataFrame, key: str) -> pd.DataFrame:
    """Each vLLM arm x correction against the bitwise control at its staleness with the same correction where it was
    run, else with none, paired by seed, Holm over the table's rows. Without staleness a correction on the bitwise
    sampler is the identity (every ratio exactly 1: tests/test_bitwise.py), so the control without one stands for all;
    with staleness a correction also acts on the policy lag, and the control with the same correction isolates the
    mismatch."""
    controls = controls_of(runs, key)
    rows = []
    for (arm, staleness, correction), part in runs[~runs["control"]].groupby(["arm", "staleness", "correction"],
                                                                          sort=False):
        against = correction if (staleness, correction) in controls else "none"
        if (staleness, against) not in controls:
            continue
        control, here = controls[staleness, against], part.set_index("seed")[key]
        seeds = sorted(set(here.index) & set(control.index))
        stats = difference_stats(here.loc[seeds].to_numpy(), control.loc[seeds].to_numpy())
        rows.append({"arm": arm, "staleness": staleness, "correction": correction, "against": against,
                     "mean": here.loc[seeds].mean(), "control": control.loc[seeds].mean(), **stats})
    table = pd.DataFrame(rows)
    tested = table["p"].notna()
    table["p_holm"] = float("nan")
    if tested.any():
        table.loc[tested, "p_holm"] = multipletests(table.loc[tested, "p"], method="holm")[1]
    return table


def print_without_mismatch(runs: pd.DataFrame, key: str) -> None:
    """What the staleness costs and what each correction wins back with no mismatch at all, paired by seed: the stale
    control against the fresh one, and each stale control with a correction against the stale control without."""
    controls = controls_of(runs, key)
    pairs = [((s, "none"), (0, "none")) for s, c in controls if s and c == "none"]
    pairs += [((s, c), (s, "none")) for s, c in controls if s and c != "none"]
    for (s, c), (base_s, base_c) in pairs:
        if (base_s, base_c) not in controls:
            continue
        arm, base = controls[s, c], controls[base_s, base_c]
        seeds = sorted(set(arm.index) & set(base.index))
        stats = difference_stats(arm.loc[seeds].to_numpy(), base.loc[seeds].to_numpy())
        print(f"- bitwise, staleness {s}, {c} vs bitwise, staleness {base_s}, {base_c} ({stats['n']} seeds): "
              f"{stats['mean_diff']:+.4f} [{stats['ci_low']:+.4f}, {stats['ci_high']:+.4f}], p {stats['p']:.2g}")


def main(sweeps: list[str]) -> None:
    runs = runs_of(sweeps)
    print(f"{len(runs)} runs: " + ", ".join(f"{arm} x {sorted(set(part.correction))} ({len(part)})"
                                            for arm, part in runs.groupby("arm")))
    for key, label in ACCURACY.items():
        table = compared(runs, key)
        controls = ", ".join(f"{arm} + {correction} {part[key].mean():.4f} ({len(part)} seeds)"
                             for (arm, correction), part in runs[runs["control"]].groupby(["arm", "correction"]))
        print(f"\nheld-out accuracy at the last step, {label} ({key}); controls (sampler=bitwise): "
              f"{controls}\n")
        print("| rollouts | correction | n | mean | control's correction | control, same seeds | "
              "Δ vs the bitwise control [95% CI] | p | p (Holm) |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for row in table.itertuples():
            print(f"| {row.arm} | {row.correction} | {row.n} | {row.mean:.4f} | {row.against} | {row.control:.4f} | "
                  f"{row.mean_diff:+.4f} [{row.ci_low:+.4f}, {row.ci_high:+.4f}] | {row.p:.2g} | {row.p_holm:.2g} |")
        print(f"\nwithout mismatch ({key}):")
        print_without_mismatch(runs, key)
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
        names = [f"{'noise' if 'perturb' in r.arm else 'stale' if r.staleness else 'plain'}\n{r.correction}"
                 for r in table.itertuples()]  # every arm is vLLM bf16; its condition, then its correction
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
