"""The table as text and files: "mean ± ci (n=k)" cells, the wide table (one row per configuration),
Markdown, a booktabs LaTeX tabular, the paired differences from a baseline (`paired.py`) in Markdown and
LaTeX, and `write_outputs`, which writes table.md, table.csv (the aggregate, one row per configuration
and metric), table.tex, paired.md/.csv/.tex (with a baseline) and the plots."""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from rlmm.runtime.disk import writing
from rlmm.runtime.formatting import format_number
from rlmm.table.base import Run
from rlmm.table.frames import REPLICATE_AXES, steps_frame, varying_axes
from rlmm.table.paired import ALPHA, BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, paired_differences
from rlmm.table.plots import plot_bars, plot_curves, plot_paired
from rlmm.table.stats import CONFIDENCE, aggregate


# Beside a cell one of whose runs has a record line that could not be read (the note under the table names it).
DAMAGED_MARK = "†"


def cell(row) -> str:
    """'mean ± ci (n=k)', or 'mean (n=1)', or '—' when no run counts."""
    if row["n"] == 0:
        return "—"
    ci = row["ci95"]
    spread = "" if math.isnan(ci) else f" ± {format_number(ci)}"
    damaged = f" {DAMAGED_MARK}" if row.get("damaged") else ""
    return f"{format_number(row['mean'])}{spread} (n={row['n']}){damaged}"


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


def markdown_table(columns, rows) -> str:
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(columns), line(["---"] * len(columns)), *(line(r) for r in rows)])


def markdown(wide: pd.DataFrame, df: pd.DataFrame, by: list[str], include_incomplete: bool) -> str:
    lines = [markdown_table(wide.columns, wide.itertuples(index=False, name=None))]
    fixed = [f"{k}={df[k].iloc[0]}" for k in (df.attrs.get("axes") or []) if k not in by and k in df
             and df[k].nunique() == 1 and k not in REPLICATE_AXES]
    counted = "complete and incomplete (at their last step)" if include_incomplete else "complete"
    lines += ["", f"Cells: mean ± {CONFIDENCE:.0%} CI half-width (Student t over seeds) (n = {counted} runs with "
              "a value)."]
    if fixed:
        lines.append("Same in every run: " + ", ".join(fixed) + ".")
    for run, steps, damage in df.loc[df["damage"] != "", ["run", "steps", "damage"]].to_numpy().tolist():
        lines.append(f"{DAMAGED_MARK} {run}: {damage}; its values are those up to step {steps}.")
    others = df[df["status"] != "complete"]
    if len(others):
        lines.append("Not complete: " + "; ".join(f"{run} ({status}: {note})" for run, status, note in
                                              others[["run", "status", "note"]].to_numpy().tolist()) + ".")
    return "\n".join(lines) + "\n"


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
        "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "±": r"$\pm$", "—": "--",
        "Δ": r"$\Delta$"}


def tex_text(text) -> str:
    """Text for LaTeX's text mode, its special characters escaped."""
    return "".join(_TEX.get(ch, ch) for ch in str(text))


def tex_number(value, bold: bool = False, mark: str = "") -> str:
    r"""`format_number`'s digits as LaTeX math: 7.600e-05 -> $7.600\times10^{-5}$, 0.25 -> $0.2500$, bold
    with \mathbf, `mark` as a superscript; NaN -> --."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "--"
    body = _tex_math(value)
    body = rf"\mathbf{{{body}}}" if bold else body
    return f"${body}^{{{mark}}}$" if mark else f"${body}$"


def _tex_math(value) -> str:
    mantissa, e, exponent = format_number(value).partition("e")
    return rf"{mantissa}\times10^{{{int(exponent)}}}" if e else mantissa


def latex(wide: pd.DataFrame) -> str:
    """A booktabs tabular, by hand (pandas' to_latex needs jinja2, which rlmm does not depend on)."""
    def row(cells) -> str:
        return " & ".join(tex_text(c) for c in cells) + r" \\"

    return "\n".join([r"\begin{tabular}{" + "l" * wide.shape[1] + "}", r"\toprule", row(wide.columns), r"\midrule",
                      *(row(r) for r in wide.itertuples(index=False, name=None)),
                      r"\bottomrule", r"\end{tabular}"]) + "\n"


PAIRED_HEAD = ["n", "Δ mean", f"{CONFIDENCE:.0%} CI", "p", "p (Holm)"]


def _number_or_dash(value) -> str:
    return "—" if math.isnan(value) else format_number(value)


def paired_markdown(paired: pd.DataFrame, unpaired: list[str], key: str, baseline: str) -> str:
    """The paired differences (`paired.paired_differences`) as a Markdown table with the lines that read it."""
    axes = paired.attrs["axes"]
    rows = [[f"{r['metric']} ({r['reduction']})", *(r[k] for k in axes), int(r["n"]),
             _number_or_dash(r["mean_diff"]) + (" *" if r["significant"] else ""),
             "—" if math.isnan(r["ci_low"]) else f"[{format_number(r['ci_low'])}, {format_number(r['ci_high'])}]",
             _number_or_dash(r["p"]), _number_or_dash(r["p_holm"])] for r in paired.to_dict("records")]
    interval = ("paired t" if (paired["interval"] == "t").all() else f"percentile bootstrap of the mean, "
                f"{BOOTSTRAP_RESAMPLES} resamples of the pairs, seed {BOOTSTRAP_SEED} (too narrow with few pairs: "
                "n pairs have at most n^n distinct resamples; below about 10 pairs read the paired t interval)")
    return "\n".join([
        f"Paired differences from {key}={baseline}: Δ = arm − baseline over pairs of runs that agree on every "
        f"other override ({', '.join(paired.attrs['match']) or 'none varies'}).", "",
        markdown_table(["metric", *axes, *PAIRED_HEAD], rows), "",
        f"{CONFIDENCE:.0%} CI: {interval}. p: two-sided paired t-test; p (Holm): Holm-adjusted over the "
        f"comparisons of each metric; * p (Holm) < {ALPHA:g}; — where n < 2 or every difference is 0. "
        "n: pairs with a value in both runs.",
        "Unpaired runs: " + ("; ".join(unpaired) if unpaired else "none") + "."]) + "\n"


def paired_latex(paired: pd.DataFrame) -> str:
    """The paired differences as a booktabs tabular: numbers as math, the significant Δ in bold with a star."""
    axes = paired.attrs["axes"]

    def row(r) -> str:
        significant = bool(r["significant"])
        ci = "--" if math.isnan(r["ci_low"]) else f"$[{_tex_math(r['ci_low'])}, {_tex_math(r['ci_high'])}]$"
        cells = [tex_text(f"{r['metric']} ({r['reduction']})"), *(tex_text(r[k]) for k in axes),
                 f"${int(r['n'])}$", tex_number(r["mean_diff"], bold=significant, mark="*" if significant else ""),
                 ci, tex_number(r["p"]), tex_number(r["p_holm"])]
        return " & ".join(cells) + r" \\"

    head = [tex_text(c) for c in ("metric", *axes)] + [r"$n$", r"$\Delta$ mean", tex_text(PAIRED_HEAD[2]), r"$p$",
                                                       r"$p_{\mathrm{Holm}}$"]
    return "\n".join([r"\begin{tabular}{" + "l" * (1 + len(axes)) + "r" * len(PAIRED_HEAD) + "}", r"\toprule",
                      " & ".join(head) + r" \\", r"\midrule", *(row(r) for r in paired.to_dict("records")),
                      r"\bottomrule", r"\end{tabular}"]) + "\n"


def write_outputs(runs: list[Run], df: pd.DataFrame, metrics: list[str], out: Path,
                  include_incomplete: bool = False, baseline: tuple[str, str] | None = None,
                  interval: str = "t") -> tuple[str, list[Path]]:
    """Write table.md, table.csv, table.tex, bars.png and (runs with steps) curves.png into `out`, and with
    a `baseline` (KEY, VALUE) the paired differences from it: paired.md, paired.csv, paired.tex, paired.png;
    return the Markdown text and the files written. A fault of the disk is an OSError naming the file
    (rlmm/runtime/disk.py's `writing`)."""
    by = varying_axes(df)
    agg = aggregate(df, metrics, by=by, include_incomplete=include_incomplete)
    wide = wide_table(agg, by)
    text = markdown(wide, df, by, include_incomplete)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "table.md", out / "table.csv", out / "table.tex"]
    with writing(written[0]):
        written[0].write_text(text)
    with writing(written[1]):
        agg.to_csv(written[1], index=False)
    with writing(written[2]):
        written[2].write_text(latex(wide))
    with writing(out / "curves.png"):
        if plot_curves(df, steps_frame(runs), metrics, out / "curves.png", by, include_incomplete):
            written.append(out / "curves.png")
    with writing(out / "bars.png"):
        plot_bars(agg, out / "bars.png", by)
    written.append(out / "bars.png")
    if baseline:
        key, value = baseline
        paired, unpaired = paired_differences(df, metrics, key, value, interval, include_incomplete)
        paired_text = paired_markdown(paired, unpaired, key, value)
        text += "\n" + paired_text
        files = [out / name for name in ("paired.md", "paired.csv", "paired.tex", "paired.png")]
        with writing(files[0]):
            files[0].write_text(paired_text)
        with writing(files[1]):
            paired.to_csv(files[1], index=False)
        with writing(files[2]):
            files[2].write_text(paired_latex(paired))
        with writing(files[3]):
            plot_paired(paired, files[3], key, value)
        written += files
    return text, written
