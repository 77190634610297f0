"""`rlmm table SWEEP`: ablation tables and plots from a sweep's per-run records.

Reads every run of a sweep (a Hydra multirun directory of `rlmm train -m` or `rlmm probe -m`, or W&B
runs), groups the runs by the overrides that vary across them, aggregates each chosen metric over the
seeds (mean and a Student-t 95% confidence interval), and writes `table.md`, `table.csv`, `table.tex`,
`curves.png` and `bars.png`.

    runs = load_runs(["multirun/2026-11-29/10-00-00"])          # one row per run
    varying_axes(runs)                                            # ['precision', 'correction']
    aggregate(runs, ["eval/accuracy:final", "mismatch/kl_k3:mean"])

Run status (the same rule for every source):
  - complete:   the run's final record exists (`summary.json` for train, `probe.json` for probe;
                W&B: state `finished`);
  - failed:     not complete, and no training step was recorded (no `steps.jsonl`, an empty one, a
                torn line only, or only the step-0 evaluation), or an error marker (W&B: state
                `failed` or `crashed`; a local record has none, so a local run that crashed after
                some steps reads as incomplete);
  - incomplete: not complete, some steps recorded (killed, crashed, timed out, or still running).
Only complete runs are counted in the table unless `include_incomplete` is set (an incomplete run
then counts with the values of its last recorded step).
"""
from __future__ import annotations

import argparse
import fnmatch
import glob as globlib
import json
import math
import os
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from rlmm.records import read_steps

REDUCTIONS = ("final", "best", "mean")
REPLICATE_AXES = ("seed",)
CONFIDENCE = 0.95
DEFAULT_METRICS = {
    "train": ["eval/accuracy:final", "rollout/reward_mean:final", "mismatch/kl_k3:mean"],
    "probe": ["mismatch/kl_k3", "mismatch/logprob_abs_diff_mean", "mismatch/prob_pearson"],
}
# Direction of "best", by glob on the metric name; the first match wins, and anything unmatched is
# higher-is-better. Mismatch-type metrics are lower-is-better except correlation and ESS.
BEST_DIRECTION = ("*/prob_pearson:max", "*/ess_*:max", "*/frac_identical_*:max", "perf/tokens_per_second:max",
                  "mismatch/*:min", "trainer_vs_itself/*:min", "sampler_vs_itself/*:min", "loss/*:min",
                  "perf/*:min", "summary/mismatch_*:min", "summary/*seconds*:min")
RUN_DIR_MARKERS = (".hydra/overrides.yaml", "config.yaml", "steps.jsonl", "summary.json", "probe.json")
# probe.json sections -> metric prefixes (the sampler-vs-trainer numbers under the names train logs).
PROBE_SECTIONS = {"sampler_vs_trainer": "mismatch", "trainer_vs_itself": "trainer_vs_itself",
                  "sampler_vs_itself": "sampler_vs_itself"}
PROBE_ROLLOUTS = {"mean_reward": "reward_mean", "mean_response_length": "response_length_mean",
                  "frac_truncated": "frac_truncated", "num": "num"}


class TableError(ValueError):
    """Bad input (path, metric, source), with a one-line message for the user."""


@dataclass
class Run:
    name: str
    path: str
    overrides: dict[str, str]
    status: str = "failed"
    kind: str = ""                                       # train | probe | "" (nothing recorded)
    steps: int = 0                                       # training steps recorded (probe: 1 once done)
    history: list[dict] = field(default_factory=list)    # one dict per step, with "step"
    values: dict[str, float] = field(default_factory=dict)  # one-off numbers: summary/*, probe metrics
    note: str = ""                                       # why not complete


# ---------------------------------------------------------------------------------------------
# Reading runs


def find_run_dirs(source: str | Path) -> list[Path]:
    """Run directories under a path: the path itself if it is a run, else its job subdirectories,
    or one level deeper (a directory of sweeps). Hidden directories (`.submitit/`) are skipped."""
    path = Path(source)
    if _is_run_dir(path):
        return [path]
    found = []
    for child in _children(path):
        if _is_run_dir(child):
            found.append(child)
        else:
            found += [grandchild for grandchild in _children(child) if _is_run_dir(grandchild)]
    return found


def _children(path: Path) -> list[Path]:
    dirs = [p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return sorted(dirs, key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)])


def _is_run_dir(path: Path) -> bool:
    return any((path / marker).exists() for marker in RUN_DIR_MARKERS)


def read_overrides(run_dir: Path) -> dict[str, str]:
    """`key=value` overrides of a Hydra job (`hydra.*` left out; `+key` counts as `key`)."""
    import yaml

    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.exists():
        return {}
    overrides = {}
    for item in yaml.safe_load(path.read_text()) or []:
        key, _, value = str(item).partition("=")
        deleted = key.startswith("~")
        key = key.lstrip("+~")
        if not key.startswith("hydra.") and key != "hydra":
            overrides[key] = "<deleted>" if deleted else value
    return overrides


def read_local_run(run_dir: Path, name: str) -> Run:
    run = Run(name=name, path=str(run_dir), overrides=read_overrides(run_dir))
    probe = run_dir / "probe.json"
    if probe.exists():
        try:
            record = json.loads(probe.read_text())
        except json.JSONDecodeError:
            return _set_status(run, complete=False, note="probe.json unreadable")
        run.kind, run.steps = "probe", 1
        run.values = probe_values(record)
        return _set_status(run, complete=True)
    run.history = read_steps(run_dir)
    run.kind = "train" if run.history else ""
    run.steps = max((int(row.get("step", 0)) for row in run.history), default=0)
    summary = run_dir / "summary.json"
    complete = False
    if summary.exists():
        try:
            record = json.loads(summary.read_text())
            complete = True
            run.values = {f"summary/{k}": _number(v) for k, v in record.items() if _is_number(v)}
        except json.JSONDecodeError:
            pass
    return _set_status(run, complete=complete)


def _set_status(run: Run, complete: bool, error: str = "", note: str = "") -> Run:
    """The status rule of the module docstring."""
    if complete and not error:
        run.status = "complete"
    elif error or run.steps == 0:
        run.status = "failed"
        run.note = note or error or ("nothing recorded" if not run.history else "no training step recorded")
    else:
        run.status = "incomplete"
        run.note = note or f"stopped after step {run.steps}"
    return run


def probe_values(record: dict) -> dict[str, float]:
    """probe.json's scalar numbers as metrics: `mismatch/*` (sampler vs trainer), `trainer_vs_itself/*`,
    `sampler_vs_itself/*`, `rollout/*`, `perf/seconds`."""
    values = {}
    for section, prefix in PROBE_SECTIONS.items():
        for key, value in record.get(section, {}).items():
            if _is_number(value):
                values[f"{prefix}/{key}"] = _number(value)
    for key, value in record.get("rollouts", {}).items():
        if key in PROBE_ROLLOUTS and _is_number(value):
            values[f"rollout/{PROBE_ROLLOUTS[key]}"] = _number(value)
    if "seconds" in record and _is_number(record["seconds"]):
        values["perf/seconds"] = _number(record["seconds"])
    return values


def _is_number(value) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _number(value) -> float:
    return math.nan if value is None else float(value)


def read_runs(sources: str | Path | list) -> list[Run]:
    """Every run under the sources: sweep directories, run directories, glob patterns, or
    `wandb:ENTITY/PROJECT[/GROUP]`."""
    sources = [sources] if isinstance(sources, (str, Path)) else list(sources)
    runs, dirs = [], []
    for source in sources:
        text = str(source)
        if text.startswith("wandb:"):
            runs += read_wandb(text)
            continue
        matches = [Path(text)] if Path(text).exists() else [Path(p) for p in sorted(globlib.glob(text))]
        if not matches:
            raise TableError(f"no such file or directory: {text}")
        found = [d for m in matches if m.is_dir() for d in find_run_dirs(m)]
        if not found:
            raise TableError(f"no runs in {text} (expected Hydra job directories holding .hydra/overrides.yaml, "
                             "steps.jsonl, summary.json or probe.json)")
        dirs += found
    dirs = list(dict.fromkeys(d.resolve() for d in dirs))
    root = Path(os.path.commonpath(dirs)) if len(dirs) > 1 else None
    runs += [read_local_run(d, d.relative_to(root).as_posix() if root else d.name) for d in dirs]
    return runs


# ---------------------------------------------------------------------------------------------
# W&B


def parse_wandb_source(source: str) -> tuple[str, str, str | None]:
    """`wandb:ENTITY/PROJECT[/GROUP]` -> (entity, project, group or None)."""
    parts = source.removeprefix("wandb:").split("/", 2)
    if len(parts) < 2 or not all(parts):
        raise TableError(f"bad W&B source '{source}' (expected wandb:ENTITY/PROJECT[/GROUP])")
    return parts[0], parts[1], parts[2] if len(parts) == 3 else None


def read_wandb(source: str) -> list[Run]:
    """Runs of a W&B project (one group of it if given), through `wandb.Api()`: the history gives the
    steps, the summary the one-off numbers (probe metrics, `summary/*`), and the config the axes (the
    group choices, and the dotted leaves of the other nodes such as `seed`, `train.steps`)."""
    entity, project, group = parse_wandb_source(source)
    os.environ.setdefault("WANDB_SILENT", "true")
    import requests
    import wandb

    try:
        api = wandb.Api()  # HTTP timeout: WANDB_HTTP_TIMEOUT (W&B default 19 s)
        found = list(api.runs(f"{entity}/{project}", filters={"group": group} if group else None))
        runs = [_wandb_run(r, f"wandb:{entity}/{project}") for r in found]
    except (wandb.errors.Error, requests.RequestException, OSError, ValueError) as err:
        _stop_wandb_service()
        message = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise TableError(f"W&B {source}: {message}") from None
    if not runs:
        raise TableError(f"no runs in {source}")
    return runs


def _stop_wandb_service() -> None:
    """Kill wandb-core after a failed request: it may still be retrying that request, and W&B's exit
    hook waits for it with no time limit (wandb 0.31: ServiceConnection.teardown -> proc.join()), which
    turned a one-line error into a hang of minutes on a loaded machine."""
    from wandb.sdk import wandb_setup

    connection = getattr(wandb_setup._singleton, "_connection", None)
    process = getattr(getattr(connection, "_proc", None), "_process", None)
    if process is None:
        return
    unregister_exit_hook = getattr(connection, "_cleanup", None)
    if unregister_exit_hook:
        unregister_exit_hook()
    _silence_thread("wandb-ServiceFinalizer")  # it may still publish to the killed service, and fail
    process.kill()
    process.wait()


def _silence_thread(name: str) -> None:
    """Drop uncaught exceptions of one thread: W&B's finalizer thread publishing to a service we killed
    printed a traceback under the one-line error (seen once in CI)."""
    import threading

    previous = threading.excepthook

    def hook(args):
        if args.thread is None or args.thread.name != name:
            previous(args)

    threading.excepthook = hook


def _wandb_run(wandb_run, prefix: str) -> Run:
    config = dict(wandb_run.config)
    choices = dict(config.get("choices") or {})
    overrides = {k: str(v) for k, v in choices.items()}
    for key, value in config.items():
        if key not in choices and key != "choices" and not key.startswith("_"):  # _wandb: W&B's own
            overrides.update(_flatten(key, value))
    run = Run(name=wandb_run.id, path=f"{prefix}/{wandb_run.id}", overrides=overrides)
    for row in wandb_run.scan_history():
        step = {k: v for k, v in row.items() if not k.startswith("_") and _is_number(v)}
        if step:
            run.history.append({"step": int(row.get("_step", len(run.history))), **step})
    logged = {k for row in run.history for k in row}
    summary = {k: v for k, v in wandb_run.summary_metrics.items() if not k.startswith("_") and _is_number(v)}
    if run.history:
        run.kind = "train"
        run.steps = max(row["step"] for row in run.history)
        run.values = {f"summary/{k}": _number(v) for k, v in summary.items() if k not in logged}
    elif summary:
        run.kind, run.steps = "probe", 1
        run.values = {k: _number(v) for k, v in summary.items()}
    state = wandb_run.state
    error = f"W&B state {state}" if state in ("failed", "crashed") else ""
    return _set_status(run, complete=state == "finished", error=error)


def _flatten(key: str, value) -> dict[str, str]:
    if isinstance(value, dict):
        return {k: v for sub, item in value.items() for k, v in _flatten(f"{key}.{sub}", item).items()}
    return {key: str(value)}


# ---------------------------------------------------------------------------------------------
# One row per run


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
               "path": run.path, **{k: run.overrides.get(k, "(default)") for k in keys}}
        series: dict[str, list[float]] = {}
        for step in sorted(run.history, key=lambda r: r.get("step", 0)):
            for key, value in step.items():
                if key != "step" and _is_number(value):
                    series.setdefault(key, []).append(_number(value))
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
    rows = [{"run": run.name, **{k: _number(v) if _is_number(v) else v for k, v in step.items()}}
            for run in runs for step in run.history]
    return pd.DataFrame(rows, columns=None if rows else ["run", "step"])


def metric_names(df: pd.DataFrame) -> list[str]:
    return list(dict.fromkeys(c.rsplit(":", 1)[0] for c in df.columns if c.endswith(":final")))


def varying_axes(df: pd.DataFrame, replicate=REPLICATE_AXES) -> list[str]:
    """Override keys whose value differs between runs, in the sweep's order; the replicate axes
    (`seed`) are not grouping axes: the table aggregates over them."""
    keys = df.attrs.get("axes") or [c for c in df.columns if ":" not in c and c not in _RUN_COLUMNS]
    return [k for k in keys if k in df and k not in replicate and df[k].nunique(dropna=False) > 1]


_RUN_COLUMNS = ("run", "status", "steps", "kind", "note", "path")


# ---------------------------------------------------------------------------------------------
# Aggregation over seeds


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


def default_metrics(df: pd.DataFrame) -> list[str]:
    kinds = df.loc[df["kind"] != "", "kind"]
    kind = kinds.mode().iloc[0] if len(kinds) else "train"
    available = metric_names(df)
    return [m for m in DEFAULT_METRICS[kind] if parse_metric(m)[0] in available] or available[:3]


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


# ---------------------------------------------------------------------------------------------
# Output


def fmt(value: float) -> str:
    """4 significant digits; near ±1 (correlations, ratios) enough decimals to show 3 digits of the gap."""
    if value is None or math.isnan(value) or math.isinf(value):
        return str(value)
    if 0.99 < abs(value) < 1:
        return f"{value:.{math.ceil(-math.log10(1 - abs(value))) + 2}f}"
    return f"{value:.3e}" if value != 0 and (abs(value) < 1e-2 or abs(value) >= 1e4) else f"{value:.4f}"


def cell(row) -> str:
    """'mean ± ci (n=k)', or 'mean (n=1)', or '—' when no run counts."""
    if row["n"] == 0:
        return "—"
    ci = row["ci95"]
    spread = "" if math.isnan(ci) else f" ± {fmt(ci)}"
    return f"{fmt(row['mean'])}{spread} (n={row['n']})"


def runs_cell(row) -> str:
    parts = [f"{row['ok']} ok"] + [f"{row[k]} {k}" for k in ("incomplete", "failed") if row[k]]
    return ", ".join(parts)


def wide_table(agg: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Rows = configurations, columns = axes, `runs`, then one "mean ± ci (n=k)" column per metric."""
    table: dict[tuple, dict] = {}
    for record in agg.to_dict("records"):
        row = table.setdefault(tuple(record[k] for k in by), {**{k: record[k] for k in by}, "runs": runs_cell(record)})
        row[f"{record['metric']} ({record['reduction']})"] = cell(record)
    return pd.DataFrame(list(table.values()))


def markdown(wide: pd.DataFrame, df: pd.DataFrame, by: list[str], include_incomplete: bool) -> str:
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    lines = [line(wide.columns), line(["---"] * len(wide.columns)),
             *(line(r) for r in wide.itertuples(index=False, name=None))]
    fixed = [f"{k}={df[k].iloc[0]}" for k in (df.attrs.get("axes") or []) if k not in by and k in df
             and df[k].nunique() == 1 and k not in REPLICATE_AXES]
    counted = "complete and incomplete (at their last step)" if include_incomplete else "complete"
    lines += ["", f"Cells: mean ± {CONFIDENCE:.0%} CI half-width (Student t over seeds) (n = {counted} runs with "
              "a value)."]
    if fixed:
        lines.append("Same in every run: " + ", ".join(fixed) + ".")
    others = df[df["status"] != "complete"]
    if len(others):
        lines.append("Not complete: " + "; ".join(f"{run} ({status}: {note})" for run, status, note in
                                              others[["run", "status", "note"]].to_numpy().tolist()) + ".")
    return "\n".join(lines) + "\n"


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
        "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "±": r"$\pm$", "—": "--"}


def latex(wide: pd.DataFrame) -> str:
    """A booktabs tabular, by hand (pandas' to_latex needs jinja2, which rlmm does not depend on)."""
    def row(cells) -> str:
        return " & ".join("".join(_TEX.get(ch, ch) for ch in str(c)) for c in cells) + r" \\"

    return "\n".join([r"\begin{tabular}{" + "l" * wide.shape[1] + "}", r"\toprule", row(wide.columns), r"\midrule",
                      *(row(r) for r in wide.itertuples(index=False, name=None)),
                      r"\bottomrule", r"\end{tabular}"]) + "\n"


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


def write_outputs(runs: list[Run], df: pd.DataFrame, metrics: list[str], out: Path,
                  include_incomplete: bool = False) -> tuple[str, list[Path]]:
    """Write table.md, table.csv, table.tex, bars.png and (runs with steps) curves.png into `out`;
    return the Markdown text and the files written."""
    by = varying_axes(df)
    agg = aggregate(df, metrics, by=by, include_incomplete=include_incomplete)
    wide = wide_table(agg, by)
    text = markdown(wide, df, by, include_incomplete)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "table.md", out / "table.csv", out / "table.tex"]
    written[0].write_text(text)
    agg.to_csv(written[1], index=False)
    written[2].write_text(latex(wide))
    if plot_curves(df, steps_frame(runs), metrics, out / "curves.png", by, include_incomplete):
        written.append(out / "curves.png")
    plot_bars(agg, out / "bars.png", by)
    written.append(out / "bars.png")
    return text, written


def default_out(sources: list[str]) -> Path:
    local = [Path(s) for s in sources if not s.startswith("wandb:") and Path(s).exists()]
    if len(local) == len(sources) and local:
        return Path(os.path.commonpath([p.resolve() for p in local])) / "table"
    name = "_".join(re.sub(r"[^\w.-]+", "_", s) for s in sources)[:100]
    return Path("tables") / name


def main(argv: list[str] | None = None) -> None:
    from rlmm.cli import fail

    parser = argparse.ArgumentParser(
        prog="rlmm table", description="Ablation tables from a sweep's run records: rows = configurations "
        "(the overrides that vary), cells = mean ± 95% CI over seeds.")
    parser.error = fail  # one line, `rlmm: error: ...`, exit 2
    parser.add_argument("sources", nargs="+", metavar="SOURCE",
                        help="sweep dir, run dir, glob, or wandb:ENTITY/PROJECT[/GROUP]")
    parser.add_argument("--metric", action="append", metavar="NAME[:final|best|mean]",
                        help="repeatable; default: "
                        + "; ".join(f"{k}: {', '.join(v)}" for k, v in DEFAULT_METRICS.items()))
    parser.add_argument("--out", type=Path, help="output dir (default: SWEEP/table)")
    parser.add_argument("--lower-is-better", action="append", default=[], metavar="GLOB",
                        help="metrics whose best is the min (repeatable; built-in: mismatch/*, loss/*, ...)")
    parser.add_argument("--higher-is-better", action="append", default=[], metavar="GLOB",
                        help="metrics whose best is the max (repeatable)")
    parser.add_argument("--include-incomplete", action="store_true",
                        help="count killed/unfinished runs at their last step")
    args = parser.parse_args(argv)
    directions = {**{p: "min" for p in args.lower_is_better}, **{p: "max" for p in args.higher_is_better}}
    try:
        runs = read_runs(args.sources)
        df = load_runs(runs, directions)
        metrics = args.metric or default_metrics(df)
        if not metrics:
            counts = df["status"].value_counts()
            raise TableError(f"no run recorded a metric ({', '.join(f'{n} {s}' for s, n in counts.items())})")
        check_metrics(df, metrics)
        out = args.out or default_out(args.sources)
        text, written = write_outputs(runs, df, metrics, out, args.include_incomplete)
    except TableError as err:
        fail(str(err))
    print(text)
    print(f"wrote {', '.join(p.name for p in written)} to {out}")
