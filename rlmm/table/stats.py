"""Aggregation over seeds: Student's t quantile (no scipy), the 95% confidence interval's half-width,
and `aggregate`, one row per (configuration, metric) with mean, CI, std and run counts."""
from __future__ import annotations

import math
import statistics

import pandas as pd

from rlmm.table.frames import check_metrics, direction, varying_axes

CONFIDENCE = 0.95


def t_quantile(p: float, dof: int) -> float:
    """Quantile of Student's t with `dof` (integer) degrees of freedom: q with P(T <= q) = p.

    Bisection on the exact closed-form CDF for integer dof (Abramowitz & Stegun, Handbook of
    Mathematical Functions, 26.7.3-26.7.4), with θ = atan(t/√ν) and A(t|ν) = P(|T| <= t):
      ν odd:  A = (2/π) [θ + sinθ (cosθ + (2/3)cos³θ + ... + (2·4···(ν−3))/(3·5···(ν−2)) cos^(ν−2)θ)]
      ν even: A = sinθ [1 + (1/2)cos²θ + (1·3)/(2·4)cos⁴θ + ... + (1·3···(ν−3))/(2·4···(ν−2)) cos^(ν−2)θ]
    (scipy.stats.t.ppf gives the same; scipy is not a dependency.)
    """
    if dof < 1 or not 0 < p < 1:
        raise ValueError(f"t_quantile: need dof >= 1 and 0 < p < 1 (got dof={dof}, p={p})")
    if p < 0.5:
        return -t_quantile(1 - p, dof)
    target = 2 * p - 1
    lo, hi = 0.0, 1.0
    while _t_two_sided(hi, dof) < target:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_two_sided(mid, dof) < target else (lo, mid)
    return (lo + hi) / 2


def _t_two_sided(t: float, dof: int) -> float:
    theta = math.atan(t / math.sqrt(dof))
    s, c = math.sin(theta), math.cos(theta)
    if dof % 2:
        term = total = c if dof > 1 else 0.0
        for j in range(1, (dof - 1) // 2):
            term *= (2 * j) / (2 * j + 1) * c * c
            total += term
        return 2 / math.pi * (theta + s * total)
    term = total = 1.0
    for j in range(1, dof // 2):
        term *= (2 * j - 1) / (2 * j) * c * c
        total += term
    return s * total


def ci_half_width(values: list[float], confidence: float = CONFIDENCE) -> float:
    """t_{(1+c)/2, n−1} · s / √n, s the sample standard deviation (n−1 in the denominator): the
    half-width of the usual Student-t confidence interval for the mean of n independent runs
    (e.g. Montgomery & Runger, Applied Statistics and Probability for Engineers, §8.2). NaN for n < 2."""
    n = len(values)
    if n < 2:
        return math.nan
    s = statistics.stdev(values)  # exact (fractions): n equal values give 0, not 1e-17
    return t_quantile((1 + confidence) / 2, n - 1) * s / math.sqrt(n)


def aggregate(df: pd.DataFrame, metrics: list[str], by: list[str] | None = None,
              include_incomplete: bool = False) -> pd.DataFrame:
    """One row per (configuration, metric): the axes `by` (default `varying_axes(df)`), `metric`,
    `reduction` ('final', 'mean', or 'best (min)' / 'best (max)'), `mean`, `ci95` (half-width, see
    `ci_half_width`), `std`, `n` (counted runs with a finite value), and the configuration's `ok`,
    `incomplete` and `failed` run counts. Counted: complete runs, plus incomplete ones if asked.
    Configurations keep the order of their first run."""
    parsed = check_metrics(df, metrics)
    by = varying_axes(df) if by is None else list(by)
    counted = df["status"].isin(["complete", "incomplete"] if include_incomplete else ["complete"])
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
            label = f"best ({direction(name, df.attrs.get('directions'))})" if reduction == "best" else reduction
            rows.append({**dict(zip(by, key)), "metric": name, "reduction": label, "mean": mean,
                         "ci95": ci_half_width(values), "std": std, "n": n,
                         "ok": int(status.get("complete", 0)), "incomplete": int(status.get("incomplete", 0)),
                         "failed": int(status.get("failed", 0))})
    return pd.DataFrame(rows)
