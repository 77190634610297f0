"""`rlmm table`: ablation tables from fake sweep directories written with the real RunRecord.

The train sweep: precision {bf16, fp16} x correction {tis, icepop} x seed {0, 1, 2}, all finished,
plus three runs that did not finish: (fp16, icepop, seed 3) killed after step 2 mid-line,
(bf16, tis, seed 3) with nothing but its .hydra/ and (bf16, icepop, seed 3) killed after the step-0
evaluation. Expected numbers below are worked out by hand from the formulas that generate the records.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import socket
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from rlmm import table
from rlmm.run.records import RunRecord
from rlmm.runtime.formatting import format_number

RLMM = str(Path(__file__).resolve().parents[1] / ".venv" / "bin" / "rlmm")
BASE = {("bf16", "tis"): 0.45, ("bf16", "icepop"): 0.35, ("fp16", "tis"): 0.25, ("fp16", "icepop"): 0.15}
OFFSET = {0: 0.0, 1: 0.03, 2: 0.09}    # reward offset per seed
KL = {"bf16": 1e-4, "fp16": 1e-6}       # kl_k3 at step s = KL * s * (1 + seed)
STEPS = 5


def write_overrides(run_dir: Path, overrides: list[str]) -> None:
    (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))


def train_run(run_dir: Path, precision: str, correction: str, seed: int, last_step: int = STEPS,
              finish: bool = True, reward_base: float | None = None) -> None:
    """reward_mean at step s = base + OFFSET[seed] + 0.01 s; eval/accuracy 0.1 at step 0,
    base + 0.3 at step 3 (the best), base + 0.01 seed at the last step."""
    overrides = [f"precision={precision}", f"correction={correction}", f"seed={seed}", "logger=none",
                 f"train.steps={STEPS}"]
    write_overrides(run_dir, overrides)
    record = RunRecord(run_dir, {"choices": {"precision": precision, "correction": correction}, "seed": seed})
    base = BASE[precision, correction] if reward_base is None else reward_base
    record.log({"eval/accuracy": 0.1}, step=0)
    for step in range(1, last_step + 1):
        metrics = {"rollout/reward_mean": base + OFFSET.get(seed, 0.0) + 0.01 * step,
                   "mismatch/kl_k3": KL[precision] * step * (1 + seed), "loss/loss": 1.0 / step}
        if step == 3:
            metrics["eval/accuracy"] = base + 0.3
        if step == STEPS:
            metrics["eval/accuracy"] = base + 0.01 * seed
        record.log(metrics, step)
    if finish:
        record.summary({"steps": STEPS, "reward_last": base + OFFSET[seed] + 0.01 * STEPS, "seconds": 10.0 + seed,
                        "choices": {"precision": precision}})
    record.close()


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("multirun") / "2026-11-29" / "12-00-00"
    job = 0
    for precision in ("bf16", "fp16"):
        for correction in ("tis", "icepop"):
            for seed in (0, 1, 2):
                train_run(root / str(job), precision, correction, seed)
                job += 1
    # killed mid-write after step 2 (values far off, so counting it by mistake shows)
    train_run(root / "12", "fp16", "icepop", 3, last_step=2, finish=False, reward_base=100.0)
    with open(root / "12" / "steps.jsonl", "a") as f:
        f.write('{"step": 3, "rollout/rew')
    write_overrides(root / "13", ["precision=bf16", "correction=tis", "seed=3", "logger=none", f"train.steps={STEPS}"])
    train_run(root / "14", "bf16", "icepop", 3, last_step=0, finish=False)
    (root / ".submitit" / "1234").mkdir(parents=True)
    (root / ".submitit" / "1234" / "1234_0_log.err").write_text("Traceback ...\n")
    (root / "multirun.yaml").write_text("hydra: {}\n")
    return root


@pytest.fixture(scope="module")
def runs(sweep) -> pd.DataFrame:
    return table.load_runs(sweep)


def row(agg: pd.DataFrame, precision: str, correction: str, metric: str) -> pd.Series:
    match = agg[(agg["precision"] == precision) & (agg["correction"] == correction) & (agg["metric"] == metric)]
    assert len(match) == 1, match
    return match.iloc[0]


def test_one_row_per_run_with_status_and_steps(runs):
    assert len(runs) == 15
    assert list(runs["run"]) == [str(i) for i in range(15)]  # job 10 after 9, .submitit/ left out
    status = dict(zip(runs["run"], runs["status"]))
    assert {k: v for k, v in status.items() if v != "complete"} == {"12": "incomplete", "13": "failed", "14": "failed"}
    steps = dict(zip(runs["run"], runs["steps"]))
    assert steps["0"] == STEPS and steps["12"] == 2 and steps["13"] == 0 and steps["14"] == 0
    notes = dict(zip(runs["run"], runs["note"]))
    assert notes["12"] == "stopped after step 2" and notes["13"] == "nothing recorded"
    assert notes["14"] == "no training step recorded"
    assert list(runs.loc[runs["run"] == "13", ["precision", "correction", "seed"]].iloc[0]) == ["bf16", "tis", "3"]
    # killed run: its last complete step is step 2 (the torn step-3 line is skipped)
    killed = runs[runs["run"] == "12"].iloc[0]
    assert killed["rollout/reward_mean:final"] == pytest.approx(100.0 + 0.02)
    assert killed["eval/accuracy:final"] == pytest.approx(0.1)
    assert runs.loc[runs["run"] == "4", "summary/seconds:final"].item() == 11.0


def test_varying_axes_leave_out_seed_and_fixed_overrides(runs):
    assert table.varying_axes(runs) == ["precision", "correction"]
    assert table.varying_axes(runs, replicate=()) == ["precision", "correction", "seed"]
    assert table.varying_axes(runs[runs["precision"] == "bf16"]) == ["correction"]


def test_final_best_and_mean_over_steps(runs):
    run = runs[runs["run"] == "1"].iloc[0]  # bf16, tis, seed 1
    assert run["eval/accuracy:final"] == pytest.approx(0.45 + 0.01)
    assert run["eval/accuracy:best"] == pytest.approx(0.45 + 0.3)  # higher is better: the step-3 value
    # kl_k3 = 1e-4 * s * 2 for s = 1..5: final 1e-3, best (lower is better) 2e-4, mean 1e-4 * 2 * 3
    assert run["mismatch/kl_k3:final"] == pytest.approx(1e-3)
    assert run["mismatch/kl_k3:best"] == pytest.approx(2e-4)
    assert run["mismatch/kl_k3:mean"] == pytest.approx(6e-4)
    assert run["loss/loss:best"] == pytest.approx(1 / 5)
    assert table.direction("mismatch/kl_k3") == "min" and table.direction("mismatch/prob_pearson") == "max"
    assert table.direction("eval/accuracy") == "max" and table.direction("perf/tokens_per_second") == "max"


def test_direction_is_configurable(sweep):
    flipped = table.load_runs(sweep, directions={"mismatch/*": "max", "eval/accuracy": "min"})
    run = flipped[flipped["run"] == "1"].iloc[0]
    assert run["mismatch/kl_k3:best"] == pytest.approx(1e-3)
    assert run["eval/accuracy:best"] == pytest.approx(0.1)
    agg = table.aggregate(flipped, ["mismatch/kl_k3:best"])
    assert set(agg["reduction"]) == {"best (max)"}


def test_aggregate_mean_ci_n_and_run_counts(runs):
    agg = table.aggregate(runs, ["rollout/reward_mean:final", "mismatch/kl_k3:mean", "eval/accuracy:best"])
    assert len(agg) == 4 * 3
    assert list(dict.fromkeys(zip(agg["precision"], agg["correction"]))) == list(BASE)  # sweep order
    # bf16 + tis, final reward per seed: 0.45 + {0, .03, .09} + 0.05 = 0.50, 0.53, 0.59
    # mean 0.54; s^2 = (0.04^2 + 0.01^2 + 0.05^2) / 2 = 0.0021; t_{0.975, 2} = 4.3027 (t table)
    r = row(agg, "bf16", "tis", "rollout/reward_mean")
    assert r["mean"] == pytest.approx(0.54)
    assert r["std"] == pytest.approx(math.sqrt(0.0021))
    assert r["ci95"] == pytest.approx(4.302653 * math.sqrt(0.0021) / math.sqrt(3), rel=1e-6)
    assert (r["n"], r["ok"], r["incomplete"], r["failed"]) == (3, 3, 0, 1)
    # the killed fp16 + icepop run is not counted: mean of 0.15 + 0.05 + {0, .03, .09} = 0.24
    r = row(agg, "fp16", "icepop", "rollout/reward_mean")
    assert r["mean"] == pytest.approx(0.24) and (r["n"], r["ok"], r["incomplete"], r["failed"]) == (3, 3, 1, 0)
    r = row(agg, "bf16", "icepop", "rollout/reward_mean")
    assert (r["n"], r["ok"], r["incomplete"], r["failed"]) == (3, 3, 0, 1)
    r = row(agg, "fp16", "tis", "rollout/reward_mean")
    assert r["mean"] == pytest.approx(0.25 + 0.05 + 0.04) and (r["n"], r["incomplete"], r["failed"]) == (3, 0, 0)
    # kl_k3 mean over steps = KL * 3 * (1 + seed); over seeds: KL * 3 * 2
    for (precision, correction) in BASE:
        r = row(agg, precision, correction, "mismatch/kl_k3")
        assert r["mean"] == pytest.approx(KL[precision] * 6) and r["reduction"] == "mean" and r["n"] == 3
        assert r["ci95"] == pytest.approx(4.302653 * KL[precision] * 3 * 1 / math.sqrt(3), rel=1e-6)  # s = KL*3*1
        r = row(agg, precision, correction, "eval/accuracy")
        assert r["mean"] == pytest.approx(BASE[precision, correction] + 0.3) and r["reduction"] == "best (max)"
        assert r["ci95"] == pytest.approx(0, abs=1e-12)


def test_include_incomplete_counts_the_killed_run_at_its_last_step(runs):
    agg = table.aggregate(runs, ["rollout/reward_mean"], include_incomplete=True)
    r = row(agg, "fp16", "icepop", "rollout/reward_mean")
    values = [0.20, 0.23, 0.29, 100.02]
    assert r["n"] == 4 and r["mean"] == pytest.approx(statistics.mean(values))
    assert r["ci95"] == pytest.approx(3.182446 * statistics.stdev(values) / 2, rel=1e-6)  # t_{0.975, 3} = 3.1824
    assert row(agg, "bf16", "tis", "rollout/reward_mean")["n"] == 3  # a failed run has nothing to count


@pytest.mark.parametrize("dof,expected", [(1, 12.7062), (2, 4.3027), (3, 3.1824), (4, 2.7764), (5, 2.5706),
                                          (10, 2.2281), (30, 2.0423), (100, 1.9840)])
def test_t_quantile_matches_t_table(dof, expected):
    assert table.t_quantile(0.975, dof) == pytest.approx(expected, abs=1e-4)


def test_t_quantile_other_levels():
    assert table.t_quantile(0.95, 9) == pytest.approx(1.8331, abs=1e-4)
    assert table.t_quantile(0.995, 6) == pytest.approx(3.7074, abs=1e-4)
    assert table.t_quantile(0.025, 4) == pytest.approx(-2.7764, abs=1e-4)


def test_one_run_has_no_ci_and_no_run_has_a_dash():
    assert math.isnan(table.ci_half_width([0.5]))
    assert table.cell({"n": 1, "mean": 0.5, "ci95": math.nan}) == "0.5000 (n=1)"
    assert table.cell({"n": 0, "mean": math.nan, "ci95": math.nan}) == "—"
    assert table.cell({"n": 3, "mean": 0.54, "ci95": 0.1138}) == "0.5400 ± 0.1138 (n=3)"
    assert format_number(0.9999598) == "0.9999598" and format_number(7.6e-5) == "7.600e-05"


def test_bad_metric_names_list_the_available_ones(runs):
    with pytest.raises(table.TableError, match=r"unknown metric 'eval/acc' \(available: .*eval/accuracy"):
        table.aggregate(runs, ["eval/acc"])
    with pytest.raises(table.TableError, match=r"expected NAME\[:final\|best\|mean\]"):
        table.aggregate(runs, ["eval/accuracy:last"])


def rlmm(*args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")} | env
    return subprocess.run([RLMM, *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=environ,
                          stdin=subprocess.DEVNULL)


def test_cli_end_to_end(sweep, tmp_path):
    result = rlmm("table", str(sweep))
    assert result.returncode == 0, result.stderr
    out = sweep / "table"
    for name in ("table.md", "table.csv", "table.tex", "curves.png", "bars.png"):
        assert (out / name).stat().st_size > 0, name
    for name in ("curves.png", "bars.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "table.md").read_text()
    assert md.splitlines()[0] == ("| precision | correction | runs | eval/accuracy (final) "
                                  "| rollout/reward_mean (final) | mismatch/kl_k3 (mean) |")
    # final accuracy 0.15 + {0, .01, .02}: mean 0.16, s = 0.01, ci = 4.3027 * 0.01 / sqrt(3) = 0.0248
    assert "| fp16 | icepop | 3 ok, 1 incomplete | 0.1600 ± 0.0248 (n=3) | 0.2400 ± 0.1138 (n=3) |" in md
    # kl_k3 mean over steps 3K, 6K, 9K (K = 1e-4): mean 6K, s = 3K, ci = 4.3027 * 3K / sqrt(3) = 7.452K
    assert ("| bf16 | tis | 3 ok, 1 failed | 0.4600 ± 0.0248 (n=3) | 0.5400 ± 0.1138 (n=3) "
            "| 6.000e-04 ± 7.452e-04 (n=3) |") in md
    assert "| fp16 | tis | 3 ok | " in md
    assert "12 (incomplete: stopped after step 2); 13 (failed: nothing recorded)" in md
    assert "Same in every run: logger=none, train.steps=5." in md
    assert md.splitlines()[0] in result.stdout and "wrote table.md" in result.stdout
    csv = pd.read_csv(out / "table.csv")
    assert list(csv.columns) == ["precision", "correction", "metric", "reduction", "mean", "ci95", "std", "n", "ok",
                                 "incomplete", "failed", "damaged"]
    assert len(csv) == 12 and csv["n"].tolist() == [3] * 12
    assert csv["failed"].sum() == 2 * 3 and csv["incomplete"].sum() == 3
    tex = (out / "table.tex").read_text()
    assert tex.startswith(r"\begin{tabular}{llllll}") and r"0.5400 $\pm$ 0.1138 (n=3)" in tex
    assert r"eval/accuracy (final) & rollout/reward\_mean (final)" in tex

    # chosen metrics, another output dir; the old table/ dir is not mistaken for a run
    result = rlmm("table", str(sweep), "--metric", "mismatch/kl_k3:best", "--metric", "loss/loss:final",
                  "--out", str(tmp_path / "t"), "--lower-is-better", "loss/*", "--include-incomplete")
    assert result.returncode == 0, result.stderr
    md = (tmp_path / "t" / "table.md").read_text()
    assert "| mismatch/kl_k3 (best (min)) | loss/loss (final) |" in md.splitlines()[0]
    # min kl_k3 over steps = K (1 + seed): K, 2K, 3K, and the killed seed 3: 4K -> mean 2.5K over n = 4
    assert "| fp16 | icepop | 3 ok, 1 incomplete | 2.500e-06 ± 2.054e-06 (n=4) |" in md
    assert "| fp16 | tis | 3 ok | 2.000e-06 ± 2.484e-06 (n=3) | 0.2000 ± 0.0000 (n=3) |" in md


def test_cli_single_run_nested_sweeps_and_globs(sweep, tmp_path):
    one = table.load_runs(sweep / "3")
    assert list(one["run"]) == ["3"] and table.varying_axes(one) == []
    agg = table.aggregate(one, ["rollout/reward_mean"])
    assert agg["n"].tolist() == [1] and agg["mean"].item() == pytest.approx(0.35 + 0.05)
    nested = tmp_path / "sweeps"
    for name, precision in (("a", "bf16"), ("b", "fp16")):
        train_run(nested / name / "0", precision, "tis", 0)
    both = table.load_runs(nested)
    assert list(both["run"]) == ["a/0", "b/0"] and table.varying_axes(both) == ["precision"]
    assert list(table.load_runs(str(sweep / "1*"))["run"]) == ["1", "10", "11", "12", "13", "14"]
    assert len(table.load_runs([sweep / "0", sweep / "5"])) == 2
    result = rlmm("table", str(sweep / "0"), str(sweep / "6"), "--out", str(tmp_path / "pair"))
    assert result.returncode == 0, result.stderr
    md = (tmp_path / "pair" / "table.md").read_text()  # jobs 0 and 6: bf16 and fp16, both tis, seed 0
    assert "| bf16 | 1 ok | 0.4500 (n=1) | 0.5000 (n=1) |" in md and "| fp16 | 1 ok | 0.2500 (n=1) |" in md


def test_configuration_without_a_complete_run_gets_dashes(tmp_path):
    train_run(tmp_path / "s" / "0", "bf16", "tis", 0, last_step=2, finish=False)
    train_run(tmp_path / "s" / "1", "fp16", "tis", 0)
    runs = table.read_runs(tmp_path / "s")
    text, written = table.write_outputs(runs, table.load_runs(runs), ["rollout/reward_mean"], tmp_path / "out")
    assert "| bf16 | 0 ok, 1 incomplete | — |" in text and "| fp16 | 1 ok | 0.3000 (n=1) |" in text
    assert [p.name for p in written] == ["table.md", "table.csv", "table.tex", "curves.png", "bars.png"]


def probe_record(precision: str, seed: int) -> dict:
    kl = {"bf16": 1e-4, "fp16": 1e-6, "fp32": 1e-12}[precision] * (1 + seed)
    return {"choices": {"precision": precision}, "rollouts": {"num": 64, "mean_reward": 0.5 + 0.1 * seed},
            "sampler_vs_trainer": {"num_tokens": 300, "kl_k3": kl, "logprob_abs_diff_mean": 10 * kl,
                                   "prob_pearson": 1 - kl},
            "trainer_vs_itself": {"micro_batch_sizes": [1, 8], "kl_k3": 0.0},
            "sampler_vs_itself": {"unique_greedy_completions": 1, "batch_sizes": [1, 4]},
            "position_profile": {"kl_k3": [kl, kl]}, "seconds": 20.0}


def test_probe_sweep(tmp_path):
    sweep = tmp_path / "probe-sweep"
    job = 0
    for precision in ("bf16", "fp16", "fp32"):
        for seed in (0, 1):
            write_overrides(sweep / str(job), [f"precision={precision}", f"seed={seed}"])
            (sweep / str(job) / "probe.json").write_text(json.dumps(probe_record(precision, seed)))
            job += 1
    write_overrides(sweep / str(job), ["precision=fp32", "seed=2"])  # died before writing probe.json
    runs = table.load_runs(sweep)
    assert runs["status"].tolist() == ["complete"] * 6 + ["failed"]
    assert runs["kind"].tolist() == ["probe"] * 6 + [""]
    assert table.default_metrics(runs) == ["mismatch/kl_k3", "mismatch/logprob_abs_diff_mean", "mismatch/prob_pearson"]
    assert runs["sampler_vs_itself/unique_greedy_completions:final"].iloc[0] == 1
    assert runs["rollout/reward_mean:final"].tolist()[:2] == [0.5, 0.6]
    assert "routing/frac_decisions_differ:final" not in runs  # a dense model's probe has no routing part
    agg = table.aggregate(runs, table.default_metrics(runs))
    kl = agg[agg["metric"] == "mismatch/kl_k3"].set_index("precision")
    # seeds 0, 1: kl = K and 2K -> mean 1.5 K, s = K / sqrt(2), ci = 12.7062 * s / sqrt(2) = 6.3531 K
    assert kl.loc["bf16", "mean"] == pytest.approx(1.5e-4)
    assert kl.loc["bf16", "ci95"] == pytest.approx(6.3531e-4, rel=1e-4)
    assert kl.loc["fp32", "n"] == 2 and kl.loc["fp32", "failed"] == 1
    result = rlmm("table", str(sweep))
    assert result.returncode == 0, result.stderr
    assert {p.name for p in (sweep / "table").iterdir()} == {"table.md", "table.csv", "table.tex", "bars.png"}
    md = (sweep / "table" / "table.md").read_text()
    assert "| fp32 | 2 ok, 1 failed | 1.500e-12 ± " in md and "mismatch/prob_pearson (final)" in md


def test_an_moe_probes_routing_part_reads_under_the_names_train_logs(tmp_path):
    record = probe_record("bf16", 0) | {"routing": {
        "disagreement": {"frac_decisions_differ": 0.02, "frac_tokens_differ": 0.1, "differing_decisions": 7},
        "own": {"kl_k3": 2e-4}, "replayed": {"kl_k3": 1e-4}, "share_removed": {"kl_k3": 0.5}, "bytes_per_token": 16}}
    write_overrides(tmp_path / "0", ["routing=r3"])
    (tmp_path / "0" / "probe.json").write_text(json.dumps(record))
    run = table.load_runs(tmp_path).iloc[0]
    assert run["routing/frac_decisions_differ:final"] == 0.02 and run["routing/differing_decisions:final"] == 7
    assert (run["routing/own/kl_k3:final"], run["routing/replayed/kl_k3:final"],
            run["routing/share_removed/kl_k3:final"]) == (2e-4, 1e-4, 0.5)


def one_line_error(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("rlmm: error: "), result.stderr
    return lines[0]


def test_cli_bad_input_is_one_line(sweep, tmp_path):
    assert "no such file or directory: /no/such/sweep" in one_line_error(rlmm("table", "/no/such/sweep"))
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    assert f"no runs in {tmp_path / 'empty'}" in one_line_error(rlmm("table", str(tmp_path / "empty")))
    for job in ("0", "1"):  # a sweep whose jobs all died before recording anything
        write_overrides(tmp_path / "dead" / job, [f"seed={job}"])
    assert "no run recorded a metric (2 failed)" in one_line_error(rlmm("table", str(tmp_path / "dead")))
    line = one_line_error(rlmm("table", str(sweep), "--metric", "eval/acc", "--out", str(tmp_path / "o")))
    assert "unknown metric 'eval/acc' (available: eval/accuracy, rollout/reward_mean, mismatch/kl_k3, loss/loss," \
        in line
    assert "summary/seconds" in line and not (tmp_path / "o").exists()
    line = one_line_error(rlmm("table", str(sweep), "--metric", "eval/accuracy:max"))
    assert "bad metric 'eval/accuracy:max' (expected NAME[:final|best|mean])" in line
    assert "the following arguments are required: SOURCE" in one_line_error(rlmm("table"))
    assert "unrecognized arguments: --bogus" in one_line_error(rlmm("table", str(sweep), "--bogus"))


def test_an_out_that_is_not_a_directory_is_one_line(sweep, tmp_path):
    """--out naming a file (or SWEEP/table one): a FileExistsError traceback (issue 50, case 9's kind)."""
    file = tmp_path / "file"
    file.write_text("a file")
    for out in (file, file / "below"):
        line = one_line_error(rlmm("table", str(sweep), "--out", str(out)))
        assert line == f"rlmm: error: --out: {out} is not a directory: {file} is a file (give --out a directory)", line


def test_wandb_source_is_parsed():
    assert table.parse_wandb_source("wandb:me/rlmm") == ("me", "rlmm", None)
    assert table.parse_wandb_source("wandb:me/rlmm/multirun_2026") == ("me", "rlmm", "multirun_2026")
    with pytest.raises(table.TableError, match="expected wandb:ENTITY/PROJECT"):
        table.parse_wandb_source("wandb:me")


def test_wandb_without_key_or_server_is_one_line(tmp_path):
    home = str(tmp_path)  # no ~/.netrc, no wandb settings
    line = one_line_error(rlmm("table", "wandb:me/rlmm/sweep", HOME=home))
    assert line.startswith("rlmm: error: W&B wandb:me/rlmm/sweep: ") and "API key" in line
    line = one_line_error(rlmm("table", "wandb:me/rlmm", HOME=home, WANDB_API_KEY="x" * 40,
                               WANDB_BASE_URL="http://127.0.0.1:9", WANDB_HTTP_TIMEOUT="3"))
    assert line.startswith("rlmm: error: W&B wandb:me/rlmm: ")
    assert "bad W&B source 'wandb:rlmm'" in one_line_error(rlmm("table", "wandb:rlmm"))


def test_wandb_server_that_never_answers_is_one_line_not_a_hang(tmp_path):
    """wandb-core keeps retrying a request that timed out, and W&B's exit hook used to wait for it
    with no limit: the error was printed, then the process hung for minutes."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)  # connections complete in the backlog; nothing ever answers
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        line = one_line_error(rlmm("table", "wandb:me/rlmm", HOME=str(tmp_path), WANDB_API_KEY="x" * 40,
                                   WANDB_BASE_URL=url, WANDB_HTTP_TIMEOUT="3"))
    assert line.startswith("rlmm: error: W&B wandb:me/rlmm: ") and url in line  # rlmm() times out a hang


class FakeWandbRun:
    """The attributes of wandb.apis.public.Run that the reader uses."""

    def __init__(self, run_id, config, history, summary, state):
        self.id, self.config, self._history, self.summary_metrics, self.state = run_id, config, history, summary, state

    def scan_history(self):
        return iter(self._history)


def test_wandb_runs_take_the_local_shape():
    config = {"choices": {"precision": "bf16", "correction": "tis"}, "seed": 1, "train": {"steps": 2},
              "precision": {"sampler_dtype": "bf16"}}
    history = [{"_step": 0, "_runtime": 3.0, "eval/accuracy": 0.1},
               {"_step": 1, "rollout/reward_mean": 0.2, "mismatch/kl_k3": 2e-4},
               {"_step": 2, "rollout/reward_mean": 0.4, "mismatch/kl_k3": 1e-4, "eval/accuracy": 0.3}]
    summary = {"_wandb": {"runtime": 5}, "eval_accuracy_end": 0.3, "rollout/reward_mean": 0.4, "choices": {}}
    finished = table._wandb_run(FakeWandbRun("abc", config, history, summary, "finished"), "wandb:me/p")
    assert (finished.status, finished.steps, finished.kind, finished.path) == ("complete", 2, "train", "wandb:me/p/abc")
    assert finished.overrides == {"precision": "bf16", "correction": "tis", "seed": "1", "train.steps": "2"}
    assert finished.values == {"summary/eval_accuracy_end": 0.3}
    crashed = table._wandb_run(FakeWandbRun("def", config, history[:2], {}, "crashed"), "wandb:me/p")
    assert (crashed.status, crashed.note) == ("failed", "W&B state crashed")
    running = table._wandb_run(FakeWandbRun("ghi", config, history[:2], {}, "running"), "wandb:me/p")
    assert running.status == "incomplete"
    probe = table._wandb_run(FakeWandbRun("jkl", config, [], {"mismatch/kl_k3": 1e-5}, "finished"), "wandb:me/p")
    assert (probe.status, probe.kind, probe.values) == ("complete", "probe", {"mismatch/kl_k3": 1e-5})
    runs = table.load_runs([finished, crashed, running, probe])
    assert runs.loc[0, "rollout/reward_mean:final"] == 0.4 and runs.loc[0, "mismatch/kl_k3:best"] == 1e-4
    assert runs.loc[0, "eval/accuracy:mean"] == pytest.approx(0.2)


def test_rlmm_command_lists_table():
    assert "unknown command 'tabel' (allowed: train, probe, table, prefetch)" in one_line_error(rlmm("tabel"))
    result = rlmm("--help")
    assert result.returncode == 0 and "rlmm table SWEEP_DIR" in result.stdout


def test_a_torn_line_is_a_warning_naming_the_run_and_the_step_and_its_cells_are_marked(tmp_path):
    """A complete run whose steps.jsonl has a torn line after step 3 (as a write cut by a full disk or a kill
    leaves): `rlmm table` warns naming the run and the step, and the cells it counts in are marked with the step
    its values stop at (it once showed as ok, its "final" value silently step 3's)."""
    train_run(tmp_path / "s" / "0", "bf16", "tis", 0)
    train_run(tmp_path / "s" / "1", "fp16", "tis", 0)
    steps = tmp_path / "s" / "1" / "steps.jsonl"
    lines = steps.read_text().splitlines()
    steps.write_text("\n".join([*lines[:4], lines[4][:20], *lines[5:]]) + "\n")  # step 4's row torn
    result = rlmm("table", str(tmp_path / "s"), "--out", str(tmp_path / "t"), "--metric", "rollout/reward_mean")
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == ("rlmm table: warning: 1: line 5 of steps.jsonl (after step 3) is torn or not JSON, "
                                     "it and the 1 line after it skipped; its final values are those of step 3")
    md = (tmp_path / "t" / "table.md").read_text()
    assert f"| fp16 | 1 ok | {format_number(BASE['fp16', 'tis'] + 0.03)} (n=1) † |" in md
    assert f"| bf16 | 1 ok | {format_number(BASE['bf16', 'tis'] + 0.05)} (n=1) |" in md
    assert ("† 1: line 5 of steps.jsonl (after step 3) is torn or not JSON, it and the 1 line after it skipped; its "
            "values are those up to step 3.") in md


def test_a_record_short_of_its_summary_a_repeated_row_and_a_probe_among_training_runs_are_not_counted_as_whole(
        tmp_path):
    """Issue 50, case 7: a run that "finished" with a record of one step (its steps.jsonl deleted before the
    resume) was counted ok; a row written twice counted twice in the mean; a probe among training runs became a
    row of the training table."""
    train_run(tmp_path / "s" / "0", "bf16", "tis", 0)
    train_run(tmp_path / "s" / "1", "bf16", "tis", 1)
    short = tmp_path / "s" / "1" / "steps.jsonl"
    short.write_text("".join(short.read_text().splitlines(keepends=True)[:2]))  # steps 0-1 of 5, summary.json there
    train_run(tmp_path / "s" / "2", "fp16", "tis", 0)
    twice = tmp_path / "s" / "2" / "steps.jsonl"
    lines = twice.read_text().splitlines(keepends=True)
    twice.write_text("".join([*lines[:3], lines[2], *lines[3:]]))  # step 2's row twice
    runs = {run.name: run for run in table.read_runs(tmp_path / "s")}
    assert (runs["1"].status, runs["1"].note) == ("incomplete", "its record ends at step 1 of 5 (summary.json)")
    assert runs["2"].damage == "line 4 of steps.jsonl (after step 2) repeats step 2, it and the 3 lines after it skipped"
    assert [row["step"] for row in runs["2"].history] == [0, 1, 2]
    probe = tmp_path / "s" / "3"
    probe.mkdir()
    (probe / "probe.json").write_text(json.dumps({"sampler_vs_trainer": {"kl_k3": 1e-5}}))
    with pytest.raises(table.TableError, match=r"^the sources hold 3 training runs and 1 probe \(3\): a table compares "
                                               r"one kind; give each its own rlmm table$"):
        table.read_runs(tmp_path / "s")


def test_train_and_table_agree_that_a_truncated_summary_is_no_finished_run(tmp_path):
    from rlmm.run.resume import check_train_dir

    train_run(tmp_path / "run", "bf16", "tis", 0)
    (tmp_path / "run" / "summary.json").write_text('{"steps": 5, "rew')
    assert table.read_runs(tmp_path / "run")[0].status == "incomplete"
    # not "nothing to do": the run resumes and writes its summary again
    config = {"choices": {"precision": "bf16", "correction": "tis"}, "seed": 0}
    check_train_dir(tmp_path / "run", config, world=1, resume=True)
