"""Values an in-process vLLM engine computes for each token, filed under the rollout row and position they belong
to: the experts a router chose (routing replay, rlmm/samplers/vllm_routing.py) and the residual stream after
every decoder layer (the probe's layer attribution, `HookedLayerStates`).

vLLM's batch is flat: one forward holds all scheduled tokens of all requests in one row axis, chunks of prompts
beside single decode tokens. `TokenCapture` maps each forward back through the engine calls
rlmm/samplers/vllm_internals.py wraps (`wrap_engine_calls`): at each forward's entry, the requests in the order their
tokens were laid out, each request's slice of the batch, and the `positions` the model is given, which say which
sequence positions those tokens are (checked contiguous per request).
Every token is kept with its input token id, and when a row is assembled those are checked against the row's own
prompt and response: a value filed under the wrong request or position fails loudly. Requests: `LLM.generate`
numbers them, and fans a request with n > 1 out into n child requests with ids of their own; each engine request
id is recorded with its (external id, completion index), which `CompletionOutput.index` carries. What this covers:
several requests per step, n > 1, chunked prefill (a prompt over several steps), prefix caching (cached positions
are never computed: they keep the fill value), preemption with recompute (positions computed twice keep their first
values, those of the forward whose logits drew the next token). Entry p of a row holds the values of the forward
whose *input* was the token at position p, so the last response token (never fed back) keeps the fill value. Reaches
no vLLM internal itself: those it needs are rlmm/samplers/vllm_internals.py's (vLLM 0.32.0).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from rlmm.samplers.vllm_internals import ScheduledForward, engine_model, model_config, wrap_engine_calls


@dataclass
class Step:
    """One forward of the engine, per token of its flat batch: the request (an index into `TokenCapture.requests`),
    the position, the input token id, and the values captured for it ([tokens, columns, ...], the fill value
    until each column is written)."""

    requests: np.ndarray  # [tokens] int64
    positions: np.ndarray  # [tokens] int64
    tokens: np.ndarray  # [tokens] int64
    values: torch.Tensor  # [tokens, columns, ...]
    layout: list[tuple[str, int, int]]  # (engine request id, first position, tokens) in batch order
    written: set[int] = field(default_factory=set)


class TokenCapture:
    """Per-token values of `shape` ([columns, ...]) written by hooks of the caller's into `write`, during a
    `recording()`, assembled by `rows` into one [length, columns, ...] tensor per completion (module docstring).
    `what` names the setting in messages; `fill` marks what the engine did not compute."""

    def __init__(self, llm, what: str, shape: tuple[int, ...], dtype: torch.dtype, fill: float):
        self.what, self.shape, self.dtype, self.fill = what, shape, dtype, fill
        self.active = False
        self.step: Step | None = None  # the forward under way
        self.steps: list[Step] = []  # this generate call's forwards
        self.requests: dict[str, int] = {}  # engine request id -> its index in Step.requests
        self.engine_ids: dict[tuple[str, int], str] = {}  # (external request id, completion index) -> engine id
        self._unwrap = wrap_engine_calls(llm, what, self._forward, self._record_request)

    def remove(self) -> None:
        """The engine's calls as they were (this capture must be the last installed: wrappers are undone in the
        reverse order)."""
        self._unwrap()

    def write(self, column: int, values: torch.Tensor) -> None:
        """Column `column` of the forward under way: the first `tokens` rows of `values` (the engine may pad)."""
        step = self.step
        tokens = len(step.positions)
        if values.shape[0] < tokens or tuple(values.shape[1:]) != tuple(step.values.shape[2:]):
            raise RuntimeError(f"{self.what}: column {column} got {tuple(values.shape)} for a step of {tokens} "
                               f"tokens, each {tuple(step.values.shape[2:])}")
        step.values[:, column] = values[:tokens]
        step.written.add(column)

    # -- the hooks ------------------------------------------------------------------------------
    def _record_request(self, external_id: str, index: int, engine_id: str) -> None:
        if self.active:
            self.engine_ids[(external_id, index)] = engine_id

    def _forward(self, scheduled: ScheduledForward, run):
        if not self.active:
            return run()
        bounds, req_ids = scheduled.bounds, scheduled.request_ids
        counts = np.diff(bounds)
        tokens = int(bounds[-1])
        positions, input_ids = scheduled.positions, scheduled.input_ids
        if input_ids is None or positions is None or positions.dim() != 1:
            raise RuntimeError(f"{self.what}: a forward without token ids or with multi-axis positions (embeddings "
                               "or M-RoPE inputs), which this capture does not map")
        positions = positions[:tokens].numpy().astype(np.int64)
        starts = positions[bounds[:-1]]
        if not np.array_equal(positions, np.repeat(starts - bounds[:-1], counts) + np.arange(tokens)):
            raise RuntimeError(f"{self.what}: some request's tokens in one forward are not consecutive positions "
                               f"({positions.tolist()} for {counts.tolist()} tokens a request)")
        codes = np.array([self.requests.setdefault(r, len(self.requests)) for r in req_ids], dtype=np.int64)
        self.step = Step(np.repeat(codes, counts), positions, input_ids[:tokens].numpy().astype(np.int64),
                         torch.full((tokens, *self.shape), self.fill, dtype=self.dtype),
                         list(zip(req_ids, starts.tolist(), counts.tolist())))
        try:
            out = run()
            step = self.step
        finally:
            self.step = None
        if len(step.written) != self.shape[0]:
            raise RuntimeError(f"{self.what}: {len(step.written)} of {self.shape[0]} columns were written in one "
                               "forward")
        self.steps.append(step)
        return out

    # -- per generate call ------------------------------------------------------------------------
    @contextmanager
    def recording(self):
        self._clear()
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def _clear(self) -> None:
        self.steps.clear()
        self.requests.clear()
        self.engine_ids.clear()

    def rows(self, outputs, lengths: list[list[int]]) -> list[torch.Tensor]:
        """One [length, columns, ...] row per completion, in the order of `outputs` and their `.outputs`;
        `lengths`: len(prompt) + len(response) of each (after rlmm's own end-of-sequence cut). Each token's
        input id is checked against the row's own prompt and response at its position."""
        try:
            computed = self._first_computations() if self.steps else None
            rows = []
            for request, row_lengths in zip(outputs, lengths):
                for completion, length in zip(request.outputs, row_lengths):
                    engine_id = self.engine_ids[(request.request_id, completion.index)]
                    sequence = (list(request.prompt_token_ids) + list(completion.token_ids))[:length]
                    rows.append(self._row(computed, engine_id, sequence))
        finally:
            self._clear()
        return rows

    def _first_computations(self):
        """All forwards' tokens, each (request, position) once, sorted by request then position: where one was
        computed twice (preempted, recomputed) the first computation, whose logits drew the next token, wins."""
        requests, positions, tokens = (np.concatenate([getattr(s, name) for s in self.steps])
                                       for name in ("requests", "positions", "tokens"))
        key = requests * (int(positions.max()) + 1) + positions
        order = np.argsort(key, kind="stable")
        first = np.ones(len(order), dtype=bool)
        first[1:] = key[order[1:]] != key[order[:-1]]
        keep = order[first]
        values = torch.cat([s.values for s in self.steps])[torch.from_numpy(keep)]
        return requests[keep], positions[keep], tokens[keep], values

    def _row(self, computed, engine_id: str, sequence: list[int]) -> torch.Tensor:
        row = torch.full((len(sequence), *self.shape), self.fill, dtype=self.dtype)
        code = self.requests.get(engine_id)
        if code is None:  # no forward computed any of its tokens
            return row
        requests, positions, tokens, values = computed
        lo, hi = np.searchsorted(requests, code, side="left"), np.searchsorted(requests, code, side="right")
        inside = np.flatnonzero(positions[lo:hi] < len(sequence)) + lo
        at = positions[inside]
        wrong = np.flatnonzero(tokens[inside] != np.asarray(sequence, dtype=np.int64)[at])
        if len(wrong):
            raise RuntimeError(f"{self.what}: the values captured for request {engine_id} at position "
                               f"{int(at[wrong[0]])} belong to another token than its row's")
        row[torch.from_numpy(at)] = values[torch.from_numpy(inside)]
        return row


# -- the residual stream after every decoder layer ---------------------------------------------------------------
class HookedLayerStates:
    """Every token's hidden states as the engine computes them, at the sites of rlmm/mismatch/layer_attribution.py
    (`site_names`: the embedding's output; per decoder layer its attention norm, attention block, MLP norm and MLP
    outputs, and the residual stream after it; the final norm's output); `Rollouts.layer_states` rows of [length,
    sites, hidden] in the engine's dtype, NaN where it computed nothing.

    vLLM's decoder layers return (hidden, residual) and leave the add to the next layer's fused add-RMSNorm, which
    updates both in place (model_executor/layers/layernorm.py `fused_add_rms_norm`, returning (normed, residual));
    the stream after layer i is therefore `hidden + residual` taken in layer i's forward hook, before the next layer
    runs (the same sum vLLM's own aux hidden states take: model_executor/models/interfaces.py
    `_maybe_add_hidden_state`), and every site is copied when its hook runs. Forward hooks need the eager model
    (`enforce_eager`: a CPU engine's default). Layers are found at `model.model.layers`, their parts by transformers'
    names, the final norm at `model.model.norm` (the Llama / Qwen2 / Qwen3 / Qwen3-MoE layout)."""

    def __init__(self, llm):
        from rlmm.mismatch.layer_attribution import layer_site_modules, site_names

        model = engine_model(llm)
        base = getattr(model, "model", None)
        layers = getattr(base, "layers", None)
        if layers is None or getattr(base, "norm", None) is None or not hasattr(base, "embed_tokens"):
            raise ValueError(f"probe.layers: vLLM's {type(model).__name__} has no model.embed_tokens / model.layers / "
                             "model.norm to hook (the Llama and Qwen layouts have them)")
        self.sites = site_names(len(layers))
        config = model_config(llm)
        self.tokens = TokenCapture(llm, "probe.layers", (len(self.sites), config.get_hidden_size()), config.dtype,
                                   float("nan"))
        name = f"vLLM's {type(model).__name__}"
        modules = [base.embed_tokens, *(m for layer in layers for m in layer_site_modules(layer, name)), base.norm]
        self.handles = [module.register_forward_hook(self._hook(column, module in layers))
                        for column, module in enumerate(modules)]

    def _hook(self, column: int, stream: bool):
        def hook(module, args, output):
            if self.tokens.step is None:
                return
            if stream:  # a decoder layer's (hidden, residual)
                output = output[0] + output[1]
            elif isinstance(output, tuple):  # a fused add-RMSNorm's (normed, residual)
                output = output[0]
            self.tokens.write(column, output.detach())
        return hook

    @contextmanager
    def recording(self):
        with self.tokens.recording():
            yield

    def rows(self, outputs, lengths: list[list[int]]) -> list[torch.Tensor]:
        return self.tokens.rows(outputs, lengths)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.tokens.remove()


class NoLayerStates:
    """No layer capture: rows are None."""

    sites: list[str] = []

    @contextmanager
    def recording(self):
        yield

    def rows(self, outputs, lengths: list[list[int]]) -> None:
        return None

    def remove(self) -> None:
        pass
