"""Runs as pandas frames: one row per run (`load_runs`, with each metric's final, best and mean),
the long per-step form (`steps_frame`), which axes vary, and the `NAME[:reduction]` metric specs
checked against what the runs recorded."""
from __future__ import annotations

import fnmatch
import math

import pandas as pd

from rlmm.table.base import Run, TableError, is_number, number
from rlmm.table.discovery import read_runs

REDUCTIONS = ("final", "best", "mean")
REPLICATE_AXES = ("seed",)
DEFAULT_METRICS = {
    "train": ["eval/accuracy:final", "rollout/reward_mean:final", "mismatch/kl_k3:mean"],
    "probe": ["mismatch/kl_k3", "mismatch/logprob_abs_diff_mean", "mismatch/prob_pearson"],
}
# Direction of "best", by glob on the metric name; the first match wins, and anything unmatched is
# higher-is-better. Mismatch-type metrics are lower-is-better except correlation and ESS.
BEST_DIRECTION = ("*/prob_pearson:max", "*/ess_*:max", "*/frac_identical_*:max", "perf/tokens_per_second:max",
                  "mismatch/*:min", "trainer_vs_itself/*:min", "sampler_vs_itself/*:min", "position/*:min", "loss/*:min",
                  "perf/*:min", "summary/mismatch_*:min", "summary/*seconds*:min")


def direction(metric: str, directions: dict[str, str] | None = None) -> str:
    """'min' or 'max': which way a metric's "best" goes. `directions` maps glob patterns of metric
    names to 'min'/'max' and takes precedence over the built-in BEST_DIRECTION rules."""
    rules = [*(directions or {}).items(), *(rule.rsplit(":", 1) for rule in BEST_DIRECTION)]
    return next((way for pattern, way in rules if fnmatch.fnmatchcase(metric, pattern)), "max")


def load_runs(sources, directions: dict[str, str] | None = None) -> pd.DataFrame:
    """One row per run: `run`, `status`, `steps`, `kind`, `note`, `path`, one column per override key
    (missing ones '(default)'), and `METRIC:final`, `METRIC:best`, `METRIC:mean` for every numeric
    metric. `sources`: anything `read_runs` takes, or a list of `Run`.

    final: the value at the last step that logged the metric (NaN if it was NaN there);
    best: max, or min where `direction()` says lower is better, over the logged steps, NaNs skipped;
    mean: mean over the steps that logged it (NaN if any was NaN). One-off numbers (probe metrics,
    `summary/*` of summary.json) have the three equal.
    """
    runs = sources if isinstance(sources, list) and all(isinstance(r, Run) for r in sources) else read_runs(sources)
    keys = list(dict.fromkeys(k for r in runs for k in r.overrides))
    rows = []
    for run in runs:
        row = {"run": run.name, "status": run.status, "steps": run.steps, "kind": run.kind, "note": run.note,
               "damage": run.damage, "path": run.path, **{k: run.overrides.get(k, "(default)") for k in keys}}
        series: dict[str, list[float]] = {}
        for step in sorted(run.history, key=lambda r: r.get("step", 0)):
            for key, value in step.items():
                if key != "step" and is_number(value):
                    series.setdefault(key, []).append(number(value))
        for key, value in run.values.items():
            series.setdefault(key, [value])
        for key, values in series.items():
            finite = [v for v in values if not math.isnan(v)]
            best = (min if direction(key, directions) == "min" else max)(finite) if finite else math.nan
            row |= {f"{key}:final": values[-1], f"{key}:best": best, f"{key}:mean": sum(values) / len(values)}
        rows.append(row)
    frame = pd.DataFrame(rows)
    frame.attrs["directions"] = dict(directions or {})
    frame.attrs["axes"] = keys
    return frame


def steps_frame(runs: list[Run]) -> pd.DataFrame:
    """Long form of the runs' histories: one row per (run, step), a column per metric."""
    rows = [{"run": run.name, **{k: number(v) if is_number(v) else v for k, v in step.items()}}
            for run in runs for step in run.history]
    return pd.DataFrame(rows, columns=None if rows else ["run", "step"])


def metric_names(df: pd.DataFrame) -> list[str]:
    return list(dict.fromkeys(c.rsplit(":", 1)[0] for c in df.columns if c.endswith(":final")))


def varying_axes(df: pd.DataFrame, replicate=REPLICATE_AXES) -> list[str]:
    """Override keys whose value differs between runs, in the sweep's order; the replicate axes
    (`seed`) are not grouping axes: the table aggregates over them."""
    keys = df.attrs.get("axes") or [c for c in df.columns if ":" not in c and c not in _RUN_COLUMNS]
    return [k for k in keys if k in df and k not in replicate and df[k].nunique(dropna=False) > 1]


_RUN_COLUMNS = ("run", "status", "steps", "kind", "note", "damage", "path")


def parse_metric(spec: str) -> tuple[str, str]:
    """'NAME[:final|best|mean]' -> (name, reduction); final when no reduction is given."""
    name, colon, reduction = spec.rpartition(":")
    if not colon:
        return spec, "final"
    if reduction not in REDUCTIONS or not name:
        raise TableError(f"bad metric '{spec}' (expected NAME[:{'|'.join(REDUCTIONS)}])")
    return name, reduction


def check_metrics(df: pd.DataFrame, metrics: list[str]) -> list[tuple[str, str]]:
    available = metric_names(df)
    parsed = [parse_metric(m) for m in metrics]
    for name, _ in parsed:
        if name not in available:
            listed = ", ".join(available) if available else "none: no run recorded a metric"
            raise TableError(f"unknown metric '{name}' (available: {listed})")
    return parsed


def reduction_label(name: str, reduction: str, df: pd.DataFrame) -> str:
    """How tables name a reduction: 'final', 'mean', or 'best (min)' / 'best (max)'."""
    return f"best ({direction(name, df.attrs.get('directions'))})" if reduction == "best" else reduction


def default_metrics(df: pd.DataFrame) -> list[str]:
    kinds = df.loc[df["kind"] != "", "kind"]
    kind = kinds.mode().iloc[0] if len(kinds) else "train"
    available = metric_names(df)
    return [m for m in DEFAULT_METRICS[kind] if parse_metric(m)[0] in available] or available[:3]
