"""What `rlmm train` leaves when every step is done, read back from the run's record (so a resumed run reports
every step, the ones before its resume too): the summary (summary.json, the logger's), its printout, and
`training.png`."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlmm.run.records import read_steps
from rlmm.runtime.disk import writing
from rlmm.runtime.errors import MachineFault
from rlmm.runtime.formatting import format_number


@dataclass(frozen=True)
class TrainingHistory:
    """A run's record as the summary and the plots read it: the step rows after step 0 (and with it), and the
    greedy accuracies by step (step 0's included) of the deployed sampler and of the trained weights."""

    steps: list[dict]
    accuracy: dict[int, float]
    trained_accuracy: dict[int, float]
    steps_with_step_0: list[dict]
    path: Path | None = None  # the steps.jsonl read

    @classmethod
    def read(cls, run_dir: Path) -> TrainingHistory:
        rows = read_steps(run_dir)
        return cls(steps=[row for row in rows if row["step"] > 0], steps_with_step_0=rows,
                   path=Path(run_dir) / "steps.jsonl",
                   accuracy={row["step"]: row["eval/accuracy"] for row in rows
                             if row.get("eval/accuracy") is not None},
                   trained_accuracy={row["step"]: row["eval/accuracy_trained"] for row in rows
                                     if row.get("eval/accuracy_trained") is not None})


def summarize(record: TrainingHistory, choices: dict, precision_report: dict, options, world: int, seconds: float,
              first_step: int) -> dict:
    """The run's headline figures, from its record (so a resumed run summarises every step), which must hold every
    step the run logged (MachineFault when it does not: the record was removed or changed under the run)."""
    history, accuracy, trained_accuracy = record.steps, record.accuracy, record.trained_accuracy
    logged = [row["step"] for row in record.steps_with_step_0]
    if logged != list(range(options.steps + 1)):
        held = f"steps 0-{logged[-1]}" if logged else "no step"
        raise MachineFault(f"{record.path} holds {held}, not every step to {options.steps} this run logged (its run "
                           f"directory removed or changed while it ran?)")

    def mean(key: str) -> float:
        values = [h[key] for h in history if h.get(key) is not None]
        return sum(values) / len(values) if values else float("nan")

    step_seconds = sorted(sum(v for k, v in h.items() if k.startswith("perf/") and k.endswith("_seconds") and v)
                          for h in history)
    return {
        "choices": choices, "precision": precision_report, "steps": options.steps, "ranks": world,
        "resumed_at_step": first_step if first_step > 1 else None,
        "eval_accuracy_start": accuracy.get(0, float("nan")), "eval_accuracy_end": accuracy[options.steps],
        "eval_accuracy_best": max(accuracy.values()),
        # the trainer's unperturbed weights (train.eval_trained_weights)
        "eval_accuracy_trained_start": trained_accuracy.get(0, float("nan")),
        "eval_accuracy_trained_end": trained_accuracy.get(options.steps, float("nan")),
        "reward_first": history[0]["rollout/reward_mean"], "reward_last": history[-1]["rollout/reward_mean"],
        "bad_steps": sum(bool(h.get("train/skipped")) for h in history),
        "mismatch_kl_k3_mean": mean("mismatch/kl_k3"),
        "mismatch_logprob_abs_diff_mean": mean("mismatch/logprob_abs_diff_mean"),
        "seconds": seconds,
        "step_seconds_median": step_seconds[len(step_seconds) // 2],
    }


def print_summary(summary: dict) -> None:
    """The summary's headline figures as a table on the terminal."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="rlmm train: " + " ".join(f"{k}={v}" for k, v in summary["choices"].items()),
                  title_justify="left")
    table.add_column("")
    table.add_column("value", justify="right")
    for key in ("eval_accuracy_start", "eval_accuracy_end", "eval_accuracy_best", "eval_accuracy_trained_start",
                "eval_accuracy_trained_end", "reward_first", "reward_last",
                "mismatch_logprob_abs_diff_mean", "mismatch_kl_k3_mean", "step_seconds_median", "seconds"):
        value = summary[key]
        table.add_row(key, format_number(value))
    Console().print(table)


def plot_training(record: TrainingHistory, path: Path, choices: dict) -> None:
    """`training.png`: reward and greedy accuracies, the mismatch (log scale), the correction and clipping."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history, accuracy, trained_accuracy = record.steps, record.accuracy, record.trained_accuracy
    steps = [h["step"] for h in history]

    def series(key: str) -> list[float]:  # a skipped step has no loss/*; the record stores NaN as null
        return [float("nan") if h.get(key) is None else h[key] for h in history]

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(steps, series("rollout/reward_mean"), label="rollout reward")
    axes[0].plot(list(accuracy), list(accuracy.values()), marker="o", label="greedy eval: sampler (deployed)")
    if trained_accuracy:
        axes[0].plot(list(trained_accuracy), list(trained_accuracy.values()), marker="x", linestyle="--",
                     label="greedy eval: trainer's weights")
    axes[0].set_title("reward")
    axes[0].legend()
    axes[1].plot(steps, series("mismatch/logprob_abs_diff_mean"), label="mean |δ|")
    axes[1].plot(steps, series("mismatch/kl_k3"), label="KL k3")
    axes[1].set_yscale("log")
    axes[1].set_title("sampler vs trainer mismatch")
    axes[1].legend()
    axes[2].plot(steps, series("correction/weight_mean"), label="mean IS weight")
    axes[2].plot(steps, series("loss/clipfrac"), label="clip fraction")
    axes[2].set_title("correction and clipping")
    axes[2].legend()
    save_over_steps(fig, axes, path, choices)


def plot_attribution_over_training(record: TrainingHistory, path: Path, choices: dict) -> None:
    """attribution.png of a run with `train.attribution.every`: per op class the share of the KL k3 gap raising it
    alone removes, over the steps measured; the gap it is a share of beside the run's sampler-vs-trainer
    mismatch; and the weight and logit statistics beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [h for h in record.steps_with_step_0 if h.get("attribution/all_low/kl_k3") is not None]
    steps = [h["step"] for h in rows]
    ops = sorted({k.split("/")[1] for h in rows for k in h if k.startswith("attribution/") and "/share_" in k})
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    for op in ops:
        axes[0].plot(steps, [h.get(f"attribution/{op}/share_raised/kl_k3") for h in rows], marker="o", label=op)
    axes[0].axhline(0, color="0.3", linewidth=0.8)
    axes[0].set_title("share of the KL k3 gap raising each op to fp32 alone removes")
    axes[0].legend(fontsize=7, ncol=2)
    axes[1].plot(steps, [h["attribution/all_low/kl_k3"] for h in rows], marker="o",
                 label="every op low vs fp32 (the attributed gap)")
    trained = [h for h in record.steps if h.get("mismatch/kl_k3") is not None]
    axes[1].plot([h["step"] for h in trained], [h["mismatch/kl_k3"] for h in trained], alpha=0.6,
                 label="sampler vs trainer (the run's)")
    axes[1].set_yscale("log")
    axes[1].set_title("KL k3")
    axes[1].legend(fontsize=8)
    for key, label in (("logits/attention_max", "largest attention score"),
                       ("logits/lm_head_range_max", "largest LM-head logit range")):
        axes[2].plot(steps, [h.get(key) for h in rows], marker="o", label=label)
    layers = sorted({k for h in rows for k in h if k.startswith("weights/layer_") and k.endswith("/max_abs")})
    for key in layers:
        axes[2].plot(steps, [h.get(key) for h in rows], linestyle="--", label=key.removeprefix("weights/"))
    axes[2].set_yscale("log")
    axes[2].set_title("weight and logit statistics")
    axes[2].legend(fontsize=7)
    save_over_steps(fig, axes, path, choices)


def save_over_steps(fig, axes, path: Path, choices: dict) -> None:
    """Write a figure of panels over the steps: each panel's x axis named, the run's choices as the title."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.set_xlabel("step")
    import textwrap

    # wrapped: a run's dozen choices are wider than the figure on one line
    fig.suptitle(textwrap.fill(" ".join(f"{k}={v}" for k, v in choices.items()), 160), fontsize=9)
    fig.tight_layout()
    with writing(path):
        fig.savefig(path, dpi=110)
    plt.close(fig)
