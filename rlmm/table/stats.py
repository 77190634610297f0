"""Aggregation over seeds: Student's t quantile, the 95% confidence interval's half-width,
and `aggregate`, one row per (configuration, metric) with mean, CI, std and run counts."""
from __future__ import annotations

import math
import statistics

import pandas as pd
from scipy import stats

from rlmm.table.frames import check_metrics, reduction_label, varying_axes

CONFIDENCE = 0.95


def t_quantile(p: float, dof: int) -> float:
    """Quantile of Student's t with `dof` degrees of freedom: q with P(T <= q) = p (scipy.stats.t.ppf)."""
    if dof < 1 or not 0 < p < 1:
        raise ValueError(f"t_quantile: need dof >= 1 and 0 < p < 1 (got dof={dof}, p={p})")
    return float(stats.t.ppf(p, dof))


def ci_half_width(values: list[float], confidence: float = CONFIDENCE) -> float:
    """t_{(1+c)/2, n−1} · s / √n, s the sample standard deviation (n−1 in the denominator): the
    half-width of the usual Student-t confidence interval for the mean of n independent runs
    (e.g. Montgomery & Runger, Applied Statistics and Probability for Engineers, §8.2). NaN for n < 2."""
    n = len(values)
    if n < 2:
        return math.nan
    s = statistics.stdev(values)  # exact (fractions): n equal values give 0, not 1e-17
    return t_quantile((1 + confidence) / 2, n - 1) * s / math.sqrt(n)


def counted_runs(df: pd.DataFrame, include_incomplete: bool = False) -> pd.Series:
    """Which runs count (a boolean per row): complete ones, and incomplete ones if asked."""
    return df["status"].isin(["complete", "incomplete"] if include_incomplete else ["complete"])


def aggregate(df: pd.DataFrame, metrics: list[str], by: list[str] | None = None,
              include_incomplete: bool = False) -> pd.DataFrame:
    """One row per (configuration, metric): the axes `by` (default `varying_axes(df)`), `metric`,
    `reduction` ('final', 'mean', or 'best (min)' / 'best (max)'), `mean`, `ci95` (half-width, see
    `ci_half_width`), `std`, `n` (counted runs with a finite value), and the configuration's `ok`,
    `incomplete` and `failed` run counts. Counted: complete runs, plus incomplete ones if asked.
    Configurations keep the order of their first run."""
    parsed = check_metrics(df, metrics)
    by = varying_axes(df) if by is None else list(by)
    counted = counted_runs(df, include_incomplete)
    groups = df.groupby(by, sort=False, dropna=False) if by else [((), df)]
    rows = []
    for key, group in groups:
        key = key if isinstance(key, tuple) else (key,)
        status = group["status"].value_counts()
        for name, reduction in parsed:
            column = group.loc[counted[group.index], f"{name}:{reduction}"]
            values = [float(v) for v in column if not math.isnan(float(v))]
            n = len(values)
            mean = statistics.mean(values) if n else math.nan
            std = statistics.stdev(values) if n > 1 else math.nan
            rows.append({**dict(zip(by, key)), "metric": name, "reduction": reduction_label(name, reduction, df),
                         "mean": mean,
                         "ci95": ci_half_width(values), "std": std, "n": n,
                         "ok": int(status.get("complete", 0)), "incomplete": int(status.get("incomplete", 0)),
                         "failed": int(status.get("failed", 0)),
                         # counted runs whose record has a line it could not read: their values stop before it
                         "damaged": int((group.loc[counted[group.index], "damage"] != "").sum())})
    return pd.DataFrame(rows)
