"""`rlmm probe`: measure the training-inference mismatch of one (model, sampler, trainer, precision).

Reads top to bottom:
  1. build the task, the model checkpoint, the precision policy, the sampler and the trainer;
  2. check that each engine really runs the precision it was asked for;
  3. sample rollouts and score them on both sides -> mismatch metrics and the per-position profile;
  4. decompose: trainer vs itself at two micro-batch sizes, and across micro-batch layouts (padded
     micro-batches of trainer.micro_batch_size vs a token budget vs padding-free, `probe.trainer_layouts`);
     sampler vs itself, greedy, with the same prompts alone and inside larger batches (Thinking Machines 2025, "Defeating
     Nondeterminism in LLM Inference": 80 unique completions of 1000 without batch-invariant kernels);
  5. print a table, write `probe.json` and `probe.png` into the run directory, log to the logger.
"""
from __future__ import annotations

import json
import logging
import math
import re
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from rlmm.components import build_components
from rlmm.config import to_container
from rlmm.formatting import format_number
from rlmm.logging import redact
from rlmm.metrics import early_vs_late, mismatch_metrics, position_profile
from rlmm.samplers.base import Rollouts, pad_right
from rlmm.timing import timed
from rlmm.trainers.packing import MicroBatching
from rlmm.trainers.scoring import row_tokens

log = logging.getLogger(__name__)

# The numbers shown in the printed table (all of them go to the JSON record).
HEADLINE = ("logprob_abs_diff_mean", "logprob_abs_diff_max", "prob_abs_diff_mean", "prob_abs_diff_max",
            "prob_pearson", "kl_k3", "ppl_ratio", "chi2_token", "seq_logratio_abs_max", "ess_seq",
            "frac_ratio_outside")


def run_probe(cfg: DictConfig, run_dir: Path, choices: dict[str, str]) -> dict:
    started = time.perf_counter()
    stage_seconds: dict[str, float] = {}
    options = cfg.probe
    layouts = check_options(cfg)  # before any engine starts
    components = build_components(cfg, lambda task: (task.examples(options.split, options.num_prompts)
                                                     + task.examples("train", options.batch_invariance.max_batch_size)),
                                  max(options.num_prompts * options.samples_per_prompt,
                                      options.batch_invariance.max_batch_size), stage_seconds)
    task, tokenizer, sampler, trainer = components.task, components.tokenizer, components.sampler, components.trainer
    precision_report, model_path = components.precision_report, components.model_path
    examples = task.examples(options.split, options.num_prompts)
    prompt_ids = [tokenizer(e.prompt).input_ids for e in examples]

    with timed(stage_seconds, "generate"):
        rollouts = sampler.generate(prompt_ids, n=options.samples_per_prompt)
    completions = tokenizer.batch_decode(rollouts.response_ids, skip_special_tokens=True)
    rewards = [task.reward(examples[i // options.samples_per_prompt], text) for i, text in enumerate(completions)]
    sampler_logprobs, mask = rollouts.padded_sampler_logprobs()
    with timed(stage_seconds, "score"):
        train_logprobs = trainer.logprobs(rollouts)
    check_finite({"sampler": sampler_logprobs[mask], "trainer": train_logprobs[mask]}, precision_report,
                 close=(trainer, sampler))
    sampler_vs_trainer = mismatch_metrics(train_logprobs, sampler_logprobs, mask, ratio_cap=options.ratio_cap)
    # Whole-token buckets of equal width, so short answers get one bucket per position.
    bucket_size = max(1, math.ceil(mask.sum(1).max().item() / options.position_buckets))
    profile = position_profile(train_logprobs, sampler_logprobs, mask, bucket_size=bucket_size)
    early_late = options.early_vs_late
    same_responses = ({} if early_late.response_tokens is None else
                      early_vs_late(train_logprobs, sampler_logprobs, mask, **early_late))

    with timed(stage_seconds, "trainer_vs_itself"):
        trainer_vs_itself = trainer_against_itself(trainer, rollouts, options.trainer_micro_batch_sizes,
                                                   options.ratio_cap)
        trainer_vs_itself.update(trainer_across_layouts(trainer, rollouts, layouts, options.ratio_cap))
    with timed(stage_seconds, "sampler_vs_itself"):
        sampler_vs_itself = batch_invariance(sampler, task, tokenizer, options)
    trainer.close()
    sampler.close()

    record = {
        "choices": choices,
        "model_path": model_path,
        "precision": precision_report,
        "rollouts": {"num": len(rollouts), "mean_reward": sum(rewards) / len(rewards),
                     "mean_response_length": mask.sum().item() / len(rollouts),
                     "frac_truncated": rollouts.finish_reasons.count("length") / len(rollouts)},
        "sampler_vs_trainer": sampler_vs_trainer,
        "position_profile": profile,
        "early_vs_late": same_responses,
        "trainer_vs_itself": trainer_vs_itself,
        "sampler_vs_itself": sampler_vs_itself,
        "seconds": time.perf_counter() - started,
        "stage_seconds": stage_seconds,
        "config": redact(to_container(cfg)),
    }
    (run_dir / "probe.json").write_text(json.dumps(record, indent=2, default=float))
    plot_probe(record, run_dir / "probe.png")
    print_probe(record)
    return record


def check_finite(logprobs: dict[str, torch.Tensor], precision_report: dict, close=()) -> None:
    """Stop with one line instead of reporting NaN metrics when a side's log-probs are not finite
    (the known cause: fp16 activations that overflow, as Qwen2's do)."""
    bad = {side: 1 - torch.isfinite(lp).float().mean().item() for side, lp in logprobs.items()}
    if not any(bad.values()):
        return
    for engine in close:
        engine.close()
    dtypes = {side: precision_report["actual"][side]["dtype"] for side in bad}
    sides = ", ".join(f"{frac:.1%} of the {side}'s ({dtypes[side]})" for side, frac in bad.items() if frac)
    hint = ("; fp16 activations overflow in some models (Qwen2 is known to): use precision=bf16 or fp32"
            if "fp16" in dtypes.values() else "")
    raise ValueError(f"probe: non-finite log-probs: {sides}{hint}")


def check_options(cfg: DictConfig) -> dict[str, MicroBatching]:
    """Every `probe.*` value that can be checked before an engine starts (rlmm/overrides.py checks each
    combination of a sweep with it); returns the trainer layouts to score."""
    for key in ("num_prompts", "samples_per_prompt"):  # named here, not as the task's number of examples
        if cfg.probe[key] < 1:
            raise ValueError(f"probe.{key}: must be >= 1, got {cfg.probe[key]}")
    check_micro_batch_sizes(cfg.probe.trainer_micro_batch_sizes)
    check_early_vs_late(cfg.probe.early_vs_late, cfg.sampling.max_new_tokens)
    check_batch_invariance(cfg.probe.batch_invariance)
    return check_layouts(cfg.probe.trainer_layouts, cfg.trainer.micro_batch_size)


def check_micro_batch_sizes(sizes) -> tuple[int, int]:
    """`probe.trainer_micro_batch_sizes` as (small, large): two different sizes, each >= 1."""
    sizes = sorted(sizes)
    if len(sizes) != 2 or sizes[0] == sizes[1] or sizes[0] < 1:
        raise ValueError(f"probe.trainer_micro_batch_sizes: two different sizes >= 1, got {sizes}")
    return sizes[0], sizes[1]


def check_batch_invariance(options) -> None:
    """`probe.batch_invariance`: at least two batch sizes, and a largest batch that holds every target prompt."""
    for key, least in (("num_prompts", 1), ("num_completions", 2), ("max_batch_size", 1)):
        if options[key] < least:
            raise ValueError(f"probe.batch_invariance.{key}={options[key]}: must be >= {least}")
    if options.max_batch_size < options.num_prompts:
        raise ValueError(f"probe.batch_invariance.max_batch_size={options.max_batch_size}: must be >= "
                         f"probe.batch_invariance.num_prompts={options.num_prompts} (the largest batch holds every prompt)")


def check_early_vs_late(options, max_new_tokens: int) -> None:
    """`probe.early_vs_late`: off (null), or windows that fit the responses the sampler can give."""
    n, window = options.response_tokens, options.window
    if n is None:
        return
    if not 1 <= window <= n // 2:
        raise ValueError(f"probe.early_vs_late.window={window}: must be between 1 and response_tokens/2 = {n // 2}")
    if n > max_new_tokens:
        raise ValueError(f"probe.early_vs_late.response_tokens={n}: responses are at most "
                         f"sampling.max_new_tokens={max_new_tokens} tokens long (null turns it off)")


def check_layouts(layouts, micro_batch_size: int) -> dict[str, MicroBatching]:
    """`probe.trainer_layouts` as MicroBatching settings, the padded reference (micro-batches of
    `trainer.micro_batch_size` rows) under "reference". A name is a metric name's part: letters, digits, _."""
    out = {"reference": MicroBatching(micro_batch_size, None, False)}
    for name, layout in layouts.items():
        if not re.fullmatch(r"[A-Za-z0-9_]+", name) or name == "reference":
            raise ValueError(f"probe.trainer_layouts: {name!r} is not a name of letters, digits and _ "
                             f"(other than 'reference')")
        try:
            out[name] = MicroBatching(micro_batch_size, layout.micro_batch_tokens, layout.padding_free)
        except ValueError as err:
            raise ValueError(f"probe.trainer_layouts.{name}: {err}") from None
    return out


def trainer_across_layouts(trainer, rollouts: Rollouts, layouts: dict[str, MicroBatching], ratio_cap: float) -> dict:
    """The same rollouts scored by the same trainer under each layout and under the padded reference
    (`check_layouts`): what the micro-batch layout alone does to the trainer's log-probs, the reference
    playing the sampler in δ = log π_layout - log π_reference. Returns `layouts` (each one's settings and
    micro-batch count) and `NAME/METRIC` for every layout and metric (rlmm table: trainer_vs_itself/NAME/METRIC)."""
    _, mask = rollouts.padded_sampler_logprobs()
    rows = list(range(len(rollouts)))
    reference = trainer.logprobs(rollouts, layout=layouts["reference"])
    record = {"layouts": {name: {"micro_batch_size": layout.size, "micro_batch_tokens": layout.tokens,
                                 "padding_free": layout.padding_free,
                                 "micro_batches": len(layout.split(row_tokens(rollouts, rows), rows))}
                          for name, layout in layouts.items()}}
    for name, layout in layouts.items():
        if name == "reference":
            continue
        metrics = mismatch_metrics(trainer.logprobs(rollouts, layout=layout), reference, mask, ratio_cap=ratio_cap)
        record.update({f"{name}/{key}": value for key, value in metrics.items()})
    return record


def trainer_against_itself(trainer, rollouts: Rollouts, micro_batch_sizes: list[int], ratio_cap: float) -> dict:
    """The same rollouts scored twice by the same trainer, in micro-batches of the two sizes: what batch
    shape alone does to the trainer's log-probs (the larger size plays the trainer, the smaller the sampler
    in the metrics' δ = log π_large - log π_small)."""
    small, large = check_micro_batch_sizes(micro_batch_sizes)
    _, mask = rollouts.padded_sampler_logprobs()
    return {"micro_batch_sizes": [small, large],
            **mismatch_metrics(trainer.logprobs(rollouts, large), trainer.logprobs(rollouts, small), mask,
                               ratio_cap=ratio_cap)}


def batch_invariance(sampler, task, tokenizer, options) -> dict:
    """Greedy decoding of the same prompts inside batches of different sizes, and alone.

    Batch sizes: `num_completions` sizes from 1 to `max_batch_size` (linspace, rounded). A batch of size s
    holds the first min(s, num_prompts) target prompts, filled up with train prompts, so every target in a
    batch is one more observation of its greedy completion at that size, for compute the batch costs anyway.

    - `unique_greedy_completions`: distinct completions of the first target across the sizes (a
      batch-invariant engine gives 1); `unique_greedy_completions_mean` the same averaged over targets,
      and `frac_prompts_batch_invariant` the fraction of targets with one completion at every size.
    - each target alone (a batch of 1) vs inside the largest batch: fraction identical, first diverging
      token index, and |delta| between the two runs' log-probs over the common prefix (the sampler's
      disagreement with itself).
    """
    settings = options.batch_invariance
    fillers = [tokenizer(e.prompt).input_ids for e in task.examples("train", settings.max_batch_size)]
    targets = [tokenizer(e.prompt).input_ids for e in task.examples(options.split, settings.num_prompts)]

    sizes = torch.linspace(1, settings.max_batch_size, settings.num_completions).round().int().tolist()
    completions = [[] for _ in targets]
    for size in sizes:
        present = min(size, len(targets))
        batch = sampler.generate(targets[:present] + fillers[:size - present], greedy=True)
        for i in range(present):
            completions[i].append(tuple(batch.response_ids[i]))
    largest = batch  # the sizes ascend: the last batch holds every target (check_batch_invariance)

    alone = Rollouts([], [], [], [])
    for prompt in targets:
        one = sampler.generate([prompt], greedy=True)
        alone.response_ids += one.response_ids
        alone.sampler_logprobs += one.sampler_logprobs

    first_divergence, prefix_a, prefix_b = [], [], []
    for i in range(len(targets)):
        a, b = alone.response_ids[i], largest.response_ids[i]
        common = next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if a != b:
            first_divergence.append(common)
        # Compare log-probs only where both runs saw the same prefix (and emitted the same token).
        prefix_a.append(alone.sampler_logprobs[i][:common])
        prefix_b.append(largest.sampler_logprobs[i][:common])
    lp_a, mask = pad_right(prefix_a)
    lp_b, _ = pad_right(prefix_b)
    prefix_metrics = mismatch_metrics(lp_b, lp_a, mask)
    unique = [len(set(c)) for c in completions]
    return {
        "unique_greedy_completions": unique[0],
        "num_greedy_completions": len(completions[0]),
        "unique_greedy_completions_mean": sum(unique) / len(unique),
        "frac_prompts_batch_invariant": sum(u == 1 for u in unique) / len(unique),
        "num_observations": sum(map(len, completions)),
        "batch_sizes": sizes,
        "frac_identical_alone_vs_batched": 1 - len(first_divergence) / len(targets),
        "first_divergence_index": first_divergence,
        "logprob_abs_diff_mean": prefix_metrics["logprob_abs_diff_mean"],
        "logprob_abs_diff_max": prefix_metrics["logprob_abs_diff_max"],
    }


def print_probe(record: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    choices = record["choices"]
    title = " ".join(f"{k}={v}" for k, v in choices.items() if k in ("model", "sampler", "trainer", "precision"))
    table = Table(title=f"mismatch: {title}", title_justify="left")
    table.add_column("metric")
    table.add_column("sampler vs trainer", justify="right")
    itself = record["trainer_vs_itself"]
    table.add_column(f"trainer vs itself (mb {itself['micro_batch_sizes']})", justify="right")
    for key in HEADLINE:
        fmt = (lambda v: f"{v:.7f}") if key == "prob_pearson" else format_number  # its story is in the 5th digit
        table.add_row(key, fmt(record["sampler_vs_trainer"][key]), fmt(itself[key]))
    console.print(table)
    layouts = itself["layouts"]
    if len(layouts) > 1:
        reference = layouts["reference"]
        table = Table(title=f"trainer vs itself across layouts, against {describe_layout(reference)}",
                      title_justify="left")
        table.add_column("layout", no_wrap=True)
        table.add_column("micro-batches", no_wrap=True)
        table.add_column("mean |Δlogp|", justify="right")
        table.add_column("max |Δlogp|", justify="right")
        for name, layout in layouts.items():
            if name != "reference":
                table.add_row(name, describe_layout(layout), format_number(itself[f"{name}/logprob_abs_diff_mean"]),
                              format_number(itself[f"{name}/logprob_abs_diff_max"]))
        console.print(table)
    inv = record["sampler_vs_itself"]
    precision = record["precision"]
    engines = {side: ", ".join(f"{k} {v}" for k, v in precision["actual"][side].items() if k != "engine")
               for side in ("sampler", "trainer")}
    console.print(f"engines run: sampler ({engines['sampler']}); trainer ({engines['trainer']}); fp32 matmul "
                  f"{precision['actual']['fp32_matmul']}")
    for line in precision["silent_casts"]:
        console.print(f"[bold red]precision mismatch:[/] {line}")
    console.print(f"sampler vs itself (greedy): {inv['unique_greedy_completions']} unique of "
                  f"{inv['num_greedy_completions']} completions across batch sizes (mean over prompts "
                  f"{inv['unique_greedy_completions_mean']:.2f}); alone vs batched identical for "
                  f"{inv['frac_identical_alone_vs_batched']:.0%} of prompts; |delta| mean {format_number(inv['logprob_abs_diff_mean'])}")
    if early_late := record["early_vs_late"]:
        console.print(f"early vs late in the same {early_late['num_sequences']} responses of >= "
                      f"{early_late['response_tokens']} tokens: mean |delta| "
                      f"{format_number(early_late['early_logprob_abs_diff_mean'])} in the first {early_late['window']}, "
                      f"{format_number(early_late['late_logprob_abs_diff_mean'])} in the last {early_late['window']}")
    rollouts = record["rollouts"]
    console.print(f"rollouts: {rollouts['num']}, mean reward {rollouts['mean_reward']:.3f}, mean length "
                  f"{rollouts['mean_response_length']:.1f}; {record['seconds']:.1f} s ("
                  + ", ".join(f"{k} {v:.1f}" for k, v in record["stage_seconds"].items()) + ")")


def describe_layout(layout: dict) -> str:
    """e.g. '3 x <=512 tok packed': the micro-batch count, each one's size, packed or padded."""
    tokens = layout["micro_batch_tokens"]
    return (f"{layout['micro_batches']} x " + (f"<={tokens} tok" if tokens else f"{layout['micro_batch_size']} rows")
            + (" packed" if layout["padding_free"] else " padded"))


def plot_probe(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profile = record["position_profile"]
    starts, ends = profile["bucket_start"], profile["bucket_end"]
    centers = [(s + e) / 2 for s, e in zip(starts, ends)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    axes[0].plot(centers, profile["logprob_abs_diff_mean"], marker="o", label="mean |δ|")
    axes[0].plot(centers, profile["kl_k3"], marker="s", label="KL k3 (per token)")
    axes[0].set_xlabel("response position (tokens)")
    axes[0].set_ylabel("sampler vs trainer")
    axes[0].set_yscale("symlog", linthresh=1e-6)
    axes[0].set_title("mismatch by response position")
    axes[0].legend()
    ax = axes[1]
    ax.bar(starts, profile["num_tokens"], width=[(e - s) * 0.9 for s, e in zip(starts, ends)], align="edge", color="0.7")
    ax.set_xlabel("response position (tokens)")
    ax.set_ylabel("tokens in bucket")
    ax.set_title("tokens per position bucket")
    # What the trainer's batch shape alone does: |Δ log p| of the trainer against itself.
    itself = record["trainer_vs_itself"]
    small, large = itself["micro_batch_sizes"]
    compared = [name for name in itself["layouts"] if name != "reference"]
    names = [f"mb {large} vs {small}"] + [f"{name} vs padded" for name in compared]
    prefixes = [""] + [f"{name}/" for name in compared]
    ax = axes[2]
    at = range(len(names))
    ax.bar([x - 0.2 for x in at], [itself[f"{p}logprob_abs_diff_mean"] for p in prefixes], width=0.4, label="mean")
    ax.bar([x + 0.2 for x in at], [itself[f"{p}logprob_abs_diff_max"] for p in prefixes], width=0.4, label="max")
    ax.set_xticks(list(at), names, rotation=15, fontsize=8)
    ax.set_yscale("symlog", linthresh=1e-8)
    ax.set_ylabel("|Δ log p| (nats)")
    ax.set_title("trainer vs itself: batch shape and layout")
    ax.legend()
    choices = record["choices"]
    fig.suptitle(" ".join(f"{k}={v}" for k, v in choices.items()), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
