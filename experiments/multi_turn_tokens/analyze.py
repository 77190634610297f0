"""Token path x correction on the calculator task, from the experiment's sweep:

    .venv/bin/python experiments/multi_turn_tokens/analyze.py SWEEP [SWEEP ...] [--csv runs.csv]

SWEEP: a sweep directory of `rlmm train -m experiment=multi_turn_tokens` (3 token paths x 3 corrections x 8 seeds), or
several that split its seeds (`seed=0,2,4,6` and `seed=1,3,5,7` run side by side), or a runs.csv this script wrote
(experiments/multi_turn_tokens/runs.csv: one row per run, what the tables are made of, kept beside the README since
multirun/ is not committed); --csv writes that file; the plot goes beside the first SWEEP (or the CSV).

1. How often and where drift happens (means over each arm's steps, then over seeds): the share of assistant turns
   whose sampled ids differ from their re-rendering, the sampled tokens after the first difference, the first
   differing position, realign's REALIGN / FORK turns; and what the trainer sees: KL k3 and mean |δ| between the
   sampler's log-probs and the trainer's, NeMo-RL's token_mult_prob_error at the turns' edges and inside them, the
   share of sampled tokens the trainer gives a log-prob below -10; conversation turns and tool calls.
2. The outcomes, each token path against `tokens` with the same correction, paired by seed (mean, 95% paired-t
   interval, p: rlmm/table/paired.py's `difference_stats`; Holm's p over the comparisons of the full seed count,
   `holm`: statsmodels): what the path costs. The outcomes: the sampled reward of the last 10 steps (greedy held-out accuracy saturates on this
   task), and held-out accuracy at the last step (summary.json: the trained weights and the deployed sampler).
3. Within each token path, tis and icepop against none, paired by seed, Holm likewise: can a correction
   absorb what the path does, or does only the path remove it?
Writes multi_turn_tokens.png beside the sweep: the paired differences of (2) and (3) with their intervals.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
from statsmodels.stats.multitest import multipletests

from rlmm.run.records import read_steps
from rlmm.table.render import markdown_table
from rlmm.table.discovery import read_overrides
from rlmm.table.paired import difference_stats

ACCURACY = {"eval_accuracy_trained_end": "trained weights", "eval_accuracy_end": "deployed sampler"}
# The sampled reward of the last steps: greedy held-out accuracy saturates on this task (the character model's default
# run: 0.846 -> 0.996 by step 10), while sampled conversations still answer at once without the tool some of the time.
LATE = {"late_reward": "reward, last 10 steps"}
STEPS = {"token_path/frac_turns_drifted": "turns drifted", "token_path/frac_tokens_changed": "tokens changed",
         "token_path/first_drift_position_mean": "first diff at", "token_path/frac_turns_realign": "REALIGN",
         "token_path/frac_turns_fork": "FORK", "mismatch/kl_k3": "KL k3", "mismatch/logprob_abs_diff_mean": "mean |δ|",
         "mismatch/token_mult_prob_error_boundary": "mult err − 1 (edges)",
         "mismatch/token_mult_prob_error_generated": "mult err − 1 (inside)",
         "mismatch/frac_trainer_logprob_below_neg10": "log p < -10", "conversation/turns_mean": "turns",
         "conversation/tool_calls_mean": "tool calls", "rollout/reward_mean": "reward"}
MULT_ERRORS = ("mismatch/token_mult_prob_error_boundary", "mismatch/token_mult_prob_error_generated")
PATHS = ("tokens", "retokenize", "realign")
# TIS at cap 2 weights a token min(r, 2), IcePop on [0.5, 5] r or 0 (conf/correction): the same on [0.5, 2]
TIS_ICEPOP_SAME = (0.5, 2.0)
CORRECTIONS = ("none", "tis", "icepop")


def runs_of(sweeps: list[str]) -> pd.DataFrame:
    saved = [pd.read_csv(s) for s in sweeps if s.endswith(".csv")]
    rows = []
    for run in sorted(p for sweep in sweeps if not sweep.endswith(".csv") for p in Path(sweep).iterdir()
                      if (p / "summary.json").exists()):
        overrides = read_overrides(run)
        summary = json.loads((run / "summary.json").read_text())
        steps = pd.DataFrame([s for s in read_steps(run) if s["step"] > 0])
        rows.append({"token_path": overrides["token_path"], "correction": overrides["correction"],
                     "seed": int(overrides["seed"]), **{key: summary.get(key) for key in ACCURACY},
                     "late_reward": steps["rollout/reward_mean"].tail(10).mean(),
                     # the extremes of every step's per-token ratio pi_trainer / pi_sampler: inside [0.5, 2], TIS
                     # (weight min(r, 2)) and IcePop (r on [0.5, 5], else dropped) weight every token alike
                     "ratio_min": steps["mismatch/ratio_min"].min(), "ratio_max": steps["mismatch/ratio_max"].max(),
                     **{key: steps[key].mean() if key in steps else float("nan") for key in STEPS}})
    runs = pd.concat([*saved, pd.DataFrame(rows)], ignore_index=True)
    return runs.drop_duplicates(["token_path", "correction", "seed"], keep="last")


def holm(table: pd.DataFrame) -> pd.DataFrame:
    """Holm's adjustment over the comparisons of the full seed count: an arm run on fewer seeds (IcePop after seeds
    0 and 1, bit-identical to TIS there) is shown with its own p and left out of the family (its p (Holm) blank):
    with two seeds whose differences are equal, the t-test's p is 0 and would count as a finding."""
    if table.empty:  # a sweep still short of the arms compared
        return table
    tested = table["p"].notna() & (table["n"] == table["n"].max())
    table["p_holm"] = float("nan")
    if tested.any():
        table.loc[tested, "p_holm"] = multipletests(table.loc[tested, "p"], method="holm")[1]
    return table


def paired(a: pd.Series, b: pd.Series) -> dict:
    seeds = sorted(set(a.index) & set(b.index))
    return {"n": len(seeds), "a": a.loc[seeds].mean(), "b": b.loc[seeds].mean(),
            **difference_stats(a.loc[seeds].to_numpy(), b.loc[seeds].to_numpy())}


def arms(runs: pd.DataFrame, key: str) -> dict:
    return {(p, c): part.set_index("seed")[key] for (p, c), part in runs.groupby(["token_path", "correction"])}


def path_vs_tokens(runs: pd.DataFrame, key: str) -> pd.DataFrame:
    arm = arms(runs, key)
    return holm(pd.DataFrame([{"token_path": p, "correction": c, **paired(arm[p, c], arm["tokens", c])}
                              for c in CORRECTIONS for p in PATHS[1:] if (p, c) in arm and ("tokens", c) in arm]))


def correction_vs_none(runs: pd.DataFrame, key: str) -> pd.DataFrame:
    arm = arms(runs, key)
    return holm(pd.DataFrame([{"token_path": p, "correction": c, **paired(arm[p, c], arm[p, "none"])}
                              for p in PATHS for c in CORRECTIONS[1:] if (p, c) in arm and (p, "none") in arm]))


def show(table: pd.DataFrame, label: str, against: str) -> str:
    return markdown_table(["token path", "correction", "n", label, against, "Δ [95% CI]", "p", "p (Holm)"],
                          [(r.token_path, r.correction, r.n, f"{r.a:.4f}", f"{r.b:.4f}",
                            f"{r.mean_diff:+.4f} [{r.ci_low:+.4f}, {r.ci_high:+.4f}]", f"{r.p:.2g}", f"{r.p_holm:.2g}")
                           for r in table.itertuples()])


def means_table(means: pd.DataFrame, columns: dict, digits: str) -> str:
    return markdown_table(["token path", "correction", *columns.values()],
                          [(path, correction, *(format(row[k], digits) for k in columns))
                           for (path, correction), row in means.iterrows()])


def plot(first: pd.DataFrame, second: pd.DataFrame, out: Path) -> None:
    if first.empty or second.empty:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharex=False)
    for ax, table, title in ((axes[0], first, "token path − tokens (same correction)"),
                             (axes[1], second, "correction − none (same token path)")):
        labels = [f"{r.token_path} / {r.correction}" for r in table.itertuples()]
        y = range(len(table))
        ax.errorbar(table["mean_diff"], y, xerr=[table["mean_diff"] - table["ci_low"], table["ci_high"] - table["mean_diff"]],
                    fmt="o", capsize=3)
        ax.axvline(0, color="grey", lw=0.8)
        ax.set_yticks(list(y), labels)
        ax.set_title(title)
        ax.set_xlabel("reward of the last 10 steps (paired difference, 95% CI)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(args: list[str]) -> None:
    csv = args[args.index("--csv") + 1] if "--csv" in args else None
    sweeps = [a for i, a in enumerate(args) if a != "--csv" and (i == 0 or args[i - 1] != "--csv")]
    runs = runs_of(sweeps)
    if csv:
        runs.sort_values(["seed", "token_path", "correction"]).to_csv(csv, index=False)
    print(f"{len(runs)} runs in {', '.join(sweeps)}\n")
    outcomes = {**LATE, **ACCURACY}
    means = runs.groupby(["token_path", "correction"])[list(STEPS) + list(outcomes)].mean()
    for key in MULT_ERRORS:  # exp|δ| is 1 + a few 1e-4: shown as its excess over 1
        means[key] -= 1
    print("## What each arm trained with (means over steps, then seeds)\n")
    print(means_table(means, STEPS, ".3g"), "\n")
    print("## Every token's ratio pi_trainer / pi_sampler, over all runs and steps of each arm (runs)\n")
    extremes = runs.groupby(["token_path", "correction"]).agg(runs=("seed", "size"), ratio_min=("ratio_min", "min"),
                                                              ratio_max=("ratio_max", "max"))
    print(markdown_table(["token path", "correction", "runs", "smallest ratio", "largest ratio"],
                         [(p, c, int(r.runs), f"{r.ratio_min:.4f}", f"{r.ratio_max:.4f}") for (p, c), r in extremes.iterrows()]))
    tis = runs[runs["correction"] == "tis"]
    inside = ((tis["ratio_min"] >= TIS_ICEPOP_SAME[0]) & (tis["ratio_max"] <= TIS_ICEPOP_SAME[1])).sum()
    print(f"\n{inside} of {len(tis)} tis runs keep every ratio inside {list(TIS_ICEPOP_SAME)}, where IcePop weights as "
          f"TIS does: their icepop runs would be the same runs\n")
    print("## The outcomes (means over seeds): the last 10 steps' sampled reward, held-out greedy accuracy at the end\n")
    print(means_table(means, outcomes, ".4f"), "\n")
    for key, label in outcomes.items():
        print(f"## Each token path against tokens, {label}\n")
        print(show(path_vs_tokens(runs, key), "path", "tokens"), "\n")
        print(f"## Each correction against none, {label}\n")
        print(show(correction_vs_none(runs, key), "correction", "none"), "\n")
    plot(path_vs_tokens(runs, "late_reward"), correction_vs_none(runs, "late_reward"), (Path(sweeps[0]).parent if sweeps[0].endswith(".csv") else Path(sweeps[0])) / "multi_turn_tokens.png")


if __name__ == "__main__":
    main(sys.argv[1:])
