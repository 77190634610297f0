"""The probe's measurements of each engine against itself (the sampler against the trainer is
rlmm/mismatch/metrics.py's, called from `run_probe`): the trainer at two micro-batch sizes (`trainer_against_itself`)
and across micro-batch layouts (`trainer_across_layouts`), the sampler greedy inside batches of different
sizes and alone (`batch_invariance`), the sampler's decoding against its own prefill (`decode_vs_prefill`, with
rlmm/mismatch/metrics.py's `token_agreement`); and where a real (quantized) sampler's gap sits among `sampler.perturb`
stand-ins (`real_vs_simulated`)."""
from __future__ import annotations

import math

import torch

from rlmm.mismatch.metrics import mismatch_metrics, position_profile, token_agreement
from rlmm.mismatch.routing import differing_decisions, routing_disagreement, scored_both_ways
from rlmm.policy.rollouts import Rollouts, pad_right
from rlmm.probe.checks import check_micro_batch_sizes
from rlmm.trainers.packing import MicroBatching
from rlmm.trainers.scoring import row_tokens


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


def batch_invariance(sampler, task, prompts, options) -> dict:
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
    fillers = [prompts.ids(e) for e in task.examples("train", settings.max_batch_size)]
    targets = [prompts.ids(e) for e in task.examples(options.split, settings.num_prompts)]

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


# The gap measures whose share removed by replaying the sampler's routing the probe reports.
ROUTING_GAP_KEYS = ("logprob_abs_diff_mean", "kl_k3", "prob_abs_diff_mean", "seq_logratio_abs_max")


def routing_decomposition(routing, trainer, rollouts: Rollouts, own: dict | None, train_logprobs: torch.Tensor,
                          sampler_logprobs: torch.Tensor, mask: torch.Tensor, ratio_cap: float) -> dict:
    """The routing part of the sampler-vs-trainer gap, for an MoE model whose sampler returned its experts ({}
    otherwise): the routing disagreement (rlmm/mismatch/routing.py::routing_disagreement), the mismatch with the trainer
    routing itself (`own`) and replaying the sampler's experts (`replayed`) on the same rollouts (one of the two
    is the probe's own scoring, `train_logprobs`, under `routing=`), and per gap measure G the share replay
    removes, 1 - G_replayed / G_own (docs/metrics.md#routing)."""
    if routing.shape is None or rollouts.routed_experts is None or own is None:
        return {}
    ways = scored_both_ways(trainer, rollouts, train_logprobs)
    gaps = {way: mismatch_metrics(lp, sampler_logprobs, mask, ratio_cap=ratio_cap) for way, lp in ways.items()}
    removed = {key: 1 - gaps["replayed"][key] / gaps["own"][key] if gaps["own"][key] else 0.0
               for key in ROUTING_GAP_KEYS}
    own_rows = [own[i] for i in range(len(rollouts))]
    disagreement = routing_disagreement(rollouts.routed_experts, own_rows)
    counts = differing_decisions(rollouts.routed_experts, own_rows, [len(p) for p in rollouts.prompt_ids],
                                 routing.shape.last_layer_is_final)
    return {"disagreement": {k.removeprefix("routing/"): v for k, v in disagreement.items()} | counts,
            "own": gaps["own"], "replayed": gaps["replayed"], "share_removed": removed,
            "bytes_per_token": routing.shape.bytes_per_token()}


def untempered(sampling) -> bool:
    """Whether the sampler's processed log-probs are the raw ones (temperature 1, no top-k or top-p)."""
    return sampling.temperature == 1.0 and sampling.top_p == 1.0 and sampling.top_k in (0, -1, None)


def decode_vs_prefill(sampler, rollouts: Rollouts, sampling, ratio_cap: float, bucket_size: int) -> dict:
    """The sampler against its own decoding: the log-prob it reported for each sampled token while decoding
    (one step per token, K/V from its cache) against the same tokens re-scored by the same engine in one prefill
    of prompt + response (`Sampler.prefill_logprobs`), the prefill playing the trainer in δ = log π_prefill -
    log π_decode. vLLM issue #54035: with an FP8 KV cache the two diverge from position ~97 on (Hopper, FA3)
    while a BF16 cache is bit-identical; here per KV cache dtype and engine. Returns the mismatch metrics, the
    share of responses identical to the bit, the first position where a response's two log-probs differ
    (min / median / max over the responses that differ), and the per-position profile. Skipped, with the reason,
    when sampling is tempered (the prefill's log-probs are raw, the decode's processed)."""
    if not untempered(sampling):
        return {"skipped": "sampling is tempered or truncated: the prefill's raw log-probs are not comparable"}
    prefill = sampler.prefill_logprobs(rollouts.prompt_ids, rollouts.response_ids)
    decode, mask = rollouts.padded_sampler_logprobs()
    prefill_padded, _ = pad_right(prefill)
    first = [next((j for j, (a, b) in enumerate(zip(d.tolist(), p.tolist())) if a != b), None)
             for d, p in zip(rollouts.sampler_logprobs, prefill)]
    diverging = sorted(f for f in first if f is not None)
    record = {**mismatch_metrics(prefill_padded, decode, mask, ratio_cap=ratio_cap),
              **token_agreement(prefill_padded, decode, mask),
              "frac_responses_identical": 1 - len(diverging) / len(first) if first else 1.0,
              "first_divergence_min": diverging[0] if diverging else None,
              "first_divergence_median": diverging[len(diverging) // 2] if diverging else None,
              "first_divergence_max": diverging[-1] if diverging else None}
    record["position_profile"] = position_profile(prefill_padded, decode, mask, bucket_size=bucket_size)
    return record


# The gap measures the real sampler and its simulated stand-ins are matched on.
MATCHED_KEYS = ("logprob_abs_diff_mean", "kl_k3")


def real_vs_simulated(real: dict, simulated: dict[float, dict]) -> dict:
    """Where the real (quantized) sampler's mismatch sits among `sampler.perturb=ε` stand-ins measured on the same
    prompts (`simulated`: ε -> its sampler-vs-trainer metrics): for each of `MATCHED_KEYS` the ε that gives the
    real gap, interpolated log-log between the two grid points that bracket it (None outside the grid)."""
    grid = sorted(simulated)
    matching = {}
    for key in MATCHED_KEYS:
        target = real[key]
        matching[key] = None
        for low, high in zip(grid, grid[1:]):
            a, b = simulated[low][key], simulated[high][key]
            if min(a, b) <= target <= max(a, b) and a > 0 and b > 0 and low > 0 and target > 0:
                t = 0.0 if a == b else (math.log(target) - math.log(a)) / (math.log(b) - math.log(a))
                matching[key] = math.exp(math.log(low) + t * (math.log(high) - math.log(low)))
                break
    return {"epsilons": grid, "simulated": {f"{eps:g}": metrics for eps, metrics in simulated.items()},
            "matching_epsilon": matching}


def retokenization(trainer, rollouts: Rollouts, prompts) -> dict:
    """Re-tokenization as a component of the gap (multi-turn conversations, issue 60): each conversation's assistant
    text scored by the trainer twice, as the sampler's ids (the rollouts' rows, the token path's) and as the chat
    template re-renders it (token_path=retokenize's row, rlmm/conversation/token_path.py). Per conversation,

        Δ = Σ_{assistant spans of the re-rendered row} log π_train − Σ_{sampled tokens of the row} log π_train,

    the change in the log-likelihood of the same text that re-tokenizing makes (0 where every turn re-renders as
    sampled). Keys: the turns' drift (`turn_drift`: share drifted, sampled tokens after the first difference), the
    mean of Δ and of |Δ| over all conversations and over those with a drifted turn, and the share of trained tokens
    with a trainer log-prob below -10 on each side. `prompts`: the bound chat template (`TemplatePrompts`)."""
    from rlmm.conversation.token_path import Conversation, Retokenize, Turn, TurnDrift

    records = rollouts.conversations
    rerendered = []
    for prompt, record in zip(rollouts.prompt_ids, records):
        conversation = Conversation(record["messages"], [Turn(list(prompt), [], torch.zeros(0), "stop")])
        rerendered.append(Retokenize().trained(prompts, conversation))
    other = Rollouts([r.prompt_ids for r in rerendered], [r.response_ids for r in rerendered],
                     [torch.zeros(len(r.response_ids)) for r in rerendered], list(rollouts.finish_reasons),
                     sampled=[torch.tensor(r.sampled, dtype=torch.bool) for r in rerendered])
    _, mask = rollouts.padded_sampler_logprobs()
    _, other_mask = other.padded_sampler_logprobs()
    sampled, again = trainer.logprobs(rollouts).double(), trainer.logprobs(other).double()
    gap = torch.where(other_mask, again, 0.0).sum(1) - torch.where(mask, sampled, 0.0).sum(1)
    drifts = [[TurnDrift(*d) for d in record["drift"]] for record in records]
    turns = [d for conversation in drifts for d in conversation]
    drifted = torch.tensor([any(d.drifted for d in conversation) for conversation in drifts])
    return {"frac_turns_drifted": sum(d.drifted for d in turns) / max(1, len(turns)),
            "frac_tokens_changed": sum(d.changed for d in turns) / max(1, sum(d.sampled for d in turns)),
            "frac_conversations_drifted": drifted.double().mean().item(),
            "conversation_logprob_gap_mean": gap.mean().item(), "conversation_logprob_gap_abs_mean": gap.abs().mean().item(),
            "drifted_logprob_gap_mean": gap[drifted].mean().item() if drifted.any() else math.nan,
            "drifted_logprob_gap_abs_mean": gap[drifted].abs().mean().item() if drifted.any() else math.nan,
            "frac_trainer_logprob_below_neg10_sampled": (sampled[mask] < -10).double().mean().item(),
            "frac_trainer_logprob_below_neg10_rerendered": (again[other_mask] < -10).double().mean().item(),
            "num_conversations": len(records)}
