"""The table as text and files: "mean ± ci (n=k)" cells, the wide table (one row per configuration),
Markdown, a booktabs LaTeX tabular, and `write_outputs`, which writes table.md, table.csv (the
aggregate, one row per configuration and metric), table.tex and the plots."""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from rlmm.formatting import format_number
from rlmm.table.base import Run
from rlmm.table.frames import REPLICATE_AXES, steps_frame, varying_axes
from rlmm.table.plots import plot_bars, plot_curves
from rlmm.table.stats import CONFIDENCE, aggregate


def cell(row) -> str:
    """'mean ± ci (n=k)', or 'mean (n=1)', or '—' when no run counts."""
    if row["n"] == 0:
        return "—"
    ci = row["ci95"]
    spread = "" if math.isnan(ci) else f" ± {format_number(ci)}"
    return f"{format_number(row['mean'])}{spread} (n={row['n']})"


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
