"""`rlmm train`: the run around the RL step (rlmm/step.py): build the components, resume from the newest
checkpoint, then for each step: this rank's share of the step's prompts -> `rl_step` -> metrics averaged
over ranks -> evaluation every `eval_every` steps -> the run record and the logger -> a checkpoint every
`checkpoint_every` steps or on a stop signal; at the end a summary, a table and `training.png`.

Several ranks (`torchrun --nproc_per_node N -m rlmm.cli train ...`, or SLURM tasks): every rank holds
a full sampler (an in-process vLLM engine, sharing the ranks' process group) and a trainer replica.
Only rank 0 evaluates, logs and writes the record; logged metrics are means over ranks.
Metric namespaces: rollout/, mismatch/, correction/, loss/, perf/, eval/, train/.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from rlmm.components import Components, build_components
from rlmm.config import to_container
from rlmm.errors import TrainingStopped
from rlmm.formatting import format_number
from rlmm.monitor import build_monitor
from rlmm.records import NullRecord, RunRecord, read_steps
from rlmm.samplers.base import Rollouts
from rlmm.step import mean_over_ranks, rank_share, reward, rl_step

log = logging.getLogger(__name__)


def run_train(cfg: DictConfig, run_dir: Path, choices: dict[str, str], logger) -> dict:
    import torch.distributed as dist
    from tqdm.auto import tqdm

    from rlmm import checkpoint
    from rlmm.logging import NoOpLogger
    from rlmm.devices import world_size
    from rlmm.preemption import StopSignals, any_rank as on_any_rank

    started = time.perf_counter()
    options = cfg.train
    if options.prompts_per_step % world_size():
        raise ValueError(f"train.prompts_per_step: {options.prompts_per_step} does not split over {world_size()} "
                         "ranks")
    monitor = build_monitor(options.monitor)  # its values checked before anything is built
    torch.manual_seed(cfg.seed)
    components = build_components(cfg, lambda task: (task.examples("train", options.steps * options.prompts_per_step)
                                                     + task.examples("test", options.eval_prompts)))
    trainer, sampler, precision_report = components.trainer, components.sampler, components.precision_report
    rank, world = dist.get_rank(), dist.get_world_size()
    last = checkpoint.latest(run_dir) if options.resume else None
    resumed = checkpoint.load(last, trainer, sampler, components.critic) if last else {"step": 0}
    first_step = resumed["step"] + 1
    # The loop's own state as a fresh run starts it, then as the checkpoint left it (older ones lack it).
    loop_state = {"bad_steps": 0, "bad_steps_in_a_row": 0, "monitor": {}} | resumed.get("loop", {})
    monitor.load_state_dict(loop_state["monitor"], components)
    if last:
        log.info("resuming from %s at step %d", last, first_step)
    # On resume the record drops the steps after the checkpoint: they are about to be redone.
    record = (RunRecord(run_dir, {"choices": choices, **to_container(cfg)}, keep_through_step=first_step - 1)
              if rank == 0 else NullRecord())
    logger = logger if rank == 0 else NoOpLogger()
    train_examples = components.task.examples("train", options.steps * options.prompts_per_step)
    eval_examples = components.task.examples("test", options.eval_prompts)

    evaluate = Evaluation(components, eval_examples, options.eval_trained_weights, rank)

    # Signals are recorded from before the first logged row: a SIGTERM that lands between step 0's
    # evaluation and the loop must still end in a checkpoint, not in the default handler.
    with StopSignals() as stop:
        if first_step == 1:
            accuracies = evaluate()
            record.log(accuracies, step=0)
            logger.log(accuracies, step=0)
        bad_in_a_row, bad_total = loop_state["bad_steps_in_a_row"], loop_state["bad_steps"]
        shown_accuracy = float("nan")
        bar = tqdm(range(first_step, options.steps + 1), desc="rlmm train", unit="step", initial=first_step - 1,
                   total=options.steps, disable=None if rank == 0 else True)
        for step in bar:
            step_prompts = train_examples[(step - 1) * options.prompts_per_step: step * options.prompts_per_step]
            def refill(sampling_round: int, step: int = step) -> list:  # DAPO's dynamic sampling
                return rank_share(refill_prompts(train_examples, cfg.seed, step, sampling_round,
                                                 options.prompts_per_step), rank, world)

            metrics = mean_over_ranks(rl_step(components, rank_share(step_prompts, rank, world), options.ratio_cap,
                                              options.reuse_training_forward, refill))
            bad_in_a_row = bad_in_a_row + 1 if metrics["train/skipped"] else 0
            bad_total += bool(metrics["train/skipped"])
            metrics.update({"train/bad_steps": bad_total, "train/bad_steps_in_a_row": bad_in_a_row})
            if step % options.eval_every == 0 or step == options.steps:
                metrics.update(evaluate())
                shown_accuracy = metrics["eval/accuracy"]
            metrics.update(monitor.observe(metrics, step, components))  # may switch the correction from here on
            record.log({**metrics, **monitor.record_entry()}, step)
            logger.log(metrics, step=step)
            bar.set_postfix(reward=f"{metrics['rollout/reward_mean']:.3f}", kl_k3=f"{metrics['mismatch/kl_k3']:.1e}",
                            acc=f"{shown_accuracy:.3f}", bad=bad_total)
            stopping = on_any_rank(stop.requested)
            too_many_bad = options.max_bad_steps and bad_in_a_row >= options.max_bad_steps
            alarmed = monitor.stop_requested  # the same on every rank: it reads metrics averaged over ranks
            if (stopping or too_many_bad or alarmed
                    or (options.checkpoint_every and step % options.checkpoint_every == 0)):
                # Bad steps changed no weights: this checkpoint holds the last good state.
                saved = checkpoint.save(run_dir, step, trainer, sampler, components.critic, loop={
                    "bad_steps": bad_total, "bad_steps_in_a_row": bad_in_a_row, "monitor": monitor.state_dict()})
            if stopping or too_many_bad or alarmed:
                record.close()
                logger.finish()
                evaluate.close()
                components.close()
                if too_many_bad:
                    raise TrainingStopped(f"{bad_in_a_row} bad steps in a row (train.max_bad_steps="
                                          f"{options.max_bad_steps}) at step {step}; last good state in {saved}")
                if alarmed:
                    raise TrainingStopped(monitor.stop_message(saved))
                log.warning("stop signal %s at step %d: checkpoint in %s", stop.received, step, saved)
                stop.hand_over()
    rows = read_steps(run_dir) if rank == 0 else []
    history = [row for row in rows if row["step"] > 0]
    accuracy = {row["step"]: row["eval/accuracy"] for row in rows if row.get("eval/accuracy") is not None}
    trained_accuracy = {row["step"]: row["eval/accuracy_trained"] for row in rows
                        if row.get("eval/accuracy_trained") is not None}
    summary = summarize(history, accuracy, trained_accuracy, choices, precision_report, options, world,
                        time.perf_counter() - started, first_step) if rank == 0 else {}
    record.summary(summary)
    record.close()
    logger.summary(summary)
    evaluate.close()
    components.close()
    if rank == 0:
        plot_training(history, accuracy, trained_accuracy, run_dir / "training.png", choices)
        print_summary(summary)
    return summary


def refill_prompts(pool: list, seed: int, step: int, sampling_round: int, count: int) -> list:
    """`count` prompts drawn from the run's training prompts for a step's refill round (an algorithm that
    drops groups): a function of (seed, step, round) alone, so two arms of one seed that both refill
    draw the same prompts, and a resumed run draws what the uninterrupted one did."""
    import random

    return random.Random(f"{seed}/{step}/{sampling_round}").sample(pool, count)


class Evaluation:
    """Greedy accuracy on held-out prompts, on rank 0, of two policies:

    - `eval/accuracy`: the deployed policy, i.e. the sampler (its kernels and precision, and the noise of
      `sampler.perturb`): what the run's rollouts come from;
    - `eval/accuracy_trained` (with `train.eval_trained_weights`): the trainer's weights as they are, with
      no perturbation, greedy in the trainer side's precision through transformers (`sampler=hf` with
      `perturb: 0`, built on rank 0 at the first call and loaded with the trainer's weights at each).

    A correction that trains better but deploys through a bad sampler shows in the second, not the first.
    Every rank calls it (reading the trainer's weights is a collective when they are sharded)."""

    def __init__(self, c: Components, examples: list, trained_weights: bool, rank: int):
        self.c, self.examples, self.trained_weights, self.rank = c, examples, trained_weights, rank
        self.trained_engine = None

    def __call__(self) -> dict[str, float]:
        nan = float("nan")
        weights = self.c.trainer.state_dict() if self.trained_weights else None
        if self.rank != 0:
            for _ in (weights or {}).values():  # take part in each tensor's gather
                pass
            return {"eval/accuracy": nan, **({"eval/accuracy_trained": nan} if weights is not None else {})}
        accuracies = {"eval/accuracy": accuracy(self.c, self.c.sampler, self.examples)}
        if weights is not None:
            if self.trained_engine is None:
                from rlmm.config import from_yaml

                self.trained_engine = from_yaml("sampler", "hf", model_path=self.c.model_path, perturb=0.0,
                                                precision=self.c.trainer_precision, sampling=self.c.sampling, seed=0)
            self.trained_engine.load_weights(weights)
            accuracies["eval/accuracy_trained"] = accuracy(self.c, self.trained_engine, self.examples)
        return accuracies

    def close(self) -> None:
        if self.trained_engine is not None:
            self.trained_engine.close()
            self.trained_engine = None


def accuracy(c: Components, sampler, examples: list) -> float:
    """Greedy accuracy of `sampler` on `examples` (the task's reward of each greedy response)."""
    rollouts: Rollouts = sampler.generate([c.tokenizer(e.prompt).input_ids for e in examples], greedy=True)
    texts = c.tokenizer.batch_decode(rollouts.response_ids, skip_special_tokens=True)
    return sum(reward(c.task, e, t) for e, t in zip(examples, texts)) / len(examples)


def summarize(history: list[dict], accuracy: dict[int, float], trained_accuracy: dict[int, float], choices: dict, precision_report: dict, options,
              world: int, seconds: float, first_step: int) -> dict:
    """The run's headline figures, from its record (so a resumed run summarises every step)."""
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


def plot_training(history: list[dict], accuracy: dict[int, float], trained_accuracy: dict[int, float], path: Path,
                  choices: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    for ax in axes:
        ax.set_xlabel("step")
    fig.suptitle(" ".join(f"{k}={v}" for k, v in choices.items()), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
