"""Paired comparisons with a baseline arm: `rlmm table --baseline KEY=VALUE`.

A pair is two counted runs that agree on every override but KEY: the same seed, and the same value
of every other axis of the sweep (two tasks, or two precisions, are never paired with each other).
The arms are KEY's other values. For each arm, each configuration of the other varying axes and each
metric, the n pairs give the differences dᵢ = armᵢ − baselineᵢ and

    mean   d̄ = Σ dᵢ / n
    95% CI d̄ ± t_{0.975, n−1} · s_d / √n           (paired t; `interval="t"`), or the 2.5% and 97.5%
           percentiles of d̄ over 10 000 resamples of the pairs (`interval="bootstrap"`, seed 0; it
           undercovers with few pairs: 3 pairs have 10 distinct resample means, so at 3 seeds it
           is far narrower than the t interval, and the t interval is the one to read)
    p      two-sided paired t-test of E[d] = 0, t = d̄ √n / s_d (the same for both intervals)
    p_holm Holm's step-down adjustment of p over every comparison of the same metric in the table
           (all arms × configurations); `significant` = p_holm < 0.05

(scipy.stats.ttest_rel, scipy.stats.bootstrap, statsmodels.stats.multitest.multipletests(method="holm");
Holm, "A simple sequentially rejective multiple test procedure", Scand. J. Statist. 6, 1979). The
interval is per comparison, not adjusted: an arm whose interval excludes 0 can lose significance to
Holm. Pairing on the seed removes what the arms share within a seed (with common random numbers:
the same prompts and, until the first update, the same samples; docs/sweeps.md), so the paired
interval is narrower than the difference of two unpaired ones when the seed effect is large.

Counted runs without a partner are listed by `pair_runs` (and under the table), never silently
dropped; a pair where either run lacks a finite value of a metric is left out of that metric's n.
"""
from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
from scipy import stats
from statsmodels.stats.multitest import multipletests

from rlmm.table.base import TableError
from rlmm.table.frames import check_metrics, reduction_label, varying_axes
from rlmm.table.stats import CONFIDENCE, counted_runs

INTERVALS = ("t", "bootstrap")
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
ALPHA = 0.05  # significance level of the Holm-adjusted p: 1 − CONFIDENCE


def parse_baseline(spec: str, df: pd.DataFrame) -> tuple[str, str]:
    """'KEY=VALUE' -> (KEY, VALUE), KEY one of the sweep's varying axes (seed aside) and VALUE one of its values."""
    axes = varying_axes(df)
    allowed_keys = ", ".join(axes) if axes else "none: no override varies across these runs"
    key, equals, value = spec.partition("=")
    if not equals or not key or not value:
        raise TableError(f"bad --baseline '{spec}' (expected KEY=VALUE, KEY one of: {allowed_keys})")
    if key not in axes:
        raise TableError(f"bad --baseline key '{key}' (allowed: the overrides that vary, seed aside: {allowed_keys})")
    values = list(dict.fromkeys(df[key]))
    if value not in values:
        raise TableError(f"bad --baseline value '{key}={value}' (allowed: {', '.join(values)})")
    return key, value


def pair_runs(df: pd.DataFrame, key: str, baseline: str,
              include_incomplete: bool = False) -> tuple[pd.DataFrame, list[str]]:
    """The pairs, one row per arm run with a baseline partner: the other varying axes, `key` (the arm),
    `baseline_run`, `arm_run` (row labels of `df`); and one line per counted run that is missing from a
    comparison its configuration has: 'RUN (KEY=.. AXIS=.. seed=..: no KEY=VALUE run[, PARTNER failed])'."""
    groups = [k for k in varying_axes(df) if k != key]
    match = [k for k in varying_axes(df, replicate=()) if k != key]   # the groups' axes and the seed
    counted = counted_runs(df, include_incomplete)
    cells: dict[tuple, dict[str, list]] = {}                          # match values -> arm value -> rows
    for label, row in df.iterrows():
        cells.setdefault(tuple(row[match]), {}).setdefault(row[key], []).append(label)
    arms_of_group: dict[tuple, list[str]] = {}
    for label, row in df.iterrows():
        arms = arms_of_group.setdefault(tuple(row[groups]), [])
        if row[key] != baseline and row[key] not in arms:
            arms.append(row[key])

    def describe(label) -> str:
        return " ".join(f"{k}={df.at[label, k]}" for k in (key, *match))

    def one_counted(labels: list) -> object | None:
        live = [label for label in labels if counted[label]]
        if len(live) > 1:
            raise TableError(f"runs {', '.join(str(df.at[x, 'run']) for x in live)} are all {describe(live[0])}: "
                             f"pairing needs one run per {', '.join(match) or 'configuration'}")
        return live[0] if live else None

    def why(partners: list, wanted: str) -> str:
        others = "; ".join(f"{df.at[x, 'run']} is {df.at[x, 'status']}" for x in partners)
        return f"no {key}={wanted} run" + (f" ({others})" if others else "")

    pairs, unpaired = [], []
    for values, by_arm in cells.items():
        group = tuple(df.at[next(iter(by_arm.values()))[0], k] for k in groups)
        base = one_counted(by_arm.get(baseline, []))
        missing = []
        for arm in arms_of_group[group]:
            run = one_counted(by_arm.get(arm, []))
            if run is not None and base is not None:
                pairs.append({**dict(zip(groups, group)), key: arm, "baseline_run": base, "arm_run": run})
            elif run is not None:
                unpaired.append(f"{df.at[run, 'run']} ({describe(run)}: {why(by_arm.get(baseline, []), baseline)})")
            elif base is not None:
                missing.append(why(by_arm.get(arm, []), arm))
        if missing:
            unpaired.append(f"{df.at[base, 'run']} ({describe(base)}: {'; '.join(missing)})")
    columns = [*groups, key, "baseline_run", "arm_run"]
    frame = pd.DataFrame(pairs, columns=columns)
    frame.attrs["match"] = match
    if len(frame):  # arms in the sweep's order within each configuration, configurations in theirs
        order = {g: i for i, g in enumerate(arms_of_group)}
        frame["_group"] = [order[tuple(r)] for r in frame[groups].itertuples(index=False, name=None)]
        frame["_arm"] = [arms_of_group[tuple(r[:-1])].index(r[-1])
                         for r in frame[[*groups, key]].itertuples(index=False, name=None)]
        frame = frame.sort_values(["_group", "_arm"], kind="stable").drop(columns=["_group", "_arm"])
    frame = frame.reset_index(drop=True)
    frame.attrs["match"] = match
    return frame, unpaired


def difference_stats(arm: np.ndarray, base: np.ndarray, interval: str = "t") -> dict:
    """n, mean_diff, ci_low, ci_high and p of the paired differences arm − base (see the module
    docstring); NaN where n < 2, and p NaN when every difference is 0."""
    if interval not in INTERVALS:
        raise TableError(f"bad interval '{interval}' (allowed: {', '.join(INTERVALS)})")
    diff = np.asarray(arm, dtype=float) - np.asarray(base, dtype=float)
    n = len(diff)
    result = {"n": n, "mean_diff": float(diff.mean()) if n else math.nan, "ci_low": math.nan, "ci_high": math.nan,
              "p": math.nan}
    if n < 2:
        return result
    with warnings.catch_warnings():  # scipy warns of lost precision when the differences are (nearly) equal
        warnings.simplefilter("ignore", RuntimeWarning)
        test = stats.ttest_rel(arm, base)
        if interval == "t":
            low, high = test.confidence_interval(CONFIDENCE)
        else:
            low, high = stats.bootstrap((diff,), np.mean, confidence_level=CONFIDENCE, method="percentile",
                                        n_resamples=BOOTSTRAP_RESAMPLES,
                                        rng=np.random.default_rng(BOOTSTRAP_SEED)).confidence_interval
    return result | {"ci_low": float(low), "ci_high": float(high), "p": float(test.pvalue)}


def paired_differences(df: pd.DataFrame, metrics: list[str], key: str, baseline: str, interval: str = "t",
                       include_incomplete: bool = False) -> tuple[pd.DataFrame, list[str]]:
    """One row per (metric, configuration of the other varying axes, arm): `metric`, `reduction`, the
    other axes, `key` (the arm), `baseline`, `interval`, `n`, `mean_diff`, `ci_low`, `ci_high`, `p`,
    `p_holm`, `significant`; and the unpaired runs of `pair_runs`."""
    parsed = check_metrics(df, metrics)
    pairs, unpaired = pair_runs(df, key, baseline, include_incomplete)
    by = [c for c in pairs.columns if c not in ("baseline_run", "arm_run")]  # the other varying axes, key
    rows = []
    for name, reduction in parsed:
        column = df[f"{name}:{reduction}"].astype(float)
        for values, group in (pairs.groupby(by, sort=False) if len(pairs) else []):
            base = column.loc[group["baseline_run"]].to_numpy()
            arm = column.loc[group["arm_run"]].to_numpy()
            finite = np.isfinite(base) & np.isfinite(arm)
            rows.append({"metric": name, "reduction": reduction_label(name, reduction, df), **dict(zip(by, values)),
                         "baseline": baseline, "interval": interval,
                         **difference_stats(arm[finite], base[finite], interval)})
    columns = ["metric", "reduction", *by, "baseline", "interval", "n", "mean_diff", "ci_low", "ci_high", "p"]
    frame = pd.DataFrame(rows, columns=columns)
    frame["p_holm"] = math.nan
    for _, family in frame.groupby(["metric", "reduction"], sort=False):
        tested = family["p"].notna()
        if tested.any():
            frame.loc[family.index[tested], "p_holm"] = multipletests(family.loc[tested, "p"], alpha=ALPHA,
                                                                      method="holm")[1]
    frame["significant"] = frame["p_holm"] < ALPHA
    frame.attrs |= {"axes": by, "match": pairs.attrs["match"]}  # configuration columns; what a pair agrees on
    return frame, unpaired
