"""The collapse_warning experiment's table and plot, from its sweep directories (each job's steps.jsonl,
written with `train.monitor.enabled=true action=none`, so the monitor's scores are in the record).

    .venv/bin/python experiments/collapse_warning/analyze.py multirun/experiments/collapse_warning/<date>_<time>

Collapse (operational, written down in README.md): the first step t at which the rollout reward is below
FRACTION of its running maximum (over steps 1..t) and stays below it for RUN steps in a row (t, t+1, ...).
Alarm: the first step with `monitor/alarm` = 1, over every watched signal, and for the mismatch signals
alone. Lead time = collapse step - alarm step (> 0: the alarm came first).
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from omegaconf import OmegaConf

FRACTION, RUN = 0.5, 3
HERE = Path(__file__).resolve().parent


def collapse_step(rewards: list[tuple[int, float]]) -> int | None:
    best, below = float("-inf"), []
    for step, reward in rewards:
        best = max(best, reward)
        below = below + [step] if reward < FRACTION * best else []
        if len(below) == RUN:
            return below[0]
    return None


def first(rows: list[dict], keys: list[str], threshold: float) -> tuple[int, str] | tuple[None, None]:
    for row in rows:
        for key in keys:
            if (row.get(key) or 0) > threshold:
                return row["step"], key.removeprefix("monitor/").removesuffix("_score")
    return None, None


def runs(sweeps: list[str]) -> list[dict]:
    found = []
    for sweep in sweeps:
        for job in sorted(Path(sweep).glob("*/steps.jsonl"), key=lambda p: int(p.parent.name)):
            if not (job.parent / "summary.json").exists():  # still running, or failed
                continue
            cfg = OmegaConf.load(job.parent / "config.yaml")
            overrides = OmegaConf.load(job.parent / ".hydra" / "overrides.yaml")
            rows = [json.loads(line) for line in job.read_text().splitlines()]
            rows = [r for r in rows if r["step"] > 0]
            threshold = cfg.train.monitor.threshold
            scores = sorted(k for k in rows[0] if k.startswith("monitor/") and k.endswith("_score"))
            mismatch = [k for k in scores if "reward" not in k]
            alarm, signal = first(rows, scores, threshold)
            mismatch_alarm, mismatch_signal = first(rows, mismatch, threshold)
            collapse = collapse_step([(r["step"], r["rollout/reward_mean"]) for r in rows])
            lr = cfg.trainer.lr
            found.append({"arm": f"lr {lr:g} ({'collapsing' if lr > 1e-4 else 'healthy'})",
                          "seed": cfg.seed, "steps": rows[-1]["step"], "rows": rows, "threshold": threshold,
                          "alarm": alarm, "signal": signal, "mismatch_alarm": mismatch_alarm,
                          "mismatch_signal": mismatch_signal, "collapse": collapse, "scores": scores,
                          "overrides": overrides, "monitor": cfg.train.monitor})
    return found


def lead(collapse: int | None, alarm: int | None) -> str:
    return "" if collapse is None or alarm is None else f"{collapse - alarm:+d}"


def cell(step: int | None, signal: str | None) -> str:
    return "—" if step is None else f"{step} ({signal})"


def table(found: list[dict]) -> str:
    lines = ["| arm | seed | collapse step | first alarm (signal) | lead | first mismatch alarm (signal) | lead |",
             "|---|---|---|---|---|---|---|"]
    for r in found:
        lines.append(f"| {r['arm']} | {r['seed']} | {r['collapse'] or '—'} | {cell(r['alarm'], r['signal'])} | "
                     f"{lead(r['collapse'], r['alarm'])} | {cell(r['mismatch_alarm'], r['mismatch_signal'])} | "
                     f"{lead(r['collapse'], r['mismatch_alarm'])} |")
    return "\n".join(lines)


def summary(found: list[dict]) -> str:
    out = []
    for arm in sorted({r["arm"] for r in found}):
        rs = [r for r in found if r["arm"] == arm]
        collapsed = [r for r in rs if r["collapse"]]
        out.append(f"- **{arm}** (n={len(rs)}): collapsed {len(collapsed)}/{len(rs)}; "
                   f"any alarm {sum(bool(r['alarm']) for r in rs)}/{len(rs)}; "
                   f"mismatch alarm {sum(bool(r['mismatch_alarm']) for r in rs)}/{len(rs)}")
        for key, name in (("alarm", "any signal"), ("mismatch_alarm", "mismatch signals only")):
            leads = [r["collapse"] - r[key] for r in collapsed if r[key]]
            missed = sum(1 for r in collapsed if not r[key] or r[key] > r["collapse"])
            if collapsed:
                out.append(f"  - {name}: lead times {sorted(leads)} (median {statistics.median(leads) if leads else '—'}); "
                           f"collapses without an alarm at or before them: {missed}/{len(collapsed)}")
        healthy = [r for r in rs if not r["collapse"]]
        if healthy:
            out.append(f"  - runs that did not collapse within the run: {len(healthy)}, with an alarm: "
                       f"{sum(bool(r['alarm']) for r in healthy)} (any signal), "
                       f"{sum(bool(r['mismatch_alarm']) for r in healthy)} (mismatch signals)")
    return "\n".join(out)


def replay(rows: list[dict], monitor, threshold: float, which: str) -> int | None:
    """The first alarm step the run's monitor would have raised at another threshold: the detector is a
    function of the logged metric series, so it can be rerun on the record."""
    from rlmm.run.monitor import CUSUM

    signals = {**{n: "up" for n in monitor.rising}, **{n: "down" for n in monitor.falling}}
    detectors = {n: CUSUM(d, monitor.warmup_steps, monitor.drift, threshold, monitor.clip)
                 for n, d in signals.items() if which == "all" or n.startswith(which.split()[0] + "/")}
    for row in rows:
        for name, detector in detectors.items():
            detector.update(float("nan") if row.get(name) is None else row[name])
        if any(d.alarm for d in detectors.values()):
            return row["step"]
    return None


def sensitivity(found: list[dict], thresholds=(4.0, 8.0, 12.0, 16.0, 24.0)) -> str:
    lines = ["| threshold h | signals | collapses warned at or before them (lead times) | healthy runs with an alarm |",
             "|---|---|---|---|"]
    for h in thresholds:
        for which in ("all", "mismatch only", "rollout only"):
            warned, leads, false = 0, [], 0
            collapsed = [r for r in found if r["collapse"]]
            for r in found:
                alarm = replay(r["rows"], r["monitor"], h, which)
                if r["collapse"]:
                    if alarm is not None and alarm <= r["collapse"]:
                        warned += 1
                    leads.append(r["collapse"] - alarm if alarm is not None else None)
                else:
                    false += alarm is not None
            healthy = len(found) - len(collapsed)
            false = sum(replay(r["rows"], r["monitor"], h, which) is not None
                        for r in found if not r["collapse"] and "healthy" in r["arm"])
            healthy = sum(1 for r in found if not r["collapse"] and "healthy" in r["arm"])
            shown = ", ".join("none" if x is None else f"{x:+d}" for x in leads)
            lines.append(f"| {h:g} | {which.replace('rollout', 'reward')} | {warned}/{len(collapsed)} "
                         f"({shown}) | {false}/{healthy} |")
    return "\n".join(lines)


def plot(found: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = sorted({r["arm"] for r in found})
    fig, axes = plt.subplots(2, len(arms), figsize=(6.5 * len(arms), 7), sharex=True, squeeze=False)
    for col, arm in enumerate(arms):
        rs = [r for r in found if r["arm"] == arm]
        for i, r in enumerate(rs):
            color = f"C{i}"
            steps = [row["step"] for row in r["rows"]]
            axes[0][col].plot(steps, [row["rollout/reward_mean"] for row in r["rows"]], color=color,
                              label=f"seed {r['seed']}")
            for key in r["scores"]:
                style = "--" if "reward" in key else "-"
                axes[1][col].plot(steps, [row.get(key) or 0 for row in r["rows"]], style, color=color, alpha=0.6,
                                  lw=1)
            for ax in (axes[0][col], axes[1][col]):
                if r["alarm"]:
                    ax.axvline(r["alarm"], color=color, ls=":", lw=1)
                if r["collapse"]:
                    ax.axvline(r["collapse"], color=color, ls="-", lw=2, alpha=0.4)
        axes[1][col].axhline(rs[0]["threshold"], color="k", lw=1)
        axes[0][col].set_title(f"{arm}: rollout reward (thick line: collapse; dotted: first alarm)", fontsize=9)
        axes[1][col].set_title("monitor scores (solid: mismatch signals, dashed: reward; black: threshold)",
                               fontsize=9)
        axes[1][col].set_yscale("symlog", linthresh=1)
        axes[1][col].set_ylim(bottom=0)
        axes[1][col].set_xlabel("step")
        axes[0][col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(sweeps: list[str]) -> None:
    found = runs(sweeps)
    text = table(found) + "\n\n" + summary(found) + "\n\nThe same records, the detector rerun at other thresholds:\n\n" + sensitivity(found) + "\n"
    print(text)
    (HERE / "table.md").write_text(text)
    plot(found, HERE / "curves.png")


if __name__ == "__main__":
    main(sys.argv[1:])
