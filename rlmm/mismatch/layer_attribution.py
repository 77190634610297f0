"""Where along the model the mismatch appears: the hidden states after every decoder layer (and each part of it) as
the sampler engine computed them while sampling, against the trainer's, per layer and position (`rlmm probe
probe.layers=true`).

Sites, in model order (`site_names`): `embed` (the embedding's output: the stream entering layer 0); per decoder
layer i its parts (`PARTS`) `layer_<i>.attn_norm`, `.attn` (the attention block's output, before the residual add),
`.mlp_norm`, `.mlp` (the MLP's or MoE block's output), then `layer_<i>` (the residual stream after the layer: what
transformers' layer returns, vLLM's hidden + residual); `norm` (the final norm's output, what the LM head reads).
The stream sites say where along the depth the gap appears and how it grows; the parts say which op of the first
departing layer it comes from (at equal dtypes: which kernel). The sampler's states are captured while it samples the probe's rollouts
(`Rollouts.layer_states`: transformers' hooks in `recording_states`, vLLM's in rlmm/samplers/vllm_capture.py): a
prompt position's from the engine's prefill, a response token's from the decode step that fed it; the last
response token is never fed back, so it has none. The trainer's are taken in the forwards of its own scoring of the
same rollouts (`trainer.logprobs`: its micro-batches and their padding, as the probe's sampler-vs-trainer gap is
measured).

Per token and site, with h_a the state under test and h_b the reference (Euclidean norms over the hidden axis):

    e = ||h_a - h_b||_2 / ||h_b||_2

Comparisons (`compare_layers`):

    kernels    the sampler against the trainer computing in the sampler's dtype (the trainer as it is when it
               computes in that dtype; with an fp32 trainer, op attribution's all-low plan, which is that dtype's
               trainer bit for bit): equal dtypes, so what differs is the engines' kernels, batch shapes and the
               decode path (and, when set, what the sampler does to its weights: quantization, sampler.perturb)
    precision  the trainer in the sampler's dtype against the trainer in fp32: the same kernels, rounding alone
    total      the sampler against the fp32 trainer

`precision` and `total` exist where the sampler computes in 16 bits and the trainer in fp32. Per comparison and
site: `rel_error` (the mean of e over the compared tokens), `rel_error_prompt` and `rel_error_response` (over prompt
positions, the sampler's prefill, and fed response tokens, its decode steps), `rel_error_max`, `frac_identical` (the
share of tokens whose state is the same to the bit); `first_departing` (the first site where some token's state is
not: where the gap appears; at equal dtypes a layer at which it appears or jumps is a kernel difference) and
`growth` (e at `norm` over e of the stream after the first departing site's layer: how much depth amplifies it).
`profile`: e per site and position bucket (absolute position in the sequence).
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager, nullcontext
from collections.abc import Iterator

import torch
from torch import nn

from rlmm.mismatch.routing import decoder_layers, unwrap
from rlmm.policy.precision import dtype_name, to_dtype

COMPARISONS = ("kernels", "precision", "total")
# Inside each decoder layer, in the order they run: the attention's norm, the attention block's output (after o_proj,
# before the residual add), the MLP's norm and the MLP's (or MoE block's) output; the same submodule names in
# transformers' and vLLM's Llama / Qwen2 / Qwen3 / Qwen3-MoE layers.
PARTS = {"attn_norm": "input_layernorm", "attn": "self_attn", "mlp_norm": "post_attention_layernorm", "mlp": "mlp"}


def site_names(layers: int) -> list[str]:
    """`embed`, then per decoder layer i its parts `layer_<i>.<part>` and the stream after it, `layer_<i>`; `norm`."""
    inside = [[*(f"layer_{i}.{part}" for part in PARTS), f"layer_{i}"] for i in range(layers)]
    return ["embed", *(site for layer in inside for site in layer), "norm"]


def is_stream(site: str) -> bool:
    """Whether a site is the residual stream itself (embed, after a layer, the final norm), not a part of a layer."""
    return "." not in site


def layer_site_modules(layer: nn.Module, model_name: str) -> list[nn.Module]:
    """One decoder layer's part modules (`PARTS`, in order) and the layer itself."""
    missing = [name for name in PARTS.values() if not isinstance(getattr(layer, name, None), nn.Module)]
    if missing:
        raise ValueError(f"probe.layers: {model_name}'s decoder layer {type(layer).__name__} has no {missing[0]} (the "
                         f"Llama / Qwen layer layout: {', '.join(PARTS.values())})")
    return [*(getattr(layer, name) for name in PARTS.values()), layer]


def transformers_sites(model: nn.Module) -> list[nn.Module]:
    """A transformers causal LM's modules whose outputs are the sites (`site_names`, in order): its input embedding,
    each decoder layer's parts and the layer, the final norm of its base model (`base_model.norm`)."""
    inner = unwrap(model)
    norm = getattr(inner.base_model, "norm", None)
    layers = decoder_layers(inner)
    if norm is None or not layers:
        raise ValueError(f"probe.layers: {type(inner).__name__} has no decoder layers and final norm "
                         "(base_model.norm) to read the residual stream at")
    name = type(inner).__name__
    return [inner.get_input_embeddings(), *(m for layer in layers for m in layer_site_modules(layer, name)), norm]


@contextmanager
def recording_states(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Every forward's output at each site, inside: one [batch x tokens, hidden] tensor per site and forward, in
    call order (a forward: one per site, in model order), a copy, in the dtype computed."""
    calls: list[torch.Tensor] = []

    def hook(module, args, output):
        state = output[0] if isinstance(output, tuple) else output  # attention: (output, weights)
        calls.append(state.detach().reshape(-1, state.size(-1)).to("cpu", copy=True))

    handles = [site.register_forward_hook(hook) for site in transformers_sites(model)]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


RECORDING = "_rlmm_layer_rows"  # the trainer module's attribute holding an open `recorded_layer_states`


@contextmanager
def recorded_layer_states(model: nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    """{rollout row: [its tokens, sites, hidden]}: each row's residual stream at every site in the trainer's scoring
    forwards made inside (its own micro-batch layout: `layer_states_of` in rlmm/trainers/scoring.py's forward), in
    the dtype computed, the last forward of a row winning."""
    inner = unwrap(model)
    outer, rows = getattr(inner, RECORDING, None), {}
    setattr(inner, RECORDING, rows)
    try:
        yield rows
    finally:
        setattr(inner, RECORDING, outer)


@contextmanager
def layer_states_of(model: nn.Module, batch) -> Iterator[None]:
    """Around one scoring forward of `batch` (rlmm/trainers/packing.py's `Batch`): nothing, unless a
    `recorded_layer_states` is open on the model; then the forward's states are filed under the batch's rows."""
    rows = getattr(unwrap(model), RECORDING, None)
    if rows is None:
        yield
        return
    with recording_states(model) as calls:
        yield
    for row, states in zip(batch.rows, batch.per_row(torch.stack(calls, 1))):
        rows[row] = states


def trainer_states(trainer, rollouts) -> list[torch.Tensor]:
    """Each rollout row's [prompt + response, sites, hidden] states as the trainer computes them when it scores the
    rollouts (`trainer.logprobs`: its micro-batches, padding or packing, and replayed experts), as it computes now
    (under an `OpPrecisions` plan inside one)."""
    with recorded_layer_states(trainer.model) as rows:
        trainer.logprobs(rollouts)
    return [rows[i] for i in range(len(rollouts))]


def relative_errors(tested: list[torch.Tensor], reference: list[torch.Tensor], prompt_lengths: list[int]) -> dict:
    """Per compared token (a position the tested side computed: its state not NaN): e per site [tokens, sites],
    whether the state is the same to the bit [tokens, sites], its position and whether it is a prompt position."""
    errors, identical, positions, prompt = [], [], [], []
    for a, b, length in zip(tested, reference, prompt_lengths):
        if a.shape != b.shape:
            raise RuntimeError(f"probe.layers: a row's states are {tuple(a.shape)} on one side, {tuple(b.shape)} on "
                               "the other (positions x sites x hidden)")
        a, b = a.float(), b.float()
        computed = ~a.isnan().any(-1).any(-1)
        a, b = a[computed], b[computed]
        errors.append((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny))
        identical.append((a == b).all(-1))
        at = computed.nonzero().flatten()
        positions.append(at)
        prompt.append(at < length)
    return {"errors": torch.cat(errors), "identical": torch.cat(identical), "positions": torch.cat(positions),
            "prompt": torch.cat(prompt)}


def summarize(compared: dict, sites: list[str], bucket_size: int) -> dict:
    """One comparison's figures (module docstring) from `relative_errors`."""
    errors, identical, prompt = compared["errors"], compared["identical"], compared["prompt"]

    def mean(rows: torch.Tensor) -> list[float]:
        return errors[rows].mean(0).tolist() if rows.any() else [math.nan] * len(sites)

    departed = (~identical).any(0).nonzero().flatten().tolist()
    first = departed[0] if departed else None
    rel_error = mean(torch.ones_like(prompt))
    # The stream where the departure first shows: the layer the first departing part belongs to.
    stream = None if first is None else next(i for i in range(first, len(sites)) if is_stream(sites[i]))
    positions = compared["positions"]
    buckets = positions // bucket_size
    profile = [[errors[buckets == k, s].mean().item() if (buckets == k).any() else math.nan
                for k in range(int(buckets.max()) + 1 if len(buckets) else 0)] for s in range(len(sites))]
    return {"rel_error": rel_error, "rel_error_prompt": mean(prompt), "rel_error_response": mean(~prompt),
            "rel_error_max": errors.max(0).values.tolist() if len(errors) else [math.nan] * len(sites),
            "frac_identical": identical.double().mean(0).tolist() if len(errors) else [math.nan] * len(sites),
            "first_departing": None if first is None else sites[first],
            "growth": rel_error[-1] / rel_error[stream] if stream is not None and rel_error[stream] else math.nan,
            "profile": profile}


def check_layers(sampler_dtype: str | torch.dtype, trainer_dtype: str | torch.dtype, trainer) -> None:
    """Before any engine starts: the trainer can compute in the sampler's dtype: it does, or it is fp32 and its
    module holds the full weights (op attribution's plans cast them). The dtypes come as the config spells them
    (cfg.precision's `*_dtype`) or as torch dtypes."""
    from rlmm.mismatch.attribution import WHOLE_WEIGHTS

    sampler_dtype = to_dtype(sampler_dtype, "precision.sampler_dtype")
    trainer_dtype = to_dtype(trainer_dtype, "precision.trainer_dtype")
    if trainer_dtype not in (sampler_dtype, torch.float32):
        raise ValueError(f"probe.layers: compares the sampler with the trainer computing in the sampler's dtype: the "
                         f"sampler computes in {dtype_name(sampler_dtype)}, the trainer in {dtype_name(trainer_dtype)} "
                         "(the same dtype on both sides, or an fp32 trainer: precision=bf16_sampler_fp32_trainer)")
    reduced = trainer_dtype != sampler_dtype  # an fp32 trainer computes in the sampler's dtype through op attribution
    if reduced and (trainer.get("zero_stage", 0) == 3 or trainer.get("padding_free", False)
                    or trainer.get("fake_quantize", False)):
        raise ValueError(f"probe.layers: with an fp32 trainer and a {dtype_name(sampler_dtype)} sampler, "
                         f"{WHOLE_WEIGHTS}")


def compare_layers(trainer, rollouts, sampler_dtype: str | torch.dtype, bucket_size: int) -> dict:
    """The layer attribution of `rollouts` (captured with the sampler's `capturing_layers`): the module docstring's
    comparisons, {"sites", "dtype", "trainer_dtype", "tokens", "prompt_tokens", "response_tokens", "comparisons":
    {name: figures}, "bucket_size", "seconds"}."""
    from rlmm.mismatch.attribution import WHOLE_WEIGHTS, OpPrecisions, Plan

    started = time.perf_counter()
    if rollouts.layer_states is None:
        raise RuntimeError("probe.layers: the rollouts carry no layer states (sample inside capturing_layers)")
    low = to_dtype(sampler_dtype, "precision.sampler_dtype")
    trainer_dtype = next(unwrap(trainer.model).parameters()).dtype
    sites = site_names(len(decoder_layers(trainer.model)))
    if rollouts.layer_states and rollouts.layer_states[0].shape[1] != len(sites):
        raise RuntimeError(f"probe.layers: the sampler reported {rollouts.layer_states[0].shape[1]} sites, the trainer "
                           f"has {len(sites)}")
    lengths = [len(p) for p in rollouts.prompt_ids]
    reduced = trainer_dtype == torch.float32 and low != torch.float32  # the trainer computes fp32, the sampler less
    if reduced and not trainer.generates_in_place:
        raise ValueError(f"probe.layers: {WHOLE_WEIGHTS}")
    with OpPrecisions(trainer.model).precisions(Plan(low)) if reduced else nullcontext():
        at_low = trainer_states(trainer, rollouts)
    compared = {"kernels": relative_errors(rollouts.layer_states, at_low, lengths)}
    if reduced:
        fp32 = trainer_states(trainer, rollouts)
        compared["precision"] = relative_errors(at_low, fp32, lengths)
        compared["total"] = relative_errors(rollouts.layer_states, fp32, lengths)
    prompt = compared["kernels"]["prompt"]
    return {"sites": sites, "dtype": dtype_name(low), "trainer_dtype": str(trainer_dtype).removeprefix("torch."),
            "tokens": len(prompt), "prompt_tokens": int(prompt.sum()), "response_tokens": int((~prompt).sum()),
            "bucket_size": bucket_size,
            "comparisons": {name: summarize(c, sites, bucket_size) for name, c in compared.items()},
            "seconds": time.perf_counter() - started}


def layer_verdict(layers: dict) -> str:
    """Where the gap between the engines at equal dtypes appears (the first site, and inside its layer each part's
    error and share of identical tokens), and what depth does to it, in one line."""
    kernels, sites = layers["comparisons"]["kernels"], layers["sites"]
    first = kernels["first_departing"]
    if first is None:
        return f"layers: at {layers['dtype']} the sampler's hidden states equal the trainer's to the bit at every " \
               f"site ({layers['tokens']} tokens)"
    at = sites.index(first)
    prompt, response = kernels["rel_error_prompt"][at], kernels["rel_error_response"][at]
    where = ("at prompt and response positions" if prompt > 0 and response > 0 else
             "at response positions only: the decode steps" if response > 0 else "at prompt positions only: the prefill")
    layer = first.split(".")[0]
    inside = ", ".join(f"{site.split('.')[-1] if '.' in site else 'stream'} {kernels['rel_error'][i]:.2e} "
                       f"({kernels['frac_identical'][i]:.0%} same)"
                       for i, site in enumerate(sites) if site.split(".")[0] == layer)
    return (f"layers: at {layers['dtype']} the sampler first departs from the trainer at {first} ({where}; inside "
            f"{layer}: {inside}); the stream reaches {kernels['rel_error'][-1]:.2e} at the final norm, "
            f"{kernels['growth']:.3g}x its error after {layer}")


def print_layers(console, layers: dict) -> None:
    """Per stream site: each comparison's mean relative error (kernels split into prompt and response positions)
    and the share of tokens identical to the bit, then the verdict line."""
    from rich.table import Table

    comparisons = layers["comparisons"]
    table = Table(title=f"layers: the residual stream's relative error ||Δh|| / ||h||; kernels: sampler vs trainer, "
                        f"both {layers['dtype']} (at the sampler's prefill and decode positions, and the share of "
                        f"tokens identical to the bit); {layers['prompt_tokens']} prompt + {layers['response_tokens']} "
                        "response tokens", title_justify="left")
    columns = ["site", "kernels", "prefill", "decode", "same bits"]
    columns += [name for name in ("precision", "total") if name in comparisons]
    for column in columns:
        table.add_column(column, justify="left" if column == "site" else "right")
    kernels = comparisons["kernels"]
    for i, site in enumerate(layers["sites"]):
        if not is_stream(site):
            continue
        row = [site, *(f"{kernels[key][i]:.2e}" for key in ("rel_error", "rel_error_prompt", "rel_error_response")),
               f"{kernels['frac_identical'][i]:.1%}"]
        row += [f"{comparisons[name]['rel_error'][i]:.2e}" for name in ("precision", "total") if name in comparisons]
        table.add_row(*row)
    console.print(table)
    console.print(layer_verdict(layers))


def plot_layers(layers: dict, path, choices: dict) -> None:
    """layers.png: the relative error of the stream by depth (each comparison; kernels at prompt and at response
    positions, and each layer's parts as dots) and, for the kernels comparison, by depth and position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from rlmm.runtime.disk import writing

    sites, comparisons = layers["sites"], layers["comparisons"]
    stream = [i for i, site in enumerate(sites) if is_stream(site)]
    fig, (depth, heat) = plt.subplots(1, 2, figsize=(13, 4.5))
    kernels = comparisons["kernels"]
    pick = lambda values: [values[i] for i in stream]
    depth.plot(range(len(stream)), pick(kernels["rel_error_response"]), "o-", label="kernels, response positions (decode)")
    depth.plot(range(len(stream)), pick(kernels["rel_error_prompt"]), "o--", label="kernels, prompt positions (prefill)")
    for name, style in (("precision", "s-"), ("total", "^-")):
        if name in comparisons:
            depth.plot(range(len(stream)), pick(comparisons[name]["rel_error"]), style, label=f"{name}, all positions")
    # each layer's parts between the stream before it (x - 1) and after it (x)
    for x, i in enumerate(stream[1:], start=1):
        parts = [j for j in range(stream[x - 1] + 1, i)]
        if parts:
            depth.plot(np.linspace(x - 0.8, x - 0.2, len(parts)), [kernels["rel_error"][j] for j in parts], ".",
                       color="0.5", label="kernels, the layer's parts (attn_norm, attn, mlp_norm, mlp)" if x == 1 else None)
    depth.set_yscale("symlog", linthresh=1e-7)
    depth.set_xticks(range(len(stream)), pick(sites), rotation=60, fontsize=7)
    depth.set_ylabel("mean ||Δh|| / ||h||")
    depth.set_title("relative error of the hidden states by depth")
    depth.legend(fontsize=7)
    profile = np.array(pick(kernels["profile"]), dtype=float)
    shown = heat.imshow(np.log10(np.where(profile > 0, profile, np.nan)), aspect="auto", cmap="viridis",
                        origin="lower")
    heat.set_yticks(range(len(stream)), pick(sites), fontsize=7)
    heat.set_xlabel(f"position in the sequence (buckets of {layers['bucket_size']})")
    heat.set_title(f"kernels ({layers['dtype']} both): log10 relative error of the stream (white: identical)")
    fig.colorbar(shown, ax=heat)
    fig.suptitle("layer attribution: " + " ".join(f"{k}={v}" for k, v in choices.items()), fontsize=9)
    fig.tight_layout()
    with writing(path):
        fig.savefig(path, dpi=110)
    plt.close(fig)
