"""`rlmm train`: GRPO with a vLLM (or transformers) sampler and a DeepSpeed (or torch) trainer.

One RL step, top to bottom (`rl_step`):
  sample rollouts -> rewards -> advantages -> trainer log-probs of the rollouts (no grad) -> mismatch
  metrics -> correction (old log-probs, per-token weights, kept tokens) -> epochs x minibatches of
  PPO updates -> weight sync trainer -> sampler -> log.
With one epoch over one minibatch (the default) the no-grad pass is skipped: the update's own
forward scores the rollouts, the correction runs on those log-probs, then the losses are taken
(`train.reuse_training_forward`, `accumulate_gradients(score=...)`).
Every stage is a call on a component Hydra built; the loop never asks which engine, backend or
correction it holds. Metric namespaces: rollout/, mismatch/, correction/, loss/, perf/, eval/.

Several ranks (`torchrun --nproc_per_node N -m rlmm.cli train ...`, or SLURM tasks): every rank holds
a full sampler (an in-process vLLM engine, sharing the ranks' process group) and a DeepSpeed replica.
Each rank samples and scores its own share of the step's prompts (whole GRPO groups, so advantages
need no communication), DeepSpeed averages the gradients, and after the step every rank reloads its
own sampler from its own (ZeRO-3: gathered) weights. Only rank 0 evaluates, logs and writes the record;
logged metrics are means over ranks.

Departures from the papers, on purpose: the old-policy log-probs come from the correction (the
trainer's recomputation for most methods, the sampler's for `bypass`), and with one epoch of one
minibatch the policy that is updated is the one that scored the rollouts, so PPO's ratio starts at 1
and only the correction's weights carry the mismatch.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from rlmm.config import build, to_container
from rlmm.errors import NonFiniteWeights, TrainingStopped
from rlmm.metrics import mismatch_metrics
from rlmm.precision import check_precision
from rlmm.records import NullRecord, RunRecord, read_steps
from rlmm.samplers.base import Rollouts, SamplingOptions
from rlmm.timing import timed

log = logging.getLogger(__name__)


@dataclass
class Components:
    task: object
    tokenizer: object
    sampler: object
    trainer: object
    correction: object
    algo: object
    sampling: SamplingOptions


def build_components(cfg: DictConfig) -> tuple[Components, dict]:
    from transformers import AutoTokenizer

    task = instantiate(cfg.task)
    model_path = instantiate(cfg.model).resolve(task, to_container(cfg.task))
    precision = instantiate(cfg.precision)
    precision.apply()
    sampling = SamplingOptions(**cfg.sampling)
    algo = instantiate(cfg.algo)
    import torch.distributed as dist

    ranks = dist.get_world_size() if dist.is_initialized() else 1
    rows_per_minibatch = cfg.train.prompts_per_step // ranks * algo.group_size // algo.minibatches
    accumulation_steps = math.ceil(rows_per_minibatch / cfg.trainer.micro_batch_size)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = (task.examples("train", cfg.train.steps * cfg.train.prompts_per_step)
               + task.examples("test", cfg.train.eval_prompts))
    sampler = build(cfg.sampler, model_path=model_path, precision=precision.sampler, sampling=sampling, seed=cfg.seed,
                    prompt_tokens=longest_prompt(tokenizer, prompts))
    try:
        trainer = build(cfg.trainer, model_path=model_path, precision=precision.trainer, sampling=sampling,
                        accumulation_steps=accumulation_steps)
    except BaseException:
        sampler.close()  # one engine per process: never leave one behind
        raise
    components = Components(task=task, tokenizer=tokenizer, sampler=sampler, trainer=trainer,
                            correction=instantiate(cfg.correction), algo=algo, sampling=sampling)
    return components, check_precision(precision, sampler.actual_precision, trainer.actual_precision)


def longest_prompt(tokenizer, examples: list) -> int:
    """The longest of the examples' prompts in tokens (sizes the sampler's max_model_len)."""
    return max(len(ids) for ids in tokenizer([e.prompt for e in examples]).input_ids)


def rl_step(c: Components, prompts: list, ratio_cap: float, reuse_training_forward: bool) -> dict[str, float]:
    seconds: dict[str, float] = {}
    algo = c.algo
    with timed(seconds, "generate"):
        prompt_ids = [c.tokenizer(e.prompt).input_ids for e in prompts]
        rollouts = c.sampler.generate(prompt_ids, n=algo.group_size)
        c.sampler.sleep()  # the trainer has the accelerator until the weight sync
    with timed(seconds, "reward"):
        texts = c.tokenizer.batch_decode(rollouts.response_ids, skip_special_tokens=True)
        rewards = torch.tensor([reward(c.task, prompts[i // algo.group_size], t) for i, t in enumerate(texts)])
    sampler_logprobs, mask = rollouts.padded_sampler_logprobs()
    advantages = algo.advantages(rewards)
    old = {}  # π_old as the trainer scores it: the step's fault check, mismatch metrics and correction

    def score_old_policy(train_logprobs: torch.Tensor) -> None:
        old["fault"] = any_rank(first_fault(rewards=rewards, trainer_logprobs=train_logprobs[mask],
                                            sampler_logprobs=sampler_logprobs[mask]))
        old["nonfinite"] = {side: 1 - torch.isfinite(lp[mask]).float().mean().item()
                            for side, lp in (("trainer", train_logprobs), ("sampler", sampler_logprobs))}
        old["mismatch"] = mismatch_metrics(train_logprobs, sampler_logprobs, mask, ratio_cap=ratio_cap)
        old["corrected"] = c.correction(train_logprobs, sampler_logprobs, mask)

    # One epoch over one minibatch updates the very policy that scores the rollouts, so the training
    # forward can give π_old's log-probs (train.reuse_training_forward); otherwise a no-grad pass first.
    single_pass = reuse_training_forward and algo.epochs == 1 and algo.minibatches == 1
    if not single_pass:
        with timed(seconds, "trainer_logprobs"):
            score_old_policy(c.trainer.logprobs(rollouts))

    with timed(seconds, "train"):
        losses = []
        # A fault found by the single pass comes with NaN/Inf in the loss: the trainer skips that step.
        for _ in range(algo.epochs if single_pass or not old["fault"] else 0):
            for rows in minibatch_rows(len(rollouts), algo.minibatches):
                normalizer = []  # of this minibatch, taken once (a collective) at its first micro-batch

                def loss_fn(chunk, logprobs, entropy, rows=rows, normalizer=normalizer):
                    corrected, width = old["corrected"], logprobs.size(1)
                    if not normalizer:
                        normalizer.append(loss_normalizer_over_ranks(algo, corrected.mask[rows],
                                                                     c.sampling.max_new_tokens))
                    return algo.policy_loss(logprobs, corrected.old_logprobs[chunk, :width], advantages[chunk],
                                            corrected.mask[chunk, :width], corrected.weights[chunk, :width],
                                            entropy=entropy, max_length=c.sampling.max_new_tokens,
                                            normalizer=normalizer[0])

                score = score_old_policy if single_pass else None
                losses.append(c.trainer.update(rollouts, rows, loss_fn, score=score))
    fault, mismatch, corrected = old["fault"], old["mismatch"], old["corrected"]
    if fault and fault.startswith("non-finite") and "logprobs" in fault:
        fault += nonfinite_hint(old["nonfinite"], c)
    if not fault and any(m["skipped"] for m in losses):
        fault = "non-finite gradient (optimizer step skipped)"
    with timed(seconds, "weight_sync"):
        if not fault:  # a skipped step left the weights as the sampler has them
            weights = c.trainer.state_dict()
            if not all_finite(list(weights.values())):
                raise NonFiniteWeights("the trainer's weights hold NaN/Inf after the update; they were not sent "
                                       "to the sampler (resume from the last checkpoint with a lower trainer.lr)")
            c.sampler.load_weights(weights)
    if fault:
        log.warning("bad step skipped: %s", fault)

    lengths = mask.sum(1).float()
    return {
        "train/skipped": float(fault is not None),
        **{f"rollout/{k}": v for k, v in {
            "reward_mean": rewards.mean().item(), "response_length_mean": lengths.mean().item(),
            "frac_truncated": rollouts.finish_reasons.count("length") / len(rollouts)}.items()},
        **{f"mismatch/{k}": v for k, v in mismatch.items()},
        **{f"correction/{k}": v for k, v in corrected.metrics.items()},
        **{f"loss/{k}": sum(m[k] for m in losses) / len(losses) for k in (losses[0] if losses else ())},
        **{f"perf/{k}_seconds": v for k, v in seconds.items()},
        "perf/tokens_per_second": lengths.sum().item() / max(sum(seconds.values()), 1e-9),
        **{f"rollout/frac_nonfinite_{side}_logprobs": v for side, v in old["nonfinite"].items()},
    }


def nonfinite_hint(fractions: dict[str, float], c: Components) -> str:
    """Which side's log-probs are non-finite, how many, and the known cause when it is fp16."""
    sides = ", ".join(f"{frac:.1%} of the {side}'s" for side, frac in fractions.items() if frac > 0)
    dtypes = {c.sampler.actual_precision.get("dtype"), c.trainer.actual_precision.get("dtype")}
    known = ("; fp16 activations overflow in some models (Qwen2 is known to): use precision=bf16 or fp32"
             if "fp16" in dtypes else "")
    return f" ({sides}){known}"


def reward(task, example, completion: str) -> float:
    """The task's reward; when the task's function raises, a one-line error naming the prompt."""
    try:
        return float(task.reward(example, completion))
    except Exception as err:
        raise ValueError(f"task.reward raised {type(err).__name__} ({err}) on prompt {example.prompt!r} with "
                         f"completion {completion!r}") from None


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """No NaN/Inf in any tensor. Fast path: one fused 2-norm per tensor (0.8 ms for the built-in model's
    51 tensors, against 7 ms for an element-wise check per tensor: 18% of a default weight sync); a
    non-finite norm (NaN/Inf, or squares past the dtype's range) falls back to the exact element-wise
    check, so huge but finite weights are never called non-finite."""
    if torch.stack(torch._foreach_norm(tensors)).isfinite().all():
        return True
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


def first_fault(**tensors: torch.Tensor) -> str | None:
    """Name the first input holding NaN/Inf, or None when all are finite."""
    for name, tensor in tensors.items():
        if not torch.isfinite(tensor).all():
            return f"non-finite {name.replace('_', ' ')}"
    return None


def any_rank(fault: str | None) -> str | None:
    """A fault seen on any rank is a fault on every rank (they must skip the update together)."""
    from rlmm.preemption import any_rank as flag_on_any_rank

    if flag_on_any_rank(fault is not None):
        return fault or "a fault on another rank"
    return None


def rank_share(prompts: list, rank: int, world: int) -> list:
    """The prompts rank `rank` of `world` samples and trains on: every world-th one from its own index,
    so the ranks' shares are disjoint, cover the step's prompts, and differ in size by at most one."""
    return prompts[rank::world]


def minibatch_rows(num_rows: int, minibatches: int) -> list[list[int]]:
    """Split rollout rows into shuffled minibatches (one minibatch: all rows, in order). The shuffle
    draws from torch's global generator, seeded once per run."""
    if minibatches == 1:
        return [list(range(num_rows))]
    order = torch.randperm(num_rows).tolist()
    size = num_rows // minibatches
    return [order[i * size:(i + 1) * size] for i in range(minibatches)]


def evaluate(c: Components, examples: list) -> float:
    """Greedy accuracy on held-out prompts, with the sampler (the policy as deployed)."""
    rollouts: Rollouts = c.sampler.generate([c.tokenizer(e.prompt).input_ids for e in examples], greedy=True)
    texts = c.tokenizer.batch_decode(rollouts.response_ids, skip_special_tokens=True)
    return sum(reward(c.task, e, t) for e, t in zip(examples, texts)) / len(examples)


def loss_normalizer_over_ranks(algo, mask: torch.Tensor, max_length: int) -> float:
    """The loss divisor of one rank's share of a minibatch, so that the ranks' gradients, averaged by
    the trainer, are the gradient of the whole minibatch's loss: the mean over ranks of each rank's own
    divisor. Token-level: each rank divides by (all ranks' kept tokens) / ranks, not by its own count,
    which would weight a token of a rank with short responses more than one of a rank with long ones."""
    import torch.distributed as dist

    local = algo.loss_normalizer(mask, max_length=max_length)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    total = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def mean_over_ranks(metrics: dict[str, float]) -> dict[str, float]:
    """Average every metric over the ranks (one all-reduce); the identity with one rank."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return metrics
    keys = sorted(metrics)
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(values)
    return dict(zip(keys, (values / dist.get_world_size()).tolist()))


def run_train(cfg: DictConfig, run_dir: Path, choices: dict[str, str], logger) -> dict:
    import torch.distributed as dist
    from tqdm.auto import tqdm

    from rlmm import checkpoint
    from rlmm.logging import NoOpLogger
    from rlmm.preemption import StopSignals, any_rank as on_any_rank
    from rlmm.devices import init_process_group, select_device

    started = time.perf_counter()
    options = cfg.train
    # Before any engine: each rank on its own GPU, and in-process vLLM joins an existing process group
    # instead of making its own.
    select_device()
    init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    if options.prompts_per_step % world:
        raise ValueError(f"train.prompts_per_step: {options.prompts_per_step} does not split over {world} ranks")
    torch.manual_seed(cfg.seed)
    components, precision_report = build_components(cfg)
    trainer, sampler = components.trainer, components.sampler
    last = checkpoint.latest(run_dir) if options.resume else None
    first_step = checkpoint.load(last, trainer, sampler)["step"] + 1 if last else 1
    if last:
        log.info("resuming from %s at step %d", last, first_step)
    # On resume the record drops the steps after the checkpoint: they are about to be redone.
    record = (RunRecord(run_dir, {"choices": choices, **to_container(cfg)}, keep_through_step=first_step - 1)
              if rank == 0 else NullRecord())
    logger = logger if rank == 0 else NoOpLogger()
    train_examples = components.task.examples("train", options.steps * options.prompts_per_step)
    eval_examples = components.task.examples("test", options.eval_prompts)

    def evaluate_on_rank_zero() -> float:
        return evaluate(components, eval_examples) if rank == 0 else float("nan")

    # Signals are recorded from before the first logged row: a SIGTERM that lands between step 0's
    # evaluation and the loop must still end in a checkpoint, not in the default handler.
    with StopSignals() as stop:
        if first_step == 1:
            accuracy = evaluate_on_rank_zero()
            record.log({"eval/accuracy": accuracy}, step=0)
            logger.log({"eval/accuracy": accuracy}, step=0)
        bad_in_a_row, bad_total, shown_accuracy = 0, 0, float("nan")
        bar = tqdm(range(first_step, options.steps + 1), desc="rlmm train", unit="step", initial=first_step - 1,
                   total=options.steps, disable=None if rank == 0 else True)
        for step in bar:
            step_prompts = train_examples[(step - 1) * options.prompts_per_step: step * options.prompts_per_step]
            metrics = mean_over_ranks(rl_step(components, rank_share(step_prompts, rank, world), options.ratio_cap,
                                              options.reuse_training_forward))
            bad_in_a_row = bad_in_a_row + 1 if metrics["train/skipped"] else 0
            bad_total += bool(metrics["train/skipped"])
            metrics.update({"train/bad_steps": bad_total, "train/bad_steps_in_a_row": bad_in_a_row})
            if step % options.eval_every == 0 or step == options.steps:
                metrics["eval/accuracy"] = shown_accuracy = evaluate_on_rank_zero()
            record.log(metrics, step)
            logger.log(metrics, step=step)
            bar.set_postfix(reward=f"{metrics['rollout/reward_mean']:.3f}", kl_k3=f"{metrics['mismatch/kl_k3']:.1e}",
                            acc=f"{shown_accuracy:.3f}", bad=bad_total)
            stopping = on_any_rank(stop.requested)
            too_many_bad = options.max_bad_steps and bad_in_a_row >= options.max_bad_steps
            if stopping or too_many_bad or (options.checkpoint_every and step % options.checkpoint_every == 0):
                # Bad steps changed no weights: this checkpoint holds the last good state.
                saved = checkpoint.save(run_dir, step, trainer, sampler)
            if stopping or too_many_bad:
                record.close()
                logger.finish()
                trainer.close()
                sampler.close()
                if too_many_bad:
                    raise TrainingStopped(f"{bad_in_a_row} bad steps in a row (train.max_bad_steps="
                                          f"{options.max_bad_steps}) at step {step}; last good state in {saved}")
                log.warning("stop signal %s at step %d: checkpoint in %s", stop.received, step, saved)
                stop.hand_over()
    history = [row for row in read_steps(run_dir) if row["step"] > 0] if rank == 0 else []
    accuracy = {row["step"]: row["eval/accuracy"] for row in read_steps(run_dir)
                if row.get("eval/accuracy") is not None}
    summary = summarize(history, accuracy, choices, precision_report, options, world, time.perf_counter() - started,
                        first_step) if rank == 0 else {}
    record.summary(summary)
    record.close()
    logger.summary(summary)
    trainer.close()
    sampler.close()
    if rank == 0:
        plot_training(history, accuracy, run_dir / "training.png", choices)
        print_summary(summary)
    return summary


def summarize(history: list[dict], accuracy: dict[int, float], choices: dict, precision_report: dict, options,
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
    for key in ("eval_accuracy_start", "eval_accuracy_end", "eval_accuracy_best", "reward_first", "reward_last",
                "mismatch_logprob_abs_diff_mean", "mismatch_kl_k3_mean", "step_seconds_median", "seconds"):
        value = summary[key]
        table.add_row(key, f"{value:.3e}" if 0 < abs(value) < 1e-2 else f"{value:.3f}")
    Console().print(table)


def plot_training(history: list[dict], accuracy: dict[int, float], path: Path, choices: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]

    def series(key: str) -> list[float]:  # a skipped step has no loss/*; the record stores NaN as null
        return [float("nan") if h.get(key) is None else h[key] for h in history]

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(steps, series("rollout/reward_mean"), label="rollout reward")
    axes[0].plot(list(accuracy), list(accuracy.values()), marker="o", label="greedy eval accuracy")
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
