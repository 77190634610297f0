"""Mixture-of-experts routing on the trainer's side: record which experts each forward chose, and replay
given ones (routing replay, Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training
and Inference Routers", arXiv 2510.11370).

In an MoE model the sampler and the trainer can send the same token to different experts: a router's top-k
over nearly tied logits flips under another kernel or precision, and the token then goes through other
weights altogether. `routing=` (conf/routing/) chooses what the trainer does about it:

- `none`: the trainer routes every token itself (what rlmm did before, and what PPO assumes is harmless);
- `r3` (Rollout Routing Replay): every forward of the policy (π_old's scoring and the update) sends each
  token to the experts the *sampler* chose for it (`Rollouts.routed_experts`, handed to the trainer as
  `Rollouts.replayed_experts`); tokens the sampler did not
  route (the last response token, prefix-cached prompt tokens) keep the trainer's own;
- `r2` (vanilla routing replay, the paper's baseline): the update sends each token to the experts the
  *trainer* chose when it scored π_old, so PPO's ratio π_θ/π_old compares the same experts; the sampler's
  routing is not used.

How a replay computes the gates (`_replayed`): the router's own logits z (so the router still gets a
gradient), its softmax p = softmax(z) in float32, and the replayed experts E (k of them):

    g_e = p_e / Σ_{e' ∈ E} p_{e'}  for e ∈ E     (the model normalises its top-k: norm_topk_prob, Mixtral)
    g_e = p_e                        for e ∈ E     (it does not)

With E the router's own top-k this is exactly the router's output, bit for bit (the same float32 values
gathered and divided the same way), which tests/test_routing.py checks for values and gradients. The paper
computes the gates as softmax over the logits masked to E: for a model that normalises its top-k that is
the same number (p_e / Σ_E p = exp z_e / Σ_E exp z); for one that does not (norm_topk_prob false, e.g.
Qwen2-MoE's default) the paper's gates sum to 1 and ours are the unnormalised p_e the model was trained
with: rlmm keeps the model's own gate function and replays only the choice of experts.

How the expert ids reach the routers: as a keyword argument of the model call (`REPLAY_KWARG`), which
transformers hands to every decoder layer; a pre-hook on each decoder layer takes its MoE layer's slice out
(the layer never sees it) and gives it to that layer's router. Passing it as an argument, not as state set
before the call, keeps gradient checkpointing right: transformers' recomputation in the backward pass calls
the layer again with the same keyword arguments, so the recomputed forward replays the same experts.

Supported routers: transformers' softmax-then-top-k routers whose forward returns (logits, gates, ids)
(`ROUTERS`: Qwen3-MoE, Qwen2-MoE, Qwen3-Next, OLMoE, Mixtral). Another MoE architecture is a one-line error naming its
router class, not a model whose routing is silently left alone.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import nn

from rlmm.policy.rollouts import NO_ROUTE

# The keyword argument that carries the experts to replay through the model call to its decoder layers.
REPLAY_KWARG = "rlmm_routed_experts"
# Router classes whose forward is `probs = softmax(z.float()); gates, ids = topk(probs, k); [normalise];
# [cast to z's dtype]`, read in transformers 5.19: {class name: (normalises the top-k: True, False, or the
# router's `norm_topk_prob`; casts the gates back to the logits' dtype)}.
ROUTERS = {
    "Qwen3MoeTopKRouter": ("norm_topk_prob", True),
    "Qwen2MoeTopKRouter": ("norm_topk_prob", True),
    "Qwen3NextTopKRouter": ("norm_topk_prob", True),  # Qwen3-Next's sparse block (model=tiny_hybrid)
    "OlmoeTopKRouter": ("norm_topk_prob", True),
    "MixtralTopKRouter": (True, False),
}
ID_DTYPE = torch.int16  # expert ids kept between forwards: 2 bytes each (up to 32767 experts)


@dataclass(frozen=True)
class MoEShape:
    """How a model routes: its MoE layers (in model order), experts per layer and experts per token."""

    layers: int
    experts: int
    top_k: int
    # Whether the last MoE layer is the model's last decoder layer: then its output at a position feeds only
    # that position's next-token logits (no later attention reads it).
    last_layer_is_final: bool

    def bytes_per_token(self) -> int:
        """What one token's routing costs kept as `ID_DTYPE` ids: layers x top-k x 2 bytes."""
        return self.layers * self.top_k * torch.iinfo(ID_DTYPE).bits // 8


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside a DeepSpeed engine (`.module`), or the model itself."""
    return getattr(model, "module", model)


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers in model order ([] for a dense model); a router of an architecture rlmm cannot
    replay (not in `ROUTERS`) is a one-line error naming it."""
    found = []
    for name, module in unwrap(model).named_modules():
        kind = type(module).__name__
        if kind in ROUTERS or kind.removeprefix("FSDP") in ROUTERS:
            found.append(module)
        elif kind.endswith("TopKRouter") or kind.endswith("Router"):
            raise ValueError(f"routing: {name} is a {kind}, whose gates rlmm cannot replay (supported routers: "
                             f"{', '.join(ROUTERS)})")
    return found


def moe_shape(model: nn.Module) -> MoEShape | None:
    """The model's `MoEShape`, or None for a dense model."""
    found = routers(model)
    if not found:
        return None
    layers = decoder_layers(model)
    return MoEShape(layers=len(found), experts=found[0].num_experts, top_k=found[0].top_k,
                    last_layer_is_final=bool(layers) and layer_of(found[-1], layers) is layers[-1])


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers in model order (transformers' `GradientCheckpointingLayer`s)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in unwrap(model).modules() if isinstance(m, GradientCheckpointingLayer)]


def layer_of(module: nn.Module, layers: list[nn.Module]) -> nn.Module | None:
    """The decoder layer among `layers` that holds `module` (None: none does)."""
    return next((layer for layer in layers if any(child is module for child in layer.modules())), None)


class RoutingHooks:
    """Hooks on one model's routers (and the decoder layers holding them) that record each forward's own
    choices and replay given ones. Installed once per model (`hooks_of`), they do nothing unless a forward
    carries `REPLAY_KWARG` or a `recording()` is open."""

    def __init__(self, model: nn.Module):
        self.routers = routers(model)
        if not self.routers:
            raise ValueError(f"routing: {type(unwrap(model)).__name__} has no mixture-of-experts router "
                             f"(routing=r2 and r3 need an MoE model such as model=tiny_moe; a dense model takes "
                             f"routing=none)")
        self.shape = moe_shape(model)
        self._replay: dict[int, torch.Tensor | None] = {}  # router index -> the ids its next forward replays
        self._records: list[torch.Tensor] | None = None  # the open recording's own ids, one per router call
        self.rows: dict[int, torch.Tensor] | None = None  # an open `recorded_routing`: rollout row -> its routing
        layers = decoder_layers(model)
        for index, router in enumerate(self.routers):
            layer = layer_of(router, layers)
            if layer is None:
                raise ValueError(f"routing: router {index} ({type(router).__name__}) is in no decoder layer")
            layer.register_forward_pre_hook(self._layer_pre_hook(index), with_kwargs=True)
            router.register_forward_hook(self._router_hook(index))

    def _layer_pre_hook(self, index: int):
        def hook(module, args, kwargs):
            experts = kwargs.pop(REPLAY_KWARG, None)
            self._replay[index] = None if experts is None else experts[..., index, :].reshape(-1, experts.size(-1))
            return args, kwargs
        return hook

    def _router_hook(self, index: int):
        def hook(router, args, output):
            logits, gates, own = output
            if self._records is not None:
                self._records.append(own.detach().to(ID_DTYPE).cpu())
            replay = self._replay.pop(index, None)
            if replay is None:
                return None
            return logits, *_replayed(router, logits, own, replay.to(own.device))
        return hook

    @contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        """Collect the own top-k ids ([tokens of the forward, top-k] int16, CPU) of every router call made
        inside, in call order (one forward: one entry per MoE layer, in layer order)."""
        outer, self._records = self._records, []
        try:
            yield self._records
        finally:
            self._records = outer


def _replayed(router: nn.Module, logits: torch.Tensor, own: torch.Tensor,
              replay: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gates, ids) of a router made to send each token to `replay`'s experts ([tokens, k] long; a token whose
    ids are NO_ROUTE keeps its own `own`), the gates from the router's own logits (module docstring)."""
    normalise, cast = ROUTERS[type(router).__name__.removeprefix("FSDP")]
    if isinstance(normalise, str):
        normalise = bool(getattr(router, normalise))
    ids = torch.where((replay != NO_ROUTE).all(-1, keepdim=True), replay.long(), own)
    probs = torch.softmax(logits.float(), dim=-1)
    gates = probs.gather(-1, ids)
    if normalise:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return (gates.to(logits.dtype) if cast else gates), ids


def hooks_of(model: nn.Module, install: bool = True) -> RoutingHooks | None:
    """The model's `RoutingHooks`, installed on first use (`install` False: None where none are installed)."""
    inner = unwrap(model)
    hooks = getattr(inner, "_rlmm_routing_hooks", None)
    if hooks is None and install:
        hooks = RoutingHooks(inner)
        inner._rlmm_routing_hooks = hooks
    return hooks


@contextmanager
def routed_forward(model: nn.Module, batch, device: torch.device) -> Iterator[dict]:
    """Around one forward of `model` on `batch` (rlmm/trainers/packing.py's `Batch`): yields the keyword
    arguments that make the forward replay `batch.routing` ({} when it carries none), and files the forward's
    own choices under the batch's rollout rows when a `recorded_routing` is open."""
    hooks = hooks_of(model, install=batch.routing is not None)
    if hooks is None or (batch.routing is None and hooks.rows is None):
        yield {}
        return
    replay = {} if batch.routing is None else {REPLAY_KWARG: batch.routing.to(device)}
    if hooks.rows is None:
        yield replay
        return
    with hooks.recording() as calls:
        yield replay
    if len(calls) != hooks.shape.layers:
        raise RuntimeError(f"routing: a forward made {len(calls)} router calls, expected one per MoE layer "
                           f"({hooks.shape.layers})")
    for row, routed in zip(batch.rows, batch.per_row(torch.stack(calls, 1))):
        hooks.rows[row] = routed


@contextmanager
def recorded_routing(model: nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    """{rollout row: [its tokens, MoE layers, top-k] int16}: the experts the model itself chose for each
    position in the policy forwards made inside (π_old's scoring), the last forward of a row winning."""
    hooks = hooks_of(model)
    outer, hooks.rows = hooks.rows, {}
    try:
        yield hooks.rows
    finally:
        hooks.rows = outer


# Where a Hugging Face config counts its experts: Qwen2-MoE, Qwen3-MoE, OLMoE (num_experts); Mixtral, GPT-OSS
# (num_local_experts); DeepSeek-V2/V3 (n_routed_experts); ERNIE-4.5-MoE (moe_num_experts).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


class RoutingReplay:
    """What the RL step does with an MoE model's routing: `routing=none|r2|r3` (conf/routing/, one class each;
    the module docstring). The step asks it which rollouts π_old is scored on (`scored`) and which the updates
    train on (`trained`), and for the routing/ metrics of the step. This base class is the routing of
    `routing=none` in every respect but its name: the trainer routes every token itself (`TrainerRouting`).

    Args:
        measure: the sampler returns its experts and the trainer records its own, for the routing/ metrics
            (an MoE model only; r3 captures the sampler's experts whatever this says).
        compare: score the rollouts a second time with the other routing and log the mismatch both ways.
    """

    name = "none"  # as conf/routing/ spells it, in messages
    replays = False  # whether a policy forward replays experts (r2, r3: only an MoE model can)
    replays_own_routing = False  # r2: an update whose forwards did not score π_old must be given its routing

    def __init__(self, measure: bool, compare: bool):
        for key, value in (("measure", measure), ("compare", compare)):
            if not isinstance(value, bool):
                raise ValueError(f"routing.{key}: must be true or false, got {value!r}")
        self.measure, self.compare = measure, compare
        self.shape: MoEShape | None = None

    @property
    def capture(self) -> bool:
        """Whether the sampler is to return the experts it chose (`Rollouts.routed_experts`)."""
        return self.measure or self.compare

    def check_checkpoint(self, model_path: str) -> None:
        """Before any engine starts: a replay needs an MoE model, read from the checkpoint's config.json (its
        count of experts under any of EXPERT_COUNT_KEYS; `bind` checks the built module again)."""
        if not self.replays:
            return
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_path)
        if not any((getattr(config, key, 0) or 0) > 0 for key in EXPERT_COUNT_KEYS):
            self._refuse_dense((getattr(config, "architectures", None) or [config.model_type])[0])

    def _refuse_dense(self, model_name: str) -> None:
        raise ValueError(f"routing={self.name}: the model ({model_name}) has no mixture-of-experts router; routing "
                         f"replay needs an MoE model such as model=tiny_moe (a dense model takes routing=none)")

    def bind(self, model: nn.Module) -> RoutingReplay:
        """Check the trainer's model against the routing (a replay needs an MoE model) and install its hooks."""
        self.shape = moe_shape(model)
        if self.shape is None and self.replays:
            self._refuse_dense(type(unwrap(model)).__name__)
        if self.shape is not None:
            hooks_of(model)
        return self

    def scored(self, rollouts):
        """The rollouts as π_old's scoring forward takes them: no experts to replay (r3 replays the sampler's)."""
        return replace(rollouts, replayed_experts=None)

    def trained(self, rollouts, own: dict[int, torch.Tensor] | None):
        """The rollouts the updates train on (`own`: the experts π_old's scoring chose, from `recorded`): as
        π_old scored them (r2 replays `own`)."""
        return self.scored(rollouts)

    @contextmanager
    def recorded(self, model: nn.Module) -> Iterator[dict[int, torch.Tensor] | None]:
        """The trainer's own experts per rollout row, recorded in the policy forwards made inside, when the
        model is MoE and the run measures or replays them (else None)."""
        if self.shape is None or not (self.measure or self.compare or self.replays_own_routing):
            yield None
            return
        with recorded_routing(model) as own:
            yield own

    def compared(self, trainer, rollouts, trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                 mask: torch.Tensor, ratio_cap: float) -> dict[str, float]:
        """The step's mismatch metrics (rlmm/mismatch/metrics.py) both ways on the same rollouts (`scored_both_ways`):
        routing/replayed/* and routing/own/*."""
        from rlmm.mismatch.metrics import mismatch_metrics

        if self.shape is None or rollouts.routed_experts is None:
            return {}
        ways = scored_both_ways(trainer, self.scored(rollouts), trainer_logprobs)
        return {f"routing/{way}/{k}": v for way, lp in ways.items()
                for k, v in mismatch_metrics(lp, sampler_logprobs, mask, ratio_cap=ratio_cap).items()}

    def metrics(self, sampler: list[torch.Tensor] | None, own: dict[int, torch.Tensor] | None) -> dict[str, float]:
        """routing/ metrics of the step (`routing_disagreement`), {} without both sides' experts."""
        if sampler is None or own is None or not self.measure:
            return {}
        return routing_disagreement(sampler, [own[i] for i in range(len(sampler))])


class TrainerRouting(RoutingReplay):
    """`routing=none`: the trainer routes every token itself, in π_old's scoring and in the update (what PPO
    assumes is harmless); with an MoE model the run still measures how often its routing differs from the
    sampler's."""


class OwnRoutingReplay(RoutingReplay):
    """`routing=r2`, vanilla routing replay (the baseline of Ma et al. 2025): the update sends each token to the
    experts the trainer chose when it scored π_old, so the ratio π_θ / π_old compares the same experts; the
    sampler's routing is only measured."""

    name, replays, replays_own_routing = "r2", True, True

    def trained(self, rollouts, own: dict[int, torch.Tensor] | None):
        return replace(rollouts, replayed_experts=[own[i] for i in range(len(rollouts))])


class SamplerRoutingReplay(RoutingReplay):
    """`routing=r3`, Rollout Routing Replay (Ma et al. 2025): every policy forward (π_old's scoring and the
    update) sends each token to the experts the sampler chose for it, so the sampler always captures them."""

    name, replays = "r3", True

    @property
    def capture(self) -> bool:
        return True

    def scored(self, rollouts):
        if rollouts.routed_experts is None:
            raise ValueError("routing=r3: the sampler returned no routing (its engine cannot capture it: "
                             "docs/routing.md)")
        return replace(rollouts, replayed_experts=rollouts.routed_experts)


def scored_both_ways(trainer, scored, logprobs: torch.Tensor) -> dict[str, torch.Tensor]:
    """{"replayed": log-probs with the sampler's experts replayed, "own": with the trainer's own routing} of the
    rollouts `scored` (as π_old's scoring took them, with or without `replayed_experts`), one of them the
    scoring already made (`logprobs`), the other one more no-grad `trainer.logprobs`."""
    replayed_now = scored.replayed_experts is not None
    other = trainer.logprobs(replace(scored, replayed_experts=None if replayed_now else scored.routed_experts))
    return {"replayed": logprobs if replayed_now else other, "own": other if replayed_now else logprobs}


def routing_disagreement(sampler: list[torch.Tensor], trainer: list[torch.Tensor]) -> dict[str, float]:
    """How often two sides' routings of the same tokens differ (docs/metrics.md#routing), over the (position,
    MoE layer) decisions both sides made (not NO_ROUTE) at every position but a row's last; each row is
    [tokens, layers, top-k]. A decision
    differs when its two top-k *sets* differ (the order within a top-k changes no expert's input):

        frac_decisions_differ   = Σ_{t,l} 1[S_{t,l} ≠ T_{t,l}] / #decisions          (and _layer_{l} per layer)
        frac_tokens_differ      = Σ_t 1[∃ l: S_{t,l} ≠ T_{t,l}] / #tokens            (at least one layer)
        expert_overlap          = Σ_{t,l} |S_{t,l} ∩ T_{t,l}| / (k · #decisions)

    Ma et al. 2025 report about 10% of decisions and 94% of tokens differing (Qwen3-30B-A3B, per forward).
    """
    # A row's last position feeds no scored log-prob (its output would predict past the response, and no later
    # position attends to it), so its routing changes nothing the step uses: not counted.
    s, t = torch.cat([r[:-1] for r in sampler]).long(), torch.cat([r[:-1] for r in trainer]).long()
    if s.shape != t.shape:
        raise ValueError(f"routing: the sampler's routing has shape {tuple(s.shape)}, the trainer's "
                         f"{tuple(t.shape)} (the same tokens, MoE layers and top-k expected)")
    differ, valid = decisions_differ(s, t)
    overlap = (s[..., :, None] == t[..., None, :]).any(-1).sum(-1)  # [tokens, layers]: |S ∩ T|
    decisions, tokens = valid.sum().clamp(min=1), valid.any(-1).sum().clamp(min=1)
    out = {"frac_decisions_differ": (differ.sum() / decisions).item(),
           "frac_tokens_differ": (differ.any(-1).sum() / tokens).item(),
           "expert_overlap": ((overlap * valid).sum() / (decisions * s.size(-1))).item()}
    for layer in range(s.size(1)):
        out[f"frac_decisions_differ_layer_{layer}"] = (differ[:, layer].sum() / valid[:, layer].sum().clamp(min=1)).item()
    return {f"routing/{k}": v for k, v in out.items()}


def decisions_differ(s: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For two sides' routings of the same positions ([positions, layers, top-k]): which (position, layer)
    decisions differ as top-k *sets*, among those both sides made (`valid`: neither is NO_ROUTE)."""
    valid = (s != NO_ROUTE).all(-1) & (t != NO_ROUTE).all(-1)
    return (s.sort(-1).values != t.sort(-1).values).any(-1) & valid, valid


def differing_decisions(sampler: list[torch.Tensor], trainer: list[torch.Tensor], prompt_lengths: list[int],
                        last_layer_is_final: bool) -> dict[str, int]:
    """How many (position, MoE layer) decisions differ between the two sides (counted as in
    `routing_disagreement`), and how many of them can move a scored log-prob. A decision at position t < P - 1
    (a prompt token's, P the prompt length) in the last MoE layer, when that is the model's last decoder
    layer, cannot: its output only predicts prompt token t + 1, and no later position's attention reads it.
    Every other decision can (through attention, or as a response prediction). When none can, replaying the
    sampler's routing changes no scored log-prob, and the share of the gap it removes is 0 by construction."""
    differ = reaching = 0
    for s, t, prompt in zip(sampler, trainer, prompt_lengths):
        rows, _ = decisions_differ(s[:-1].long(), t[:-1].long())  # [positions, layers]
        differ += int(rows.sum())
        if last_layer_is_final:
            rows[: max(prompt - 1, 0), -1] = False
        reaching += int(rows.sum())
    return {"differing_decisions": differ, "differing_decisions_reaching_scores": reaching}
