"""`rlmm train`: the run around the RL step (rlmm/step.py): build the components, resume from the newest
checkpoint, then for each step: this rank's share of the step's rollouts (sampled now, or `train.staleness`
updates ago: rlmm/rollout_source.py's delay line) -> `rl_update` -> metrics averaged over ranks -> evaluation
every `eval_every` steps -> the run record and the logger -> a checkpoint every `checkpoint_every` steps or
on a stop signal; at the end a summary, then the shutdown (`shutdown`, which every way out runs: the last
step, a stop, an error), a table and `training.png`.

Several ranks (`torchrun --nproc_per_node N -m rlmm.cli train ...`, or SLURM tasks): every rank holds
a full sampler (an in-process vLLM engine, sharing the ranks' process group; with `train.overlap` one in a process of
its own: rlmm/sampler_process.py) and a trainer replica.
Only rank 0 evaluates, logs and writes the record; logged metrics are means over ranks.
Metric namespaces: rollout/, mismatch/, correction/, loss/, perf/, eval/, train/.
"""
from __future__ import annotations

import logging
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from rlmm.collectives import mean_over_ranks
from rlmm.components import Components, build_components
from rlmm.config import CONF_DIR, to_container
from rlmm.disk import writing
from rlmm.errors import TrainingStopped
from rlmm.formatting import format_number
from rlmm.monitor import build_monitor
from rlmm.records import NullRecord, RunRecord, read_steps
from rlmm.samplers.base import Rollouts
from rlmm.rollout_source import DelayLine, Overlapped, prompt_stream
from rlmm.sampler_process import SamplerProcess
from rlmm.step import reward, rl_update

log = logging.getLogger(__name__)


def check_options(options: DictConfig) -> None:
    """Every `train.*` count, checked before any engine starts (rlmm/overrides.py checks each combination of a
    sweep with it): a bad one is named as the user wrote it, not as a value derived from it (the number of
    training prompts, steps x prompts_per_step). 0 means never for the `_every` counts and max_bad_steps."""
    for key, least, zero in (("steps", 1, ""), ("prompts_per_step", 1, ""), ("eval_prompts", 1, ""),
                             ("eval_every", 0, " (0: evaluate only at step 0 and the last step)"),
                             ("checkpoint_every", 0, " (0: only on a stop signal)"), ("max_bad_steps", 0, " (0: never stop)"),
                             ("staleness", 0, " (0: each update's rollouts sampled with the weights it updates)")):
        if options[key] < least:
            raise ValueError(f"train.{key}: must be >= {least}, got {options[key]}{zero}")
    if options.overlap and options.staleness < 1:
        raise ValueError(f"train.overlap=true needs train.staleness >= 1, got {options.staleness} (at 0 each update "
                         f"waits for rollouts of its own weights: nothing to sample while it trains)")
    if options.overlap and options.decompose_staleness:
        raise ValueError("train.overlap=true with train.decompose_staleness=true: the overlapped trainer has trained "
                         "past the weights that sampled a batch by the time it arrives, so it cannot score it there "
                         "(run the split with train.overlap=false: the same records)")


def run_train(cfg: DictConfig, run_dir: Path, choices: dict[str, str], logger) -> dict:
    import torch.distributed as dist
    from tqdm.auto import tqdm

    from rlmm import checkpoint
    from rlmm.logging import NoOpLogger
    from rlmm.devices import world_size
    from rlmm.collectives import any_rank
    from rlmm.preemption import StopSignals

    started = time.perf_counter()
    options = cfg.train
    check_options(options)
    if options.prompts_per_step % world_size():
        raise ValueError(f"train.prompts_per_step: {options.prompts_per_step} does not split over {world_size()} "
                         "ranks")
    monitor = build_monitor(options.monitor)  # its values checked before anything is built
    torch.manual_seed(cfg.seed)
    components = build_components(cfg, lambda task: (task.examples("train", options.steps * options.prompts_per_step)
                                                     + task.examples("test", options.eval_prompts)),
                                  max_rows=max(options.prompts_per_step // world_size() * cfg.algo.group_size,
                                               options.eval_prompts), sampler_factory=SamplerProcess if options.overlap else None)
    trainer, sampler, precision_report = components.trainer, components.sampler, components.precision_report
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        checkpoint.remove_partial(run_dir)  # what a run killed while checkpointing left
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
    # Each update's rollouts: batch j holds step j's prompts (and DAPO's refills of (seed, j, round)), sampled
    # `train.staleness` updates before the update that trains on it, here or (`train.overlap`) by this rank's
    # sampler process while the trainer trains; those in flight come back from the checkpoint.
    rollouts = (Overlapped(sampler, options.staleness, options.steps) if options.overlap else
                DelayLine(components, prompt_stream(train_examples, cfg.seed, options.prompts_per_step),
                          options.staleness, options.decompose_staleness, options.steps))
    if last:
        rollouts.load_state_dict(resumed["rollouts"], first_step)

    # Signals are recorded from before the first logged row: a SIGTERM that lands between step 0's
    # evaluation and the loop must still end in a checkpoint, not in the default handler. The shutdown runs
    # on the way out of the block however it is left (the last step, a stop, an error), under these handlers.
    handing_over = False
    with StopSignals() as stop, shutdown(record, logger, evaluate, components):
        if first_step == 1:
            accuracies = evaluate()
            record.log(accuracies, step=0)
            logger.log(accuracies, step=0)
        bad_in_a_row, bad_total = loop_state["bad_steps_in_a_row"], loop_state["bad_steps"]
        shown_accuracy = float("nan")
        bar = tqdm(range(first_step, options.steps + 1), desc="rlmm train", unit="step", initial=first_step - 1,
                   total=options.steps, disable=None if rank == 0 else True)
        for step in bar:
            metrics = mean_over_ranks(rl_update(components, rollouts.take(step), options.ratio_cap,
                                                options.reuse_training_forward))
            bad_in_a_row = bad_in_a_row + 1 if metrics["train/skipped"] else 0
            bad_total += bool(metrics["train/skipped"])
            metrics.update({"train/bad_steps": bad_total, "train/bad_steps_in_a_row": bad_in_a_row})
            if (options.eval_every and step % options.eval_every == 0) or step == options.steps:
                metrics.update(evaluate())
                shown_accuracy = metrics["eval/accuracy"]
            metrics.update(monitor.observe(metrics, step, components))  # may switch the correction from here on
            record.log({**metrics, **monitor.record_entry()}, step)
            logger.log(metrics, step=step)
            bar.set_postfix(reward=f"{metrics['rollout/reward_mean']:.3f}", kl_k3=f"{metrics['mismatch/kl_k3']:.1e}",
                            acc=f"{shown_accuracy:.3f}", bad=bad_total)
            stopping = any_rank(stop.requested)
            too_many_bad = options.max_bad_steps and bad_in_a_row >= options.max_bad_steps
            alarmed = monitor.stop_requested  # the same on every rank: it reads metrics averaged over ranks
            if (stopping or too_many_bad or alarmed
                    or (options.checkpoint_every and step % options.checkpoint_every == 0)):
                # Bad steps changed no weights: this checkpoint holds the last good state.
                saved = checkpoint.save(run_dir, step, trainer, sampler, components.critic, loop={
                    "bad_steps": bad_total, "bad_steps_in_a_row": bad_in_a_row, "monitor": monitor.state_dict()},
                    rollouts=rollouts.state_dict())
            if too_many_bad:
                raise TrainingStopped(f"{bad_in_a_row} bad steps in a row (train.max_bad_steps="
                                      f"{options.max_bad_steps}) at step {step}; last good state in {saved}")
            if alarmed:
                raise TrainingStopped(monitor.stop_message(saved))
            if stopping:
                log.warning("stop signal %s at step %d: checkpoint in %s", stop.received, step, saved)
                handing_over = True
                break
        else:  # every step done: the summary, from the record (so a resumed run summarises every step)
            rows = read_steps(run_dir) if rank == 0 else []
            history = [row for row in rows if row["step"] > 0]
            accuracy = {row["step"]: row["eval/accuracy"] for row in rows if row.get("eval/accuracy") is not None}
            trained_accuracy = {row["step"]: row["eval/accuracy_trained"] for row in rows
                                if row.get("eval/accuracy_trained") is not None}
            summary = summarize(history, accuracy, trained_accuracy, choices, precision_report, options, world,
                                time.perf_counter() - started, first_step) if rank == 0 else {}
            record.summary(summary)
            logger.summary(summary)
    if handing_over:  # after the shutdown: the signal's previous handler may requeue the job and exit
        stop.hand_over()
    if rank == 0:
        plot_training(history, accuracy, trained_accuracy, run_dir / "training.png", choices)
        print_summary(summary)
    return summary


def shutdown(record, logger, evaluation: Evaluation, components: Components) -> ExitStack:
    """The run's one shutdown, as a context that runs it on the way out of its block however the block ends
    (its last step, a stop, an error): the record closed (its rows are on disk), the logger finished, then the
    engines: the evaluation's copy, then the components' (critic, trainer, sampler). Each runs even if one
    before it raised. The process group is not destroyed: it lives as long as the process
    (rlmm/devices.py's `init_process_group` starts it once, and the next app in the process joins it)."""
    stack = ExitStack()
    for close in (components.close, evaluation.close, logger.finish, record.close):  # run last to first
        stack.callback(close)
    return stack


class Evaluation:
    """Greedy accuracy on held-out prompts, on rank 0, of two policies:

    - `eval/accuracy`: the deployed policy, i.e. the sampler (its kernels and precision, and the noise of
      `sampler.perturb`): what the run's rollouts come from;
    - `eval/accuracy_trained` (with `train.eval_trained_weights`): the trainer's weights as they are, with
      no perturbation, greedy in the trainer side's precision through transformers (`sampler=hf`'s
      `generate`, batch size as its YAML): on the trainer's own module where it holds the full weights and
      generates as a fresh load of the checkpoint would (`trainer.generates_in_place`: one rank of ZeRO-0/1/2
      or FSDP, any rank count of `trainer=torch`; `TrainerModuleEngine`), else on a copy built on rank 0 at
      the first call and loaded with the trainer's weights at each (ZeRO-3, FSDP over several ranks,
      padding-free attention; `TrainedCopyEngine`). Both give the same tokens and log-probs, bit for bit: the
      same weights in the same dtypes (the copy is loaded in `Components.trainer_precision`, fp32 head
      included) through the same kernels
      (tests/test_train.py::test_trained_accuracy_is_the_same_on_the_trainers_module_as_on_a_copy).

    Memory of `eval/accuracy_trained` on rank 0, beyond the generation's own (the KV cache, and the fp32
    logits of every generated position, [prompts, new tokens, vocabulary], twice while they are stacked: 1.2 GB
    for 8 x 128 tokens at a 152k vocabulary; the same on both paths): in place, nothing; the copy, a second
    model in the trainer side's precision for the rest of the run (parameters x 4 bytes in fp32, x 2 in 16
    bits, plus vocabulary x hidden x 4 for an fp32 head: 2.0 GB, or 1.0 + 0.5 GB, at 494M parameters), plus
    what reading sharded weights takes while it loads (`trainer.state_dict()`'s gathers, on every rank).

    A correction that trains better but deploys through a bad sampler shows in the second, not the first.
    Every rank calls it (reading the trainer's weights for the copy is a collective when they are sharded)."""

    def __init__(self, c: Components, examples: list, trained_weights: bool, rank: int):
        self.c, self.examples, self.rank = c, examples, rank
        self.trained = None
        if trained_weights:  # the trainer's own module where it can generate as it is, else a copy
            self.trained = (TrainerModuleEngine if c.trainer.generates_in_place else TrainedCopyEngine)(c)

    def __call__(self) -> dict[str, float]:
        nan = float("nan")
        if self.trained is not None:
            self.trained.sync(self.rank)
        if self.rank != 0:
            return {"eval/accuracy": nan, **({"eval/accuracy_trained": nan} if self.trained is not None else {})}
        accuracies = {"eval/accuracy": accuracy(self.c, self.c.sampler, self.examples)}
        if self.trained is not None:
            accuracies["eval/accuracy_trained"] = accuracy(self.c, self.trained, self.examples)
        return accuracies

    def close(self) -> None:
        if self.trained is not None:
            self.trained.close()
            self.trained = None


class TrainerModuleEngine:
    """Greedy generation with the trainer's own module (`trainer.model`), for a trainer whose module holds the
    full weights and generates as loaded (`trainer.generates_in_place`): no second copy of the model. Only
    rank 0 generates, and with no collective: the module is rank-local.

    Generating leaves training as it was (`generating`): each submodule's train/eval mode and each
    parameter's `requires_grad` come back, gradient checkpointing's flag is not touched, no gradient is made;
    the `OutputHead` returns logits, as it does whenever it is not `aimed_at` (scoring); the KV cache is the
    generate call's own and goes with it
    (tests/test_train.py::test_evaluating_on_the_trainers_module_leaves_training_as_it_was)."""

    def __init__(self, c: Components):
        from rlmm.samplers.hf import HFSampler

        self.trainer = c.trainer
        self.sampler = HFSampler.on_model(c.trainer.model, c.model_path, c.sampling, seed=0,
                                          batch_size=hf_batch_size())

    def sync(self, rank: int) -> None:
        """Nothing to load: the module is the trained weights."""

    def generate(self, prompt_ids: list[list[int]], *, n: int = 1, greedy: bool = False) -> Rollouts:
        with generating(self.trainer.model):
            return self.sampler.generate(prompt_ids, n=n, greedy=greedy)

    def close(self) -> None:
        self.sampler.close()  # drops its reference; the model is the trainer's


@contextmanager
def generating(model: torch.nn.Module):
    """`model` in eval mode, its parameters not requiring grad and autograd off, for the inside; then each
    submodule's train/eval mode and each parameter's `requires_grad` as they were. Gradient checkpointing's
    flag is left on or off: transformers reads it only in train mode (where it would also drop the KV cache).

    Why `requires_grad` too, when autograd is off anyway: torch's matmul lays out a non-contiguous input by
    whether an operand requires grad (aten's `should_fold`: folded into one matrix for a backward that will
    not come), and generate's first step projects such an input (the last position, sliced), so in fp32 the
    first token's log-probs would round differently from the copy's (1e-7 on the default's fp32 trainer).
    It comes back by name, on the parameters registered before and on those registered after: FSDP2 swaps
    in gathered copies for a forward and leaves its root unit's registered after it (resharded after a
    backward), so a flag restored on the sharded parameters alone would leave the embeddings and the head
    frozen in the next step
    (tests/test_train.py::test_evaluating_on_the_trainers_module_leaves_training_as_it_was)."""
    modes = [(module, module.training) for module in model.modules()]
    before = list(model.named_parameters())
    trainable = {name: parameter.requires_grad for name, parameter in before}
    model.eval()
    model.requires_grad_(False)
    try:
        with torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training
        for name, parameter in [*before, *model.named_parameters()]:
            parameter.requires_grad_(trainable[name])


class TrainedCopyEngine:
    """Greedy generation with a copy of the trainer's weights (`sampler=hf`'s class, built here with its YAML's
    batch size, no perturbation, in the trainer side's precision `Components.trainer_precision`), for a trainer
    whose module cannot generate as it is: its weights sharded over ranks (ZeRO-3, FSDP over several ranks) or
    its attention set for packed rows (`padding_free`). The copy is built
    on rank 0 at the first evaluation and loaded at each; every rank reads the weights (a collective when they
    are gathered from shards)."""

    def __init__(self, c: Components):
        self.c, self.sampler = c, None

    def sync(self, rank: int) -> None:
        weights = self.c.trainer.state_dict()
        if rank != 0:
            for _ in weights.values():  # take part in each tensor's gather
                pass
            return
        if self.sampler is None:
            from rlmm.samplers.hf import HFSampler

            self.sampler = HFSampler(self.c.model_path, self.c.trainer_precision, self.c.sampling, seed=0,
                                     batch_size=hf_batch_size(), perturb=0.0, quantization="none")
        self.sampler.load_weights(weights)

    def generate(self, prompt_ids: list[list[int]], *, n: int = 1, greedy: bool = False) -> Rollouts:
        return self.sampler.generate(prompt_ids, n=n, greedy=greedy)

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None


def hf_batch_size() -> int:
    """`sampler=hf`'s own batch size (its YAML, the one place it is written): both engines of
    `eval/accuracy_trained` generate in its batches, so they generate the same batches."""
    return OmegaConf.load(CONF_DIR / "sampler" / "hf.yaml").batch_size


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
    with writing(path):
        fig.savefig(path, dpi=110)
    plt.close(fig)
