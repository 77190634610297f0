"""`rlmm train`: the run around the RL step (rlmm/run/step.py): build the components, resume from the newest
checkpoint, then for each step: this rank's share of the step's rollouts (sampled now, or `train.staleness`
updates ago: rlmm/run/rollout_source.py's delay line) -> `rl_update` -> metrics averaged over ranks -> evaluation
every `eval_every` steps -> the run record and the logger -> a checkpoint every `checkpoint_every` steps or
on a stop signal; at the end a summary, then the shutdown (`shutdown`, which every way out runs: the last
step, a stop, an error), a table and `training.png`.

Several ranks (`torchrun --nproc_per_node N -m rlmm.cli train ...`, or SLURM tasks): every rank holds
a full sampler (an in-process vLLM engine, sharing the ranks' process group; with `train.overlap` one in a process of
its own: rlmm/run/sampler_process.py) and a trainer replica.
Only rank 0 evaluates, logs and writes the record; logged metrics are means over ranks.
Metric namespaces: rollout/, mismatch/, correction/, loss/, perf/, eval/, train/.
"""
from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from rlmm.config.options import to_container
from rlmm.mismatch.attribution import NoTrainingAttribution, TrainingAttribution, check_attribution
from rlmm.run.components import Components, build_components
from rlmm.run.evaluation import Evaluation
from rlmm.run.monitor import build_monitor
from rlmm.run.records import NullRecord, RunRecord
from rlmm.run.rollout_source import DelayLine, Overlapped, prompt_stream
from rlmm.run.sampler_process import SamplerProcess
from rlmm.run.step import rl_update
from rlmm.run.train_report import (TrainingHistory, plot_attribution_over_training, plot_training, print_summary,
                               summarize)
from rlmm.runtime.collectives import mean_over_ranks
from rlmm.runtime.errors import TrainingStopped
from rlmm.runtime.roster import take_roster

log = logging.getLogger(__name__)


def check_options(options: DictConfig) -> None:
    """Every `train.*` count, checked before any engine starts (rlmm/launch/overrides.py checks each combination of a
    sweep with it): a bad one is named as the user wrote it, not as a value derived from it (the number of
    training prompts, steps x prompts_per_step). 0 means never for the `_every` counts and max_bad_steps."""
    for key, least, zero in (("steps", 1, ""), ("prompts_per_step", 1, ""), ("eval_prompts", 1, ""),
                             ("eval_every", 0, " (0: evaluate only at step 0 and the last step)"),
                             ("checkpoint_every", 0, " (0: only on a stop signal)"), ("max_bad_steps", 0, " (0: never stop)"),
                             ("staleness", 0, " (0: each update's rollouts sampled with the weights it updates)"),
                             ("attribution.every", 0, " (0: off)"), ("attribution.prompts", 1, "")):
        value = OmegaConf.select(options, key)
        if value < least:
            raise ValueError(f"train.{key}: must be >= {least}, got {value}{zero}")
    if options.overlap and options.staleness < 1:
        raise ValueError(f"train.overlap=true needs train.staleness >= 1, got {options.staleness} (at 0 each update "
                         f"waits for rollouts of its own weights: nothing to sample while it trains)")
    if options.partial_rollouts and options.staleness < 1:
        raise ValueError(f"train.partial_rollouts=true needs train.staleness >= 1, got {options.staleness} (at 0 no "
                         f"weight sync falls inside a batch's sampling: nothing to continue under new weights)")
    if options.overlap and options.decompose_staleness:
        raise ValueError("train.overlap=true with train.decompose_staleness=true: the overlapped trainer has trained "
                         "past the weights that sampled a batch by the time it arrives, so it cannot score it there "
                         "(run the split with train.overlap=false: the same records)")


def run_train(cfg: DictConfig, run_dir: Path, choices: dict[str, str], logger) -> dict:
    import torch.distributed as dist
    from tqdm.auto import tqdm

    from rlmm.run import checkpoint
    from rlmm.run.logging import NoOpLogger
    from rlmm.run.preemption import StopSignals
    from rlmm.runtime.collectives import any_rank
    from rlmm.runtime.devices import world_size

    started = time.perf_counter()
    options = cfg.train
    check_options(options)
    if options.prompts_per_step % world_size():
        raise ValueError(f"train.prompts_per_step: {options.prompts_per_step} does not split over {world_size()} "
                         "ranks")
    monitor = build_monitor(options.monitor)  # its values checked before anything is built
    if options.attribution.every:
        check_attribution(cfg.precision.sampler_dtype, cfg.precision.trainer_dtype, cfg.trainer,
                          option="train.attribution")
    torch.manual_seed(cfg.seed)
    components = build_components(cfg, lambda task: (task.examples("train", options.steps * options.prompts_per_step)
                                                     + task.examples("test", options.eval_prompts)),
                                  max_rows=max(options.prompts_per_step // world_size() * cfg.algo.group_size,
                                               options.eval_prompts, options.attribution.prompts),
                                  sampler_factory=SamplerProcess if options.overlap else None)
    trainer, sampler = components.trainer, components.sampler
    rank, world = dist.get_rank(), dist.get_world_size()
    take_roster()  # where each rank runs, to name the one that dies (rlmm/launch/apps.py::machine_fault)
    if rank == 0:
        checkpoint.remove_partial(run_dir)  # what a run killed while checkpointing left
    last = checkpoint.to_resume(run_dir) if options.resume else None
    resumed = checkpoint.load(last, trainer, sampler, components.critic, correction=components.correction) \
        if last else {"step": 0}
    first_step = resumed["step"] + 1
    # The loop's own state as a fresh run starts it, then as the checkpoint left it (older ones lack it).
    loop_state = {"bad_steps": 0, "bad_steps_in_a_row": 0, "monitor": {}} | resumed.get("loop", {})
    bad = BadSteps(loop_state["bad_steps"], loop_state["bad_steps_in_a_row"])
    monitor.load_state_dict(loop_state["monitor"], components)
    if last:
        log.info("resuming from %s at step %d", last, first_step)
    # On resume the record drops the steps after the checkpoint: they are about to be redone.
    record = (RunRecord(run_dir, {"choices": choices, **to_container(cfg)}, keep_through_step=first_step - 1)
              if rank == 0 else NullRecord())
    logger = logger if rank == 0 else NoOpLogger()
    train_examples = components.task.examples("train", options.steps * options.prompts_per_step)
    evaluate = Evaluation(components, components.task.examples("test", options.eval_prompts),
                          options.eval_trained_weights, rank)
    attribution = (TrainingAttribution(components, components.task.examples("test", options.attribution.prompts),
                                       options.attribution.every, cfg.precision.sampler_dtype, options.ratio_cap)
                   if options.attribution.every and rank == 0 else NoTrainingAttribution())
    # Each update's rollouts: batch j holds step j's prompts (and DAPO's refills of (seed, j, round)), sampled
    # `train.staleness` updates before the update that trains on it, here or (`train.overlap`) by this rank's
    # sampler process while the trainer trains; those in flight come back from the checkpoint.
    chunk = options.rollout_chunk if options.partial_rollouts else None
    rollouts = (Overlapped(sampler, options.staleness, options.steps, chunk) if options.overlap else
                DelayLine(components, prompt_stream(train_examples, cfg.seed, options.prompts_per_step),
                          options.staleness, options.decompose_staleness, options.steps, chunk=chunk))
    if last:
        rollouts.load_state_dict(resumed["rollouts"], first_step)

    # Signals are recorded from before the first logged row: a SIGTERM that lands between step 0's
    # evaluation and the loop must still end in a checkpoint, not in the default handler. The shutdown runs
    # on the way out of the block however it is left (the last step, a stop, an error), under these handlers.
    handing_over = False  # a stop signal on any rank: every rank checkpoints, shuts down and hands it over
    with StopSignals() as stop, shutdown(record, logger, evaluate, components):
        if first_step == 1:
            accuracies = evaluate() | (attribution() if attribution.due(0) else {})
            record.log(accuracies, step=0)
            logger.log(accuracies, step=0)
        shown_accuracy = float("nan")
        bar = tqdm(range(first_step, options.steps + 1), desc="rlmm train", unit="step", initial=first_step - 1,
                   total=options.steps, disable=None if rank == 0 else True)
        for step in bar:
            metrics = mean_over_ranks(rl_update(components, rollouts.take(step), options.ratio_cap,
                                                options.reuse_training_forward))
            metrics.update(bad.observe(metrics["train/skipped"]))
            if (options.eval_every and step % options.eval_every == 0) or step == options.steps:
                metrics.update(evaluate())
                shown_accuracy = metrics["eval/accuracy"]
            if attribution.due(step):
                metrics.update(attribution())
            metrics.update(monitor.observe(metrics, step, components))  # may switch the correction from here on
            record.log({**metrics, **monitor.record_entry()}, step)
            logger.log(metrics, step=step)
            bar.set_postfix(reward=f"{metrics['rollout/reward_mean']:.3f}", kl_k3=f"{metrics['mismatch/kl_k3']:.1e}",
                            acc=f"{shown_accuracy:.3f}", bad=bad.total)
            stopping = any_rank(stop.requested)
            too_many_bad = options.max_bad_steps and bad.in_a_row >= options.max_bad_steps
            alarmed = monitor.stop_requested  # the same on every rank: it reads metrics averaged over ranks
            if (stopping or too_many_bad or alarmed
                    or (options.checkpoint_every and step % options.checkpoint_every == 0)):
                # Bad steps changed no weights: this checkpoint holds the last good state.
                saved = checkpoint.save(run_dir, step, trainer, sampler, components.critic,
                                        loop=bad.state_dict() | {"monitor": monitor.state_dict()},
                                        rollouts=rollouts.state_dict(), correction=components.correction)
            if too_many_bad:
                raise TrainingStopped(f"{bad.in_a_row} bad steps in a row (train.max_bad_steps="
                                      f"{options.max_bad_steps}) at step {step}; last good state in {saved}")
            if alarmed:
                raise TrainingStopped(monitor.stop_message(saved))
            if stopping:
                log.warning("stop signal %s at step %d: checkpoint in %s", stop.received, step, saved)
                handing_over = True
                break
        else:  # every step done: the summary, from the record (so a resumed run summarises every step)
            history = TrainingHistory.read(run_dir) if rank == 0 else None
            summary = (summarize(history, choices, components.precision_report, options, world,
                                 time.perf_counter() - started, first_step) if rank == 0 else {})
            record.summary(summary)
            logger.summary(summary)
    if handing_over:  # after the shutdown: the signal's previous handler may requeue the job; then it exits
        stop.hand_over()
    if rank == 0:
        plot_training(history, run_dir / "training.png", choices)
        if options.attribution.every:
            plot_attribution_over_training(history, run_dir / "attribution.png", choices)
        print_summary(summary)
    return summary


class BadSteps:
    """Steps whose update was skipped (a non-finite loss or gradient: `train/skipped`), in all and in a row:
    `train.max_bad_steps` in a row stop the run. A bad step changes no weights."""

    def __init__(self, total: int = 0, in_a_row: int = 0):
        self.total, self.in_a_row = total, in_a_row

    def observe(self, skipped: float) -> dict[str, int]:
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        self.total += bool(skipped)
        return {"train/bad_steps": self.total, "train/bad_steps_in_a_row": self.in_a_row}

    def state_dict(self) -> dict[str, int]:
        return {"bad_steps": self.total, "bad_steps_in_a_row": self.in_a_row}


def shutdown(record, logger, evaluation: Evaluation, components: Components) -> ExitStack:
    """The run's one shutdown, as a context that runs it on the way out of its block however the block ends
    (its last step, a stop, an error): the record closed (its rows are on disk), the logger finished, then the
    engines: the evaluation's copy, then the components' (critic, trainer, sampler). Each runs even if one
    before it raised. The process group is not destroyed: it lives as long as the process
    (rlmm/runtime/devices.py's `init_process_group` starts it once, and the next app in the process joins it)."""
    stack = ExitStack()
    for close in (components.close, evaluation.close, logger.finish, record.close):  # run last to first
        stack.callback(close)
    return stack
