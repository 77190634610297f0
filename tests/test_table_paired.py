"""`rlmm table --baseline KEY=VALUE`: paired differences from a baseline arm, on sweeps written with the
real RunRecord whose answers are known by construction.

The shift sweep: correction {none, tis, icepop, seq_mis} x seed 0..7, final eval/accuracy =
level(seed) + arm offset, with a seed effect (sd 0.1) much larger than the offsets, so only pairing
by seed finds them:
  tis:     +0.05 plus noise of sd 0.005           -> significant, positive, interval around 0.05
  icepop:   0 plus noise of sd 0.005              -> not significant
  seq_mis: a fixed pattern of mean c, c chosen so that its raw p is 0.03: significant alone,
           not after Holm over the three arms (its adjusted p is 2 x 0.03 = 0.06).
"""
from __future__ import annotations

import math
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats
from statsmodels.stats.multitest import multipletests

from rlmm import table
from rlmm.run.records import RunRecord
from rlmm.runtime.formatting import format_number
from rlmm.table.paired import difference_stats
from tests.test_table import one_line_error, rlmm, write_overrides

SEEDS = range(8)
SHIFT = 0.05
LEVEL = 0.5 + 0.1 * np.random.default_rng(1).standard_normal(len(SEEDS))    # seed effect
NOISE = {arm: 0.005 * np.random.default_rng(10 + i).standard_normal(len(SEEDS))
         for i, arm in enumerate(("tis", "icepop"))}
PATTERN = np.array([1.0, -1.0, 0.5, -0.5, 1.5, -1.5, 0.25, -0.25]) * 0.01  # mean 0
MARGINAL_P = 0.03
# paired t = c √n / s_d with s_d = sd(PATTERN): the c that gives a two-sided p of MARGINAL_P
MARGINAL = stats.t.ppf(1 - MARGINAL_P / 2, len(SEEDS) - 1) * PATTERN.std(ddof=1) / math.sqrt(len(SEEDS))
ARMS = {"none": np.zeros(len(SEEDS)), "tis": SHIFT + NOISE["tis"], "icepop": NOISE["icepop"],
        "seq_mis": MARGINAL + PATTERN}


def record(run_dir: Path, overrides: dict[str, object], accuracy: float, finish: bool = True) -> None:
    """A train run whose final eval/accuracy is `accuracy`; not finished: only its overrides (failed)."""
    write_overrides(run_dir, [f"{k}={v}" for k, v in overrides.items()])
    if not finish:
        return
    run = RunRecord(run_dir, {"choices": {k: v for k, v in overrides.items() if k != "seed"}})
    run.log({"eval/accuracy": 0.1}, step=0)
    run.log({"eval/accuracy": accuracy, "rollout/reward_mean": accuracy / 2}, step=1)
    run.summary({"steps": 1})
    run.close()


def accuracy(arm: str, seed: int) -> float:
    return float(LEVEL[seed] + ARMS[arm][seed])


@pytest.fixture(scope="module")
def shift_sweep(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("paired") / "shift"
    job = 0
    for arm in ARMS:
        for seed in SEEDS:
            record(root / str(job), {"correction": arm, "seed": seed, "logger": "none"}, accuracy(arm, seed))
            job += 1
    return root


@pytest.fixture(scope="module")
def shift(shift_sweep) -> pd.DataFrame:
    df = table.load_runs(shift_sweep)
    paired, unpaired = table.paired_differences(df, ["eval/accuracy"], "correction", "none")
    assert unpaired == []
    return paired.set_index("correction")


def test_known_shift_is_significant_with_its_sign_and_interval(shift):
    assert list(shift.index) == ["tis", "icepop", "seq_mis"]   # the sweep's order, baseline left out
    tis = shift.loc["tis"]
    assert tis["n"] == 8 and tis["baseline"] == "none" and tis["reduction"] == "final"
    assert tis["mean_diff"] == pytest.approx(SHIFT + NOISE["tis"].mean(), abs=1e-12)
    assert 0 < tis["ci_low"] < SHIFT < tis["ci_high"] < 0.1
    assert tis["p_holm"] < 1e-6 and tis["significant"]
    # the interval is the paired t interval of the constructed differences
    expected = stats.ttest_rel(ARMS["tis"], ARMS["none"]).confidence_interval(0.95)
    assert (tis["ci_low"], tis["ci_high"]) == pytest.approx((expected.low, expected.high), abs=1e-12)


def test_no_shift_is_not_significant(shift):
    icepop = shift.loc["icepop"]
    assert icepop["ci_low"] < 0 < icepop["ci_high"]
    assert icepop["p"] > 0.05 and not icepop["significant"]


def test_holm_across_arms_and_the_marginal_arm_loses_significance(shift):
    raw = [stats.ttest_rel(ARMS[arm], ARMS["none"]).pvalue for arm in ("tis", "icepop", "seq_mis")]
    assert shift["p"].tolist() == pytest.approx(raw, rel=1e-9)
    assert shift["p_holm"].tolist() == pytest.approx(list(multipletests(raw, method="holm")[1]), rel=1e-9)
    marginal = shift.loc["seq_mis"]
    assert marginal["p"] == pytest.approx(MARGINAL_P, rel=1e-6)
    assert marginal["ci_low"] > 0                       # significant alone (its own interval excludes 0) ...
    assert marginal["p_holm"] == pytest.approx(2 * MARGINAL_P, rel=1e-6)   # ... but not after Holm
    assert not marginal["significant"]


def test_bootstrap_interval_is_seeded_and_covers_the_shift(shift_sweep, shift):
    df = table.load_runs(shift_sweep)
    first, _ = table.paired_differences(df, ["eval/accuracy"], "correction", "none", interval="bootstrap")
    again, _ = table.paired_differences(df, ["eval/accuracy"], "correction", "none", interval="bootstrap")
    pd.testing.assert_frame_equal(first, again)
    tis = first.set_index("correction").loc["tis"]
    assert tis["interval"] == "bootstrap" and 0 < tis["ci_low"] < SHIFT < tis["ci_high"]
    assert (tis["ci_low"], tis["ci_high"]) != (shift.loc["tis", "ci_low"], shift.loc["tis", "ci_high"])
    assert first["p"].tolist() == shift["p"].tolist()   # the p-value is the paired t-test's either way


def test_one_pair_or_equal_runs_give_no_p():
    one = difference_stats(np.array([0.6]), np.array([0.5]))
    assert one["n"] == 1 and one["mean_diff"] == pytest.approx(0.1) and math.isnan(one["ci_low"])
    same = difference_stats(np.array([0.5, 0.7]), np.array([0.5, 0.7]))
    assert same["mean_diff"] == 0 and math.isnan(same["p"])


@pytest.fixture(scope="module")
def two_task_sweep(tmp_path_factory) -> Path:
    """task {a, b} x correction {none, tis} x seed 0..3; tis - none = +0.05 in task a and -0.05 in task b,
    and task b sits 0.4 higher, so pairing across tasks would show. Task b has no correction=none seed 3
    (its tis seed 3 is unpaired); task a's tis seed 4 failed (its none seed 4 is unpaired)."""
    root = tmp_path_factory.mktemp("paired") / "tasks"
    job = 0
    for task, level, shift in (("a", 0.3, SHIFT), ("b", 0.7, -SHIFT)):
        for arm in ("none", "tis"):
            for seed in range(4):
                if (task, arm, seed) == ("b", "none", 3):
                    continue
                value = level + 0.1 * seed + (shift if arm == "tis" else 0.0) + 0.001 * (seed % 2)
                record(root / str(job), {"task": task, "correction": arm, "seed": seed}, value)
                job += 1
    record(root / str(job), {"task": "a", "correction": "none", "seed": 4}, 0.9)
    record(root / str(job + 1), {"task": "a", "correction": "tis", "seed": 4}, 0.0, finish=False)
    return root


def test_pairs_agree_on_every_other_key_and_unpaired_runs_are_listed(two_task_sweep):
    df = table.load_runs(two_task_sweep)
    pairs, unpaired = table.pair_runs(df, "correction", "none")
    assert len(pairs) == 4 + 3
    for _, pair in pairs.iterrows():
        base, arm = df.loc[pair["baseline_run"]], df.loc[pair["arm_run"]]
        assert (base["task"], base["seed"], base["correction"]) == (arm["task"], arm["seed"], "none")
        assert arm["correction"] == "tis" == pair["correction"] and pair["task"] == arm["task"]
    run_of = {tuple(r): name for name, *r in df[["run", "task", "correction", "seed"]].itertuples(index=False)}
    assert unpaired == [
        f"{run_of['b', 'tis', '3']} (correction=tis task=b seed=3: no correction=none run)",
        f"{run_of['a', 'none', '4']} (correction=none task=a seed=4: no correction=tis run "
        f"({run_of['a', 'tis', '4']} is failed))"]
    paired, _ = table.paired_differences(df, ["eval/accuracy"], "correction", "none")
    rows = paired.set_index("task")
    assert rows.loc["a", "n"] == 4 and rows.loc["a", "mean_diff"] == pytest.approx(SHIFT)
    assert rows.loc["b", "n"] == 3 and rows.loc["b", "mean_diff"] == pytest.approx(-SHIFT)
    assert list(paired.attrs["match"]) == ["task", "seed"]


def test_two_runs_of_one_seed_fail_pairing(two_task_sweep, tmp_path):
    shutil.copytree(two_task_sweep, tmp_path / "s")
    record(tmp_path / "s" / "99", {"task": "a", "correction": "tis", "seed": 0}, 0.5)
    df = table.load_runs(tmp_path / "s")
    with pytest.raises(table.TableError, match=r"runs \d+, 99 are all correction=tis task=a seed=0: pairing needs "
                                               r"one run per task, seed"):
        table.pair_runs(df, "correction", "none")


def tex_value(cell: str) -> float:
    """A number of paired.tex back to a float: $\\mathbf{2.418\\times10^{-4}}^{*}$ -> 2.418e-4."""
    body = re.sub(r"\\mathbf\{(.*)\}", r"\1", cell.strip().strip("$").removesuffix("^{*}"))
    return float(re.sub(r"\\times10\^\{(-?\d+)\}", r"e\1", body))


def test_cli_markdown_csv_and_latex_carry_the_same_numbers(shift_sweep, tmp_path):
    out = tmp_path / "t"
    result = rlmm("table", str(shift_sweep), "--metric", "eval/accuracy", "--metric", "rollout/reward_mean",
                  "--baseline", "correction=none", "--out", str(out))
    assert result.returncode == 0, result.stderr
    for name in ("paired.md", "paired.csv", "paired.tex", "paired.png", "table.md"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "paired.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md, tex = (out / "paired.md").read_text(), (out / "paired.tex").read_text()
    assert md in result.stdout
    assert "agree on every other override (seed)" in md and "Unpaired runs: none." in md
    csv = pd.read_csv(out / "paired.csv")
    assert list(csv.columns) == ["metric", "reduction", "correction", "baseline", "interval", "n", "mean_diff",
                                 "ci_low", "ci_high", "p", "p_holm", "significant"]
    assert len(csv) == 2 * 3
    # reward = accuracy / 2: the same p-values, half the differences
    assert csv["p"].iloc[:3].tolist() == pytest.approx(csv["p"].iloc[3:].tolist(), rel=1e-6)
    tex_rows = [line.removesuffix(r" \\").split(" & ") for line in tex.splitlines() if " & " in line][1:]
    for r, tex_row in zip(csv.to_dict("records"), tex_rows, strict=True):
        star = " *" if r["significant"] else ""
        numbers = [format_number(r[k]) for k in ("mean_diff", "ci_low", "ci_high", "p", "p_holm")]
        assert (f"| {r['metric']} ({r['reduction']}) | {r['correction']} | {r['n']} | {numbers[0]}{star} | "
                f"[{numbers[1]}, {numbers[2]}] | {numbers[3]} | {numbers[4]} |") in md
        metric, correction, n, mean, ci, p, p_holm = tex_row
        assert metric == f"{r['metric']} ({r['reduction']})".replace("_", r"\_")
        assert correction == r["correction"].replace("_", r"\_")
        ci_low, _, ci_high = ci.strip("$[]").partition(", ")
        assert [tex_value(c) for c in (mean, ci_low, ci_high, p, p_holm)] == [float(x) for x in numbers]
        assert n == f"${r['n']}$" and mean.startswith(r"$\mathbf{") == mean.endswith("^{*}$") == r["significant"]
    assert csv["significant"].tolist() == [True, False, False] * 2
    assert r"\toprule" in tex and r"\midrule" in tex and r"\bottomrule" in tex and "e-0" not in tex
    assert r"\times10^{" in tex  # the p-values of tis


def test_cli_bad_baseline_is_one_line_naming_the_allowed_ones(shift_sweep, tmp_path):
    out = tmp_path / "o"
    line = one_line_error(rlmm("table", str(shift_sweep), "--baseline", "correction=nonee", "--out", str(out)))
    assert line == "rlmm: error: bad --baseline value 'correction=nonee' (allowed: none, tis, icepop, seq_mis)"
    line = one_line_error(rlmm("table", str(shift_sweep), "--baseline", "corection=none", "--out", str(out)))
    assert line == ("rlmm: error: bad --baseline key 'corection' (allowed: the overrides that vary, seed aside: "
                    "correction)")
    line = one_line_error(rlmm("table", str(shift_sweep), "--baseline", "seed=0", "--out", str(out)))
    assert "bad --baseline key 'seed'" in line
    assert "bad --baseline 'correction' (expected KEY=VALUE" in one_line_error(
        rlmm("table", str(shift_sweep), "--baseline", "correction", "--out", str(out)))
    assert "--interval applies to the paired differences" in one_line_error(
        rlmm("table", str(shift_sweep), "--interval", "bootstrap", "--out", str(out)))
    assert not out.exists()


@pytest.mark.latex
def test_latex_tables_compile(two_task_sweep, tmp_path):
    """paired.tex and table.tex inside a minimal document compile with pdflatex and booktabs."""
    if not shutil.which("pdflatex"):
        pytest.skip("no pdflatex (Debian: apt-get install texlive-latex-base texlive-latex-recommended)")
    result = rlmm("table", str(two_task_sweep), "--baseline", "correction=none", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    (tmp_path / "doc.tex").write_text("\\documentclass{article}\n\\usepackage{booktabs}\n"
                                      "\\usepackage[margin=1cm,landscape]{geometry}\n\\begin{document}\n"
                                      "\\input{paired.tex}\n\n\\input{table.tex}\n\\end{document}\n")
    compiled = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "doc.tex"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
    assert compiled.returncode == 0, compiled.stdout[-3000:]
    assert (tmp_path / "doc.pdf").read_bytes()[:5] == b"%PDF-"
