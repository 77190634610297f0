"""Where the precision part of the mismatch comes from: the trainer scores the same tokens with every op in the
low dtype (the sampler's), with every op in fp32 (the reference), and with one op class at a time raised to
fp32 or lowered to the low dtype, and each op class's share of the gap follows.

An op class (`OP_CLASSES`) is a set of modules or functions of the model that compute in one dtype:

    embeddings   the input embedding lookup
    rmsnorm      every RMSNorm (the layers' two, the final one, Qwen3's q/k norms)
    attn_proj    the q, k, v and o projections
    rope         the rotary embedding: its cos/sin and their application to q and k
    attention    scores, softmax and the weighted sum of v (the model's attention function)
    mlp          the MLP (gate, up, act, down); of an MoE block, the experts and their combination
    router       an MoE block's router (its logits and softmax; the top-k choice is on its output)
    linear_attention  a hybrid's recurrent layer (Gated DeltaNet: its projections, convolution, gates, the delta
                 rule over its state and its gated norm), the whole layer in one dtype (transformers' torch delta rule
                 itself runs in fp32 whatever it is given: the class moves its inputs' and weights' rounding)
    residual     the residual stream: the dtype the layers' sums and the hidden state between layers are in
    lm_head      the output projection (raised alone it is the trainer's fp32 LM head, bit for bit)

How a plan computes (`precisions`): each op class's parameters are the fp32 master values cast to its dtype,
its inputs are cast to its dtype on the way in, and its output is cast on the way out to the dtype of what
reads it: the residual stream's for the embedding, o_proj and the MLP (their outputs are added to it), the
plan's base dtype for every other op. So with every class in one dtype no cast does anything, and the model
computes exactly as a model loaded in that dtype (tests/test_attribution.py checks it bit for bit against
the bf16 and the fp32 trainer); an op "raised to fp32" in a bf16 plan takes bf16 inputs, computes in fp32 and
hands its consumer a bf16 result. The log-softmax over the vocabulary is not a class: rlmm's scoring (and
vLLM's sampler) compute it in fp32 whatever the model's dtype (rlmm/models/head.py).

Shares of the gap G (mean |δ| or KL k3 against the fp32 reference, `mismatch_metrics` with the plan in the
sampler's place), with G_low the all-low plan's:

    raised share of op   = (G_low - G_{low, op in fp32}) / G_low     the part of the gap raising op alone removes
    lowered share of op  = G_{fp32, op low} / G_low                   the part lowering op alone brings back

Were the ops' errors independent and small, each direction's shares would sum to 1; how far they are from it
(`interaction`) is how much the ops' rounding errors interact (they compound through the layers).
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from rlmm.mismatch.routing import ROUTERS, unwrap
from rlmm.models.transformers_internals import (attention_replaced, has_rotary_function, modeling_module,
                                                rotary_replaced)
from rlmm.policy.precision import dtype_name, to_dtype

OP_CLASSES = ("embeddings", "rmsnorm", "attn_proj", "rope", "attention", "mlp", "router", "linear_attention", "residual",
              "lm_head")
# The modules of a hybrid's recurrent layers (the decoder layer's attribute: Qwen3-Next's and Qwen3.5's Gated DeltaNet).
LINEAR_ATTENTION_MODULES = ("linear_attn",)
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
# The attention function a plan runs the model's own through (transformers' AttentionInterface).
ATTENTION_NAME = "rlmm_attribution"
GAPS = ("logprob_abs_diff_mean", "kl_k3")


@dataclass(frozen=True)
class Plan:
    """The dtype of each op class: `base` for every class not in `ops`."""

    base: torch.dtype
    ops: dict[str, torch.dtype] = field(default_factory=dict)

    def __post_init__(self):
        unknown = sorted(set(self.ops) - set(OP_CLASSES))
        if unknown:
            raise ValueError(f"attribution: unknown op class {unknown[0]!r} (allowed: {', '.join(OP_CLASSES)})")

    def dtype(self, op: str) -> torch.dtype:
        return self.ops.get(op, self.base)


def _cast(value, dtype: torch.dtype):
    """`value` with each floating-point tensor in it (a tensor, or a tuple/list/dict of them) in `dtype`."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value


@dataclass
class Site:
    """One module of an op class: its inputs are cast to its class's dtype, its output to that of what reads it
    (`feeds`: "residual" for what is added to the residual stream, "mlp" for a router's gates, "base" for the
    rest, "none" to leave it)."""

    module: nn.Module
    op: str
    feeds: str


class OpPrecisions:
    """A model (the trainer's module, fp32 parameters) that can compute under a `Plan` for the inside of
    `precisions(plan)`, and exactly as before after it (its parameters' fp32 values are restored bit for bit).

    Every floating-point parameter belongs to one op class; a parameter of a module rlmm cannot place is a
    one-line error naming it, not a parameter left in the wrong dtype."""

    def __init__(self, model: nn.Module):
        self.model = unwrap(model)
        low = sorted({dtype_name(p.dtype) for p in self.model.parameters() if p.dtype != torch.float32})
        if low:
            raise ValueError(f"attribution: the trainer's weights are {', '.join(low)}; the fp32 reference needs an "
                             f"fp32 trainer (precision.trainer_dtype=fp32)")
        self.sites = self._sites()
        self.parameter_ops = self._parameter_ops()
        self.modeling = modeling_module(self._decoder_layers()[0])
        self.has_rope = has_rotary_function(self.modeling)
        present = {s.op for s in self.sites}
        self.classes = tuple(op for op in OP_CLASSES
                             if (op not in ("router", "linear_attention") or op in present)
                             and (op != "rope" or self.has_rope))

    def _decoder_layers(self) -> list[nn.Module]:
        from rlmm.mismatch.routing import decoder_layers

        layers = decoder_layers(self.model)
        if not layers:
            raise ValueError(f"attribution: {type(self.model).__name__} has no transformers decoder layers")
        return layers

    def _sites(self) -> list[Site]:
        sites = [Site(self.model.get_input_embeddings(), "embeddings", "residual"),
                 Site(self.model.get_output_embeddings(), "lm_head", "none")]
        for name, module in self.model.named_modules():
            kind = type(module).__name__
            leaf = name.rsplit(".", 1)[-1]
            if kind.endswith("RMSNorm"):
                sites.append(Site(module, "rmsnorm", "base"))
            elif leaf in ATTENTION_PROJECTIONS:
                sites.append(Site(module, "attn_proj", "residual" if leaf == "o_proj" else "base"))
            elif leaf == "mlp":
                sites.append(Site(module, "mlp", "residual"))
            elif leaf in LINEAR_ATTENTION_MODULES:
                sites.append(Site(module, "linear_attention", "residual"))  # its output is added to the stream
            elif kind in ROUTERS:
                sites.append(Site(module, "router", "mlp"))  # its gates weigh the experts' outputs
            elif kind.endswith("RotaryEmbedding"):
                sites.append(Site(module, "rope", "none"))  # cos/sin come out in its dtype: the rope op's inputs
        return sites

    def _parameter_ops(self) -> dict[str, str]:
        """{parameter name: its op class}, by the innermost site that holds it."""
        owner = {}
        for site in sorted(self.sites, key=lambda s: s.op == "router"):  # a router inside an MLP wins
            for parameter in site.module.parameters():
                owner[id(parameter)] = site.op
        ops, unplaced = {}, []
        for name, parameter in self.model.named_parameters(remove_duplicate=False):
            if id(parameter) in owner:
                ops[name] = owner[id(parameter)]
            elif parameter.is_floating_point():
                unplaced.append(name)
        if unplaced:
            raise ValueError(f"attribution: no op class for parameter {unplaced[0]} ({len(unplaced)} unplaced; op "
                             f"classes: {', '.join(OP_CLASSES)})")
        return ops

    @contextmanager
    def precisions(self, plan: Plan) -> Iterator[None]:
        """The model computing under `plan` inside (module docstring); as it was after."""
        residual, base = plan.dtype("residual"), plan.base
        head = self.model.get_output_embeddings()
        embedding = self.model.get_input_embeddings()
        with ExitStack() as stack, torch.no_grad():
            if head.weight is embedding.weight:  # tied: each side its own copy for the inside (the same values)
                tied = head.weight
                head.weight = nn.Parameter(tied.detach().clone(), requires_grad=tied.requires_grad)
                stack.callback(setattr, head, "weight", tied)
            saved = {}
            for name, parameter in self.model.named_parameters():
                dtype = plan.dtype(self.parameter_ops[name])
                if parameter.dtype != dtype:
                    saved[parameter] = parameter.data
                    parameter.data = parameter.data.to(dtype)
            stack.callback(lambda: [setattr(p, "data", data) for p, data in saved.items()])
            for site in self.sites:
                dtype = plan.dtype(site.op)
                out = {"residual": residual, "base": base, "mlp": plan.dtype("mlp"), "none": None}[site.feeds]
                stack.enter_context(_cast_around(site.module, dtype, out))
            if self.has_rope:
                stack.enter_context(_patched_rope(self.modeling, plan.dtype("rope"), base))
            stack.enter_context(_attention_in(self.model, plan.dtype("attention"), base))
            yield


@contextmanager
def _cast_around(module: nn.Module, dtype: torch.dtype, out: torch.dtype | None):
    """Hooks on `module`: its floating-point inputs cast to `dtype`, its output to `out` (None: as it comes)."""
    def before(_, args, kwargs):
        return _cast(args, dtype), _cast(kwargs, dtype)

    handles = [module.register_forward_pre_hook(before, with_kwargs=True)]
    if out is not None:
        handles.append(module.register_forward_hook(lambda _, args, output: _cast(output, out)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _patched_rope(modeling, dtype: torch.dtype, base: torch.dtype):
    """The modeling module's `apply_rotary_pos_emb` computing in `dtype`, its q and k handed on in `base`."""
    def wrap(original):
        def apply(q, k, cos, sin, *args, **kwargs):
            q, k = original(*_cast((q, k, cos, sin), dtype), *args, **kwargs)
            return _cast(q, base), _cast(k, base)
        return apply

    return rotary_replaced(modeling, wrap)


def _attention_in(model: nn.Module, dtype: torch.dtype, base: torch.dtype):
    """The model's attention function (its own: sdpa, eager, ...) computing in `dtype`: q, k, v (and a float mask)
    cast to it, the output handed on in `base`."""
    def wrap(function):
        def attention(module, query, key, value, attention_mask, *args, **kwargs):
            output, weights = function(module, *_cast((query, key, value, attention_mask), dtype), *args, **kwargs)
            return _cast(output, base), weights
        return attention

    return attention_replaced(model, ATTENTION_NAME, wrap)


WHOLE_WEIGHTS = ("the trainer's module must hold the full weights: one rank of trainer=deepspeed (ZeRO-0/1/2) or "
                 "trainer=torch, without trainer.padding_free or trainer.fake_quantize")


def check_attribution(sampler_dtype: str | torch.dtype, trainer_dtype: str | torch.dtype, trainer,
                      option: str = "probe.attribution") -> None:
    """Before any engine starts: a 16-bit sampler dtype to attribute, the fp32 trainer as the reference, and a
    trainer whose module holds the full weights (ZeRO-3 does not; packed rows change the attention); `option`
    names the setting that asked for it in the message. The dtypes come as the config spells them (cfg.precision's
    `*_dtype`) or as torch dtypes."""
    if to_dtype(sampler_dtype, "precision.sampler_dtype") == torch.float32:
        raise ValueError(f"{option}: the sampler computes in fp32, so there is no low-precision gap to "
                         "attribute (a bf16 or fp16 sampler: precision=bf16_sampler_fp32_trainer)")
    trainer_dtype = to_dtype(trainer_dtype, "precision.trainer_dtype")
    if trainer_dtype != torch.float32:
        raise ValueError(f"{option}: the fp32 reference is the trainer in fp32, got "
                         f"precision.trainer_dtype={dtype_name(trainer_dtype)} (precision=bf16_sampler_fp32_trainer)")
    if trainer.get("zero_stage", 0) == 3 or trainer.get("padding_free", False) or trainer.get("fake_quantize", False):
        raise ValueError(f"{option}: {WHOLE_WEIGHTS}")


def attribute(trainer, rollouts, low: str | torch.dtype, ratio_cap: float) -> dict:
    """The op-class attribution of the `low`-dtype gap on `rollouts` (module docstring), scored by `trainer` (its
    module in fp32, holding the full weights): {"dtype", "classes", "all_low": the gap of every op low,
    "ops": {op: {"raised": gap, "lowered": gap, "share_raised": {measure: share}, "share_lowered": ...}},
    "interaction": {direction: {measure: Σ shares - 1}}, "forwards", "seconds"}; gaps are `mismatch_metrics`
    of the plan against the fp32 reference (the trainer as it is)."""
    from rlmm.mismatch.metrics import mismatch_metrics

    started = time.perf_counter()
    dtype = to_dtype(low, "probe.attribution")
    if not trainer.generates_in_place:
        raise ValueError(f"probe.attribution: {WHOLE_WEIGHTS}")
    model = OpPrecisions(trainer.model)
    reference = trainer.logprobs(rollouts)
    _, mask = rollouts.padded_sampler_logprobs()

    def gap(plan: Plan) -> dict[str, float]:
        with model.precisions(plan):
            scored = trainer.logprobs(rollouts)
        measures = mismatch_metrics(reference, scored, mask, ratio_cap=ratio_cap)
        return {key: measures[key] for key in GAPS}

    all_low = gap(Plan(dtype))
    ops = {}
    for op in model.classes:
        raised, lowered = gap(Plan(dtype, {op: torch.float32})), gap(Plan(torch.float32, {op: dtype}))
        ops[op] = {"raised": raised, "lowered": lowered,
                   "share_raised": {k: share(all_low[k] - raised[k], all_low[k]) for k in GAPS},
                   "share_lowered": {k: share(lowered[k], all_low[k]) for k in GAPS}}
    interaction = {direction: {k: sum(o[f"share_{direction}"][k] for o in ops.values()) - 1 for k in GAPS}
                   for direction in ("raised", "lowered")}
    return {"dtype": dtype_name(dtype), "reference": dtype_name(torch.float32), "classes": list(model.classes), "all_low": all_low, "ops": ops,
            "interaction": interaction, "forwards": 2 + 2 * len(model.classes),
            "tokens": int(mask.sum()), "seconds": time.perf_counter() - started}


def share(part: float, whole: float) -> float:
    """part / whole, NaN where the whole gap is 0 (nothing to attribute)."""
    return part / whole if whole else float("nan")


def print_attribution(console, attribution: dict) -> None:
    """The op-class attribution as a table: each class's gap and share, raised alone and lowered alone."""
    from rich.table import Table

    from rlmm.runtime.formatting import format_number

    low, all_low = attribution["dtype"], attribution["all_low"]
    table = Table(title=f"attribution: the {low} gap against fp32 (every op {low}: mean |δ| "
                        f"{format_number(all_low['logprob_abs_diff_mean'])}, KL k3 {format_number(all_low['kl_k3'])}; "
                        f"{attribution['tokens']} tokens)", title_justify="left")
    for column in ("op class", "raised alone: share of mean |δ|", "of KL k3", "lowered alone: share of mean |δ|",
                   "of KL k3"):
        table.add_column(column, justify="left" if column == "op class" else "right")
    for op, parts in attribution["ops"].items():
        table.add_row(op, *(f"{parts[f'share_{d}'][k]:+.1%}" for d in ("raised", "lowered") for k in GAPS))
    interaction = attribution["interaction"]
    table.add_row("Σ shares - 1 (interaction)", *(f"{interaction[d][k]:+.1%}" for d in ("raised", "lowered")
                                                  for k in GAPS))
    console.print(table)


def plot_attribution(attribution: dict, path, choices: dict) -> None:
    """attribution.png: per op class, the share of the gap raising it alone removes and lowering it alone brings
    back, for mean |δ| and KL k3."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rlmm.runtime.disk import writing

    ops = list(attribution["ops"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.45 * len(ops) + 1.8), sharey=True)
    at = range(len(ops))
    for ax, key, label in zip(axes, GAPS, ("mean |δ|", "KL k3")):
        for offset, direction, text in ((-0.2, "raised", "raised to fp32 alone: share removed"),
                                        (0.2, "lowered", f"lowered to {attribution['dtype']} alone: share brought")):
            ax.barh([y + offset for y in at], [attribution["ops"][op][f"share_{direction}"][key] for op in ops],
                    height=0.4, label=text)
        ax.axvline(0, color="0.3", linewidth=0.8)
        ax.set_yticks(list(at), ops)
        ax.invert_yaxis()
        ax.set_xlabel(f"share of the all-{attribution['dtype']} gap in {label}")
        ax.set_title(f"{label}: every op {attribution['dtype']} = {attribution['all_low'][key]:.3g}")
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle("op-class attribution: " + " ".join(f"{k}={v}" for k, v in choices.items()), fontsize=9)
    fig.tight_layout()
    with writing(path):
        fig.savefig(path, dpi=110)
    plt.close(fig)


class TrainingAttribution:
    """`train.attribution.every=N`: the op-class attribution (`attribute`) of the gap at the sampler's dtype every
    N steps of `rlmm train`, on the same held-out prompts each time (the sampler's greedy answers with its
    current weights, so no random draw of the run's is taken), logged as attribution/<op>/share_raised|
    share_lowered/<G> and attribution/all_low/<G>, with the weight and logit statistics that could explain a
    growing gap (`model_statistics`). Rank 0 measures, as it evaluates (its sampler and trainer replica; the
    other ranks do not wait for it in a collective)."""

    def __init__(self, c, examples: list, every: int, sampler_dtype: str | torch.dtype, ratio_cap: float):
        self.c, self.every, self.ratio_cap = c, every, ratio_cap
        self.dtype = to_dtype(sampler_dtype, "precision.sampler_dtype")
        self.prompt_ids = [c.prompts.ids(e) for e in examples]

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def __call__(self) -> dict[str, float]:
        rollouts = self.c.sampler.generate(self.prompt_ids, greedy=True)
        result = attribute(self.c.trainer, rollouts, self.dtype, self.ratio_cap)
        metrics = {f"attribution/all_low/{k}": v for k, v in result["all_low"].items()}
        for op, parts in result["ops"].items():
            for part in ("share_raised", "share_lowered"):
                metrics.update({f"attribution/{op}/{part}/{k}": v for k, v in parts[part].items()})
        metrics["perf/attribution_seconds"] = result["seconds"]
        return metrics | model_statistics(self.c.trainer.model, rollouts)


class NoTrainingAttribution:
    """`train.attribution.every=0` (the default): nothing measured, nothing logged, the run the same to the bit."""

    def due(self, step: int) -> bool:
        return False


def model_statistics(model: nn.Module, rollouts) -> dict[str, float]:
    """What could explain a gap that grows in training (Liu et al. 2025 and the Precision-RL authors report it
    does, the cause open): per decoder layer the RMS and the largest |w| of its weights (`weights/layer_<i>/rms`,
    `max_abs`), the same of the LM head, and on the given rollouts (one row at a time, so no padding enters)
    the largest pre-softmax attention score over layers, heads and allowed positions
    (`logits/attention_max`) and the LM head's logit range max_v z_v - min_v z_v, averaged over positions
    (`logits/lm_head_range_mean`) and its largest (`logits/lm_head_range_max`)."""
    from rlmm.mismatch.routing import decoder_layers

    inner = unwrap(model)
    stats = {}
    for index, layer in enumerate(decoder_layers(inner)):
        weights = torch.cat([p.detach().float().flatten() for p in layer.parameters()])
        stats[f"weights/layer_{index}/rms"] = weights.square().mean().sqrt().item()
        stats[f"weights/layer_{index}/max_abs"] = weights.abs().max().item()
    head = inner.get_output_embeddings().weight.detach().float()
    stats["weights/lm_head/rms"], stats["weights/lm_head/max_abs"] = head.square().mean().sqrt().item(), head.abs().max().item()
    ranges, largest = [], [float("-inf")]
    device = head.device
    with torch.no_grad(), _attention_scores(inner, largest):
        for prompt, response in zip(rollouts.prompt_ids, rollouts.response_ids):
            ids = torch.tensor([list(prompt) + list(response)], device=device)
            logits = inner(input_ids=ids, use_cache=False).logits.float()[0]
            ranges.append(logits.max(-1).values - logits.min(-1).values)
    ranges = torch.cat(ranges)
    stats |= {"logits/attention_max": largest[0], "logits/lm_head_range_mean": ranges.mean().item(),
              "logits/lm_head_range_max": ranges.max().item()}
    return stats


def _attention_scores(model: nn.Module, largest: list[float]):
    """The model's attention function as it is, after noting in `largest[0]` the largest causal pre-softmax score
    q·k × scaling of each call (one unpadded row a call: every key at or before a query is allowed)."""
    def wrap(function):
        def attention(module, query, key, value, attention_mask, *args, scaling=None, **kwargs):
            q, k = query.float(), key.float()
            k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)  # grouped-query attention: each q head's k
            scores = q @ k.transpose(-1, -2) * (scaling if scaling is not None else q.size(-1) ** -0.5)
            allowed = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
            largest[0] = max(largest[0], scores.masked_fill(~allowed, float("-inf")).max().item())
            return function(module, query, key, value, attention_mask, *args, scaling=scaling, **kwargs)
        return attention

    return attention_replaced(model, ATTENTION_NAME + "_scores", wrap)
