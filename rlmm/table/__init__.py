"""`rlmm table SWEEP`: ablation tables and plots from a sweep's per-run records.

Reads every run of a sweep (a Hydra multirun directory of `rlmm train -m` or `rlmm probe -m`, or W&B
runs), groups the runs by the overrides that vary across them, aggregates each chosen metric over the
seeds (mean and a Student-t 95% confidence interval), and writes `table.md`, `table.csv`, `table.tex`,
`curves.png` and `bars.png`; with `--baseline KEY=VALUE`, the paired differences of every other value of
KEY from VALUE (same seed and same other overrides), with a 95% interval and Holm-adjusted p-values,
in `paired.md`, `paired.csv`, `paired.tex` and `paired.png` (see `paired`).

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

Modules: `discovery` (finding runs, reading their records), `wandb_source` (W&B runs), `frames` (pandas
frames, metric specs), `stats` (t quantile, confidence intervals, aggregation), `paired` (pairing runs
with a baseline's, paired differences, Holm), `render` (Markdown, LaTeX, CSV), `plots`; `base` holds
what they share. This module is the `rlmm table` command.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from rlmm.runtime.disk import disk_fault
from rlmm.runtime.errors import MACHINE_FAULT_EXIT, fail
from rlmm.table.base import Run, TableError
from rlmm.table.discovery import read_runs
from rlmm.table.frames import DEFAULT_METRICS, check_metrics, default_metrics, direction, load_runs, varying_axes
from rlmm.table.paired import INTERVALS, pair_runs, paired_differences, parse_baseline
from rlmm.table.render import cell, write_outputs
from rlmm.table.stats import aggregate, ci_half_width, t_quantile
from rlmm.table.wandb_source import _wandb_run, parse_wandb_source

__all__ = ["Run", "TableError", "read_runs", "load_runs", "varying_axes", "direction", "default_metrics",
           "aggregate", "ci_half_width", "t_quantile", "parse_baseline", "pair_runs", "paired_differences", "cell",
           "write_outputs", "parse_wandb_source", "_wandb_run",
           "main"]


def default_out(sources: list[str]) -> Path:
    local = [Path(s) for s in sources if not s.startswith("wandb:") and Path(s).exists()]
    if len(local) == len(sources) and local:
        return Path(os.path.commonpath([p.resolve() for p in local])) / "table"
    name = "_".join(re.sub(r"[^\w.-]+", "_", s) for s in sources)[:100]
    return Path("tables") / name


def main(argv: list[str] | None = None) -> None:
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
    parser.add_argument("--baseline", metavar="KEY=VALUE",
                        help="paired differences of KEY's other values from VALUE (runs paired by seed and every "
                        "other override), 95%% interval, Holm-adjusted p; writes paired.md/.csv/.tex/.png")
    parser.add_argument("--interval", choices=INTERVALS,
                        help="interval of the paired differences: t (default) or bootstrap (percentile, seed 0)")
    args = parser.parse_args(argv)
    if args.interval and not args.baseline:
        fail("--interval applies to the paired differences: it needs --baseline KEY=VALUE")
    directions = {**{p: "min" for p in args.lower_is_better}, **{p: "max" for p in args.higher_is_better}}
    try:
        runs = read_runs(args.sources)
        for run in runs:
            if run.damage:  # its final values are an earlier step's: say so, not silently
                print(f"rlmm table: warning: {run.name}: {run.damage}; its final values are those of step "
                      f"{run.steps}", file=sys.stderr)
        df = load_runs(runs, directions)
        metrics = args.metric or default_metrics(df)
        if not metrics:
            counts = df["status"].value_counts()
            raise TableError(f"no run recorded a metric ({', '.join(f'{n} {s}' for s, n in counts.items())})")
        check_metrics(df, metrics)
        baseline = parse_baseline(args.baseline, df) if args.baseline else None
        out = args.out or default_out(args.sources)
        try:
            text, written = write_outputs(runs, df, metrics, out, args.include_incomplete, baseline,
                                          args.interval or "t")
        except OSError as err:  # the disk's fault where the tables go: one line, exit 4 (another OSError: a bug's)
            if isinstance(err, (FileExistsError, NotADirectoryError)):  # --out, or a parent of it, is a file
                file = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), err.filename)
                fail(f"--out: {out} is not a directory: {file} is a file (give --out a directory)")
            fault = disk_fault(err)
            if fault is None:
                raise
            print(f"rlmm: machine fault: {fault}; the run records are as they were (rlmm table only "
                  "reads them): run it again once it is fixed, or give --out another directory", file=sys.stderr)
            raise SystemExit(MACHINE_FAULT_EXIT) from None
    except TableError as err:
        fail(str(err))
    print(text)
    print(f"wrote {', '.join(p.name for p in written)} to {out}")
