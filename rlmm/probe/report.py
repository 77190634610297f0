"""The probe's printed report of its record (`probe.json`): the headline metrics, sampler vs trainer and
trainer vs itself; the trainer across layouts; the engines' precision; the sampler against itself."""
from __future__ import annotations

from rlmm.policy.kv_scales import kv_scales_text
from rlmm.runtime.formatting import format_number

# The numbers shown in the printed table (all of them go to the JSON record).
HEADLINE = ("logprob_abs_diff_mean", "logprob_abs_diff_max", "prob_abs_diff_mean", "prob_abs_diff_max",
            "prob_pearson", "kl_k3", "ppl_ratio", "chi2_token", "seq_logratio_abs_max", "ess_seq",
            "frac_ratio_outside")


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
    console.print(agreement_verdict(record["agreement"]))
    if retokenized := record.get("retokenization"):
        print_retokenization(console, retokenized)
    print_entropy_profile(console, record["entropy_profile"])
    if support := record.get("support"):
        print_support(console, support, record["choices"].get("support", "sampler"))
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
    if left_out := itself.get("layouts_left_out"):
        console.print(f"trainer layouts left out: {', '.join(left_out['layouts'])} ({left_out['why']})")
    if routing := record.get("routing"):
        print_routing(console, routing)
    if attribution := record.get("attribution"):
        from rlmm.mismatch.attribution import print_attribution

        print_attribution(console, attribution)
    if layers := record.get("layers"):
        from rlmm.mismatch.layer_attribution import print_layers

        print_layers(console, layers)
    inv = record["sampler_vs_itself"]
    precision = record["precision"]
    engines = {side: ", ".join(f"{k} {v}" for k, v in precision["actual"][side].items()
                               if k not in ("engine", "quantization")) for side in ("sampler", "trainer")}
    quantized = precision["actual"]["sampler"].get("quantization", {})
    fake = precision["actual"]["trainer"].get("quantization", {})  # trainer.fake_quantize: what its forward shares
    if quantized.get("weights", "none") != "none" or quantized.get("kv_cache_dtype", "auto") != "auto":
        console.print("sampler quantization: " + "; ".join(
            f"{k} {kv_scales_text(v) if k == 'kv_scales' else v}" for k, v in quantized.items()))
    if quantized.get("weights", "none") != "none" or fake:
        console.print("trainer quantization: " + (f"fake_quantize {fake['fake_quantize']}" if fake else
                                                  "none, full-precision weights (trainer.fake_quantize=false: the "
                                                  "sampler's quantization is mismatch)"))
    console.print(f"engines run: sampler ({engines['sampler']}); trainer ({engines['trainer']}); fp32 matmul "
                  f"{precision['actual']['fp32_matmul']}")
    for line in precision["silent_casts"]:
        console.print(f"[bold red]precision mismatch:[/] {line}")
    console.print(f"sampler vs itself (greedy): {inv['unique_greedy_completions']} unique of "
                  f"{inv['num_greedy_completions']} completions across batch sizes (mean over prompts "
                  f"{inv['unique_greedy_completions_mean']:.2f}); alone vs batched identical for "
                  f"{inv['frac_identical_alone_vs_batched']:.0%} of prompts; |delta| mean {format_number(inv['logprob_abs_diff_mean'])}")
    print_decoding(console, record.get("decode_vs_prefill") or {}, record.get("real_vs_simulated") or {},
                   record["sampler_vs_trainer"])
    if early_late := record["early_vs_late"]:
        console.print(f"early vs late in the same {early_late['num_sequences']} responses of >= "
                      f"{early_late['response_tokens']} tokens: mean |delta| "
                      f"{format_number(early_late['early_logprob_abs_diff_mean'])} in the first {early_late['window']}, "
                      f"{format_number(early_late['late_logprob_abs_diff_mean'])} in the last {early_late['window']}")
    rollouts = record["rollouts"]
    console.print(f"rollouts: {rollouts['num']}, mean reward {rollouts['mean_reward']:.3f}, mean length "
                  f"{rollouts['mean_response_length']:.1f}; {record['seconds']:.1f} s ("
                  + ", ".join(f"{k} {v:.1f}" for k, v in record["stage_seconds"].items()) + ")")


def agreement_verdict(agreement: dict) -> str:
    """One line: are the sampler and the trainer bitwise on-policy here, and if not, on how many tokens they agree."""
    if agreement["bitwise_identical"]:
        return (f"sampler vs trainer: bitwise identical on all {agreement['num_tokens']} tokens (bitwise on-policy: "
                "no mismatch to correct with these engines, settings and CPU kernels)")
    return (f"sampler vs trainer: not bitwise identical, {agreement['frac_tokens_identical']:.1%} of "
            f"{agreement['num_tokens']} tokens score the same bits")


def print_entropy_profile(console, profile: dict) -> None:
    """The sampler-vs-trainer gap per bucket of the trainer's token entropy (rlmm/mismatch/metrics.py::entropy_profile): does
    the ratio's spread grow with H, so that one ratio threshold clips high-entropy tokens for their ordinary noise?"""
    from rich.table import Table

    table = Table(title="sampler vs trainer by the trainer's token entropy H (nats)", title_justify="left")
    for column in ("H", "tokens", "mean |Δlogp|", "KL k3", "ratio std"):
        table.add_column(column, justify="left" if column == "H" else "right")
    for i, (start, end, tokens) in enumerate(zip(profile["bucket_start"], profile["bucket_end"],
                                                 profile["num_tokens"])):
        figures = [format_number(profile[key][i]) if tokens else "-"  # an empty bucket's NaN
                   for key in ("logprob_abs_diff_mean", "kl_k3", "ratio_std")]
        table.add_row(f"[{start:g}, {'∞' if end == float('inf') else f'{end:g}'})", str(tokens), *figures)
    console.print(table)


def describe_layout(layout: dict) -> str:
    """e.g. '3 x <=512 tok packed': the micro-batch count, each one's size, packed or padded."""
    tokens = layout["micro_batch_tokens"]
    return (f"{layout['micro_batches']} x " + (f"<={tokens} tok" if tokens else f"{layout['micro_batch_size']} rows")
            + (" packed" if layout["padding_free"] else " padded"))


def print_support(console, support: dict, chosen: str) -> None:
    """The truncating sampler's kept sets against the trainer's distribution (rlmm/policy/support.py): sizes, masses, and
    the sampler-vs-trainer gap with the trainer normalised over each support."""
    from rich.table import Table

    console.print(f"kept sets: the sampler's {support['kept_size_sampler']:.3g} tokens, the trainer's own "
                  f"{support['kept_size_trainer']:.3g} (Jaccard {support['jaccard']:.3f}); the trainer's mass on the "
                  f"sampler's set S = {support['kept_mass_sampler_set']:.4f} (mean log S "
                  f"{support['log_kept_mass_sampler_set']:.4g}); sampled tokens outside the trainer's own set "
                  f"{support['frac_outside_trainer_set']:.2%}; capped {support['frac_capped']:.2%}")
    table = Table(title=f"sampler vs trainer by the trainer's support (this run: support={chosen})",
                  title_justify="left")
    for column in ("support", "mean Δlogp (trainer - sampler)", "mean |Δlogp|"):
        table.add_column(column, justify="right" if column != "support" else "left")
    for name, key in (("sampler (its kept set)", "sampler_set"), ("trainer (own set + token)", "trainer_set"),
                      ("full (vocabulary)", "full")):
        table.add_row(name, format_number(support[f"{key}/logprob_diff_mean"]),
                      format_number(support[f"{key}/logprob_abs_diff_mean"]))
    console.print(table)


def print_routing(console, routing: dict) -> None:
    """The routing part (rlmm/probe/measurements.py::routing_decomposition): disagreement, then each gap measure
    with the trainer's own routing and with the sampler's replayed, and the share replay removes."""
    from rich.table import Table

    d = routing["disagreement"]
    layers = sorted(k for k in d if k.startswith("frac_decisions_differ_layer_"))
    console.print(f"routing: {d['frac_decisions_differ']:.2%} of (token, layer) decisions and "
                  f"{d['frac_tokens_differ']:.2%} of tokens (in at least one of {len(layers)} MoE layers) differ "
                  f"between sampler and trainer; per layer "
                  + ", ".join(f"{d[k]:.2%}" for k in layers))
    console.print(f"{d['differing_decisions_reaching_scores']} of the {d['differing_decisions']} differing decisions "
                  f"can move a scored log-prob (not the last MoE layer's at a prompt position before the last)"
                  + ("; so replay cannot change this gap" if d["differing_decisions_reaching_scores"] == 0 else ""))
    table = Table(title="sampler vs trainer, the trainer routing itself vs replaying the sampler's experts (R3)",
                  title_justify="left")
    for column in ("metric", "own routing", "replayed", "share removed"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for key, share in routing["share_removed"].items():
        table.add_row(key, format_number(routing["own"][key]), format_number(routing["replayed"][key]), f"{share:.1%}")
    console.print(table)


def print_decoding(console, decoding: dict, simulated: dict, real: dict) -> None:
    """The sampler's decoding against its own prefill, and the real sampler's gap among its simulated stand-ins."""
    if "skipped" in decoding:
        console.print(f"decode vs prefill: skipped ({decoding['skipped']})")
    elif decoding:
        where = ("no response differs" if decoding["first_divergence_min"] is None else
                 f"first differing position min {decoding['first_divergence_min']}, median "
                 f"{decoding['first_divergence_median']}, max {decoding['first_divergence_max']}")
        console.print(f"decode vs prefill (the sampler re-scoring its own tokens in one prefill): "
                      f"{decoding['frac_responses_identical']:.0%} of responses identical to the bit, {where}; "
                      f"mean |delta| {format_number(decoding['logprob_abs_diff_mean'])}, "
                      f"KL k3 {format_number(decoding['kl_k3'])}")
    if simulated:
        from rich.table import Table

        table = Table(title="real vs simulated (sampler.perturb=ε, same engine unquantized, same prompts)",
                      title_justify="left")
        for column in ("sampler", "mean |Δlogp|", "KL k3"):
            table.add_column(column, justify="right" if column != "sampler" else "left")
        table.add_row("this sampler", format_number(real["logprob_abs_diff_mean"]), format_number(real["kl_k3"]))
        for eps, metrics in simulated["simulated"].items():
            table.add_row(f"perturb={eps}", format_number(metrics["logprob_abs_diff_mean"]),
                          format_number(metrics["kl_k3"]))
        matching = simulated["matching_epsilon"]
        table.add_row("matching ε", *(format_number(matching[k]) if matching[k] is not None else "outside the grid"
                                      for k in ("logprob_abs_diff_mean", "kl_k3")))
        console.print(table)


def print_retokenization(console, retokenized: dict) -> None:
    """A multi-turn probe's re-tokenization component (rlmm/probe/measurements.py::retokenization), one line each."""
    console.print(f"re-tokenization: {retokenized['frac_turns_drifted']:.2%} of turns re-render otherwise "
                  f"({retokenized['frac_tokens_changed']:.2%} of sampled tokens after a first difference; "
                  f"{retokenized['frac_conversations_drifted']:.2%} of conversations); the trainer's log-likelihood of "
                  f"the text moves by {format_number(retokenized['conversation_logprob_gap_mean'])} nats a conversation "
                  f"(|{format_number(retokenized['conversation_logprob_gap_abs_mean'])}|; drifted ones "
                  f"{format_number(retokenized['drifted_logprob_gap_mean'])}); tokens below -10: "
                  f"{retokenized['frac_trainer_logprob_below_neg10_sampled']:.2%} sampled, "
                  f"{retokenized['frac_trainer_logprob_below_neg10_rerendered']:.2%} re-rendered")
