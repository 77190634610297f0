"""`rlmm probe`: measure the training-inference mismatch of one (model, sampler, trainer, precision).

Reads top to bottom:
  1. build the task, the model checkpoint, the precision policy, the sampler and the trainer;
  2. check that each engine really runs the precision it was asked for;
  3. sample rollouts and score them on both sides -> mismatch metrics, the per-position profile and the profile
     by the trainer's token entropy (`entropy_profile`, from the scoring forward's H_t);
  4. decompose: trainer vs itself at two micro-batch sizes, and across micro-batch layouts (padded
     micro-batches of trainer.micro_batch_size vs a token budget vs padding-free, `probe.trainer_layouts`);
     sampler vs itself, greedy, with the same prompts alone and inside larger batches (Thinking Machines 2025, "Defeating
     Nondeterminism in LLM Inference": 80 unique completions of 1000 without batch-invariant kernels);
     with an MoE model, the routing part: how often the two sides route a token differently, and how much of
     the sampler-vs-trainer gap goes when the trainer replays the sampler's experts (`routing_decomposition`);
     the sampler's decoding against its own prefill re-scoring of the same tokens (`decode_vs_prefill`);
     with a multi-turn task, re-tokenization: each conversation's text scored as sampled and as the chat template
     re-renders it (`retokenization`), beside its turns' drift and the conversations' own metrics;
     with `probe.simulated` (a list of ε), the same prompts sampled by the same engine unquantized with
     `sampler.perturb=ε`, and the ε that matches the real sampler's gap (`real_vs_simulated`);
  5. print a table, write `probe.json` and `probe.png` into the run directory, log to the logger.

Modules: `checks` (the options before any engine starts, the scored log-probs), `measurements` (each engine
against itself), `report` (the printed tables and lines), `plot` (`probe.png`); this module is the run.
"""
from __future__ import annotations

import json
import logging
import math
import time
from contextlib import nullcontext
from pathlib import Path

from omegaconf import DictConfig

from rlmm.config.options import build, to_container
from rlmm.mismatch.attribution import attribute, plot_attribution
from rlmm.mismatch.layer_attribution import compare_layers, plot_layers
from rlmm.mismatch.metrics import (early_vs_late, entropy_profile, mismatch_metrics, position_profile,
                                  token_agreement)
from rlmm.models.hybrid import padding_free_refusal
from rlmm.policy.quantization import NoQuantization, text_config
from rlmm.policy.support import recorded as support_recorded
from rlmm.policy.support import support_metrics
from rlmm.probe.checks import check_finite, check_options
from rlmm.probe.measurements import (batch_invariance, decode_vs_prefill, real_vs_simulated, retokenization,
                                     routing_decomposition, trainer_across_layouts, trainer_against_itself)
from rlmm.probe.plot import plot_probe
from rlmm.probe.report import print_probe
from rlmm.run.components import build_components
from rlmm.run.logging import redact
from rlmm.run.records import json_safe
from rlmm.runtime.timing import timed

log = logging.getLogger(__name__)


def run_probe(cfg: DictConfig, run_dir: Path, choices: dict[str, str]) -> dict:
    started = time.perf_counter()
    stage_seconds: dict[str, float] = {}
    options = cfg.probe
    layouts = check_options(cfg)  # before any engine starts
    components = build_components(cfg, lambda task: (task.examples(options.split, options.num_prompts)
                                                     + task.examples("train", options.batch_invariance.max_batch_size)),
                                  max(options.num_prompts * options.samples_per_prompt,
                                      options.batch_invariance.max_batch_size), stage_seconds)
    task, sampler, trainer = components.task, components.sampler, components.trainer
    precision_report, model_path = components.precision_report, components.model_path
    examples = task.examples(options.split, options.num_prompts)
    prompt_ids = [components.prompts.ids(e) for e in examples]
    episodes = components.episodes  # one response per prompt, or a multi-turn task's conversations

    with timed(stage_seconds, "generate"), sampler.capturing_layers() if options.layers else nullcontext():
        rollouts = episodes.sample(sampler, examples, n=options.samples_per_prompt)
    rewards = episodes.rewards(examples, rollouts, options.samples_per_prompt).tolist()
    sampler_logprobs, mask = rollouts.padded_sampler_logprobs()
    routing = components.routing
    sampled = rollouts
    rollouts = routing.scored(rollouts)  # r3: the trainer replays the sampler's experts in every scoring below
    with timed(stage_seconds, "score"), routing.recorded(trainer.model) as own_routing, \
            support_recorded(trainer.model) as support:
        train_logprobs, train_entropy = trainer.logprobs_with_entropy(rollouts)  # H_t of the same forward
    check_finite({"sampler": sampler_logprobs[mask], "trainer": train_logprobs[mask]}, precision_report,
                 close=(trainer, sampler))
    sampler_vs_trainer = mismatch_metrics(train_logprobs, sampler_logprobs, mask, ratio_cap=options.ratio_cap)
    agreement = token_agreement(train_logprobs, sampler_logprobs, mask)
    truncation = support_metrics(support, sampler_logprobs, mask)  # {} unless the sampler truncates
    if sampled.kept_tokens is not None:  # what carrying the kept sets costs (docs/metrics.md)
        truncation["kept_bytes_per_token"] = sum(k.nbytes() for k in sampled.kept_tokens) / max(1, mask.sum().item())
    # Whole-token buckets of equal width, so short answers get one bucket per position.
    bucket_size = max(1, math.ceil(mask.sum(1).max().item() / options.position_buckets))
    profile = position_profile(train_logprobs, sampler_logprobs, mask, bucket_size=bucket_size)
    by_entropy = entropy_profile(train_logprobs, sampler_logprobs, mask, train_entropy,
                                 edges=tuple(options.entropy_edges))
    early_late = options.early_vs_late
    same_responses = ({} if early_late.response_tokens is None else
                      early_vs_late(train_logprobs, sampler_logprobs, mask, **early_late))

    packing_refused = padding_free_refusal(text_config(model_path))
    if packing_refused:  # a hybrid: packed layouts would score tokens the trainer never would (rlmm/models/hybrid.py)
        left_out = [name for name, layout in layouts.items() if layout.padding_free]
        layouts = {name: layout for name, layout in layouts.items() if not layout.padding_free}
    with timed(stage_seconds, "trainer_vs_itself"):
        trainer_vs_itself = trainer_against_itself(trainer, rollouts, options.trainer_micro_batch_sizes,
                                                   options.ratio_cap)
        trainer_vs_itself.update(trainer_across_layouts(trainer, rollouts, layouts, options.ratio_cap))
        if packing_refused and left_out:
            trainer_vs_itself["layouts_left_out"] = {"layouts": left_out, "why": packing_refused}
    with timed(stage_seconds, "routing"):
        routing_part = routing_decomposition(routing, trainer, rollouts, own_routing, train_logprobs,
                                             sampler_logprobs, mask, options.ratio_cap)
    with timed(stage_seconds, "attribution"):
        attribution = (attribute(trainer, rollouts, cfg.precision.sampler_dtype, options.ratio_cap)
                       if options.attribution else {})
    with timed(stage_seconds, "layers"):
        layers = (compare_layers(trainer, rollouts, cfg.precision.sampler_dtype, bucket_size)
                  if options.layers else {})
    with timed(stage_seconds, "decode_vs_prefill"):
        decoding = decode_vs_prefill(sampler, sampled, components.sampling, options.ratio_cap, bucket_size)
    with timed(stage_seconds, "sampler_vs_itself"):
        sampler_vs_itself = batch_invariance(sampler, task, components.prompts, options)
    with timed(stage_seconds, "retokenization"):  # a conversation's text re-rendered: its own component of the gap
        retokenized = retokenization(trainer, rollouts, components.prompts) if episodes.multi_turn else {}
        conversations = episodes.metrics(rollouts, train_logprobs, sampler_logprobs, mask)
    sampler.close()
    with timed(stage_seconds, "simulated"):
        simulated = ({} if not options.simulated else real_vs_simulated(sampler_vs_trainer, {
            float(eps): stand_in_gap(cfg, components.engine_args, float(eps), examples, episodes, trainer, options)
            for eps in options.simulated}))
    trainer.close()

    record = {
        "choices": choices,
        "model_path": model_path,
        "precision": precision_report,
        "rollouts": {"num": len(rollouts), "mean_reward": sum(rewards) / len(rewards),
                     "mean_response_length": mask.sum().item() / len(rollouts),
                     "frac_truncated": rollouts.finish_reasons.count("length") / len(rollouts)},
        "sampler_vs_trainer": sampler_vs_trainer,
        "retokenization": retokenized,
        "conversations": conversations,
        "agreement": agreement,
        "support": truncation,
        "position_profile": profile,
        "entropy_profile": by_entropy,
        "early_vs_late": same_responses,
        "trainer_vs_itself": trainer_vs_itself,
        "sampler_vs_itself": sampler_vs_itself,
        "decode_vs_prefill": decoding,
        "real_vs_simulated": simulated,
        "routing": routing_part,
        "attribution": attribution,
        "layers": layers,
        "seconds": time.perf_counter() - started,
        "stage_seconds": stage_seconds,
        "config": redact(to_container(cfg)),
    }
    (run_dir / "probe.json").write_text(json.dumps(json_safe(record), indent=2, default=float, allow_nan=False))
    plot_probe(record, run_dir / "probe.png")
    if attribution:
        plot_attribution(attribution, run_dir / "attribution.png", choices)
    if layers:
        plot_layers(layers, run_dir / "layers.png", choices)
    print_probe(record)
    return record


def stand_in_gap(cfg: DictConfig, engine_args: dict, perturb: float, examples: list, episodes, trainer,
                 options) -> dict:
    """The probe's sampler-vs-trainer metrics for the same engine, unquantized (`quantization=none`, a KV cache in
    the sampler's dtype, so unscaled), with `sampler.perturb` = ε on the same prompts with the same seed (the simulated
    stand-in for a quantized sampler: rlmm/samplers/perturb.py)."""
    plain = {"kv_cache_dtype": "auto", "kv_scales": "unit"} if "kv_cache_dtype" in cfg.sampler else {}
    sampler = build(cfg.sampler, **{**engine_args, "quantization": NoQuantization()}, **plain, perturb=perturb)
    try:
        rollouts = episodes.sample(sampler, examples, n=options.samples_per_prompt)
    finally:
        sampler.close()
    sampler_logprobs, mask = rollouts.padded_sampler_logprobs()
    return mismatch_metrics(trainer.logprobs(rollouts), sampler_logprobs, mask, ratio_cap=options.ratio_cap)
