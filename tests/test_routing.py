"""Routing replay (rlmm/mismatch/routing.py): the trainer's MoE layers replaying given experts, the HF sampler's capture,
the routing/ metrics, and R2/R3 in the RL step on every trainer backend with one and two ranks."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from rlmm.config.options import from_yaml
from rlmm.mismatch.routing import (REPLAY_KWARG, differing_decisions, hooks_of, moe_shape, recorded_routing,
                          routers, routing_disagreement)
from rlmm.policy.precision import SidePrecision
from rlmm.policy.rollouts import NO_ROUTE, Rollouts
from rlmm.trainers.update import minibatch_step
from tests.conftest import build_trainer, sampling, torchrun

FP32 = SidePrecision("fp32", False)
BF16 = SidePrecision("bf16", False)
OPTIONS = sampling(max_new_tokens=6, temperature=1.0)


def load(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@pytest.fixture(scope="module")
def moe_rollouts(moe_model_path) -> Rollouts:
    """Rollouts of the random MoE model from the transformers sampler in bf16, with its experts."""
    from transformers import AutoTokenizer

    from tests.conftest import build_sampler

    tokenizer = AutoTokenizer.from_pretrained(moe_model_path)
    sampler = build_sampler("hf", moe_model_path, BF16, OPTIONS, seed=0, capture_routing=True)
    try:
        prompts = [tokenizer(p).input_ids for p in ("12+5=", "7*8=", "100-1=")]
        return sampler.generate(prompts, n=2)
    finally:
        sampler.close()


def own_routing(trainer, rollouts: Rollouts) -> list[torch.Tensor]:
    with recorded_routing(trainer.model) as own:
        trainer.logprobs(rollouts)
    return [own[i] for i in range(len(rollouts))]


# -- the replay, at the model ---------------------------------------------------------------------------------

def test_a_model_replaying_its_own_experts_is_its_unreplayed_forward_bit_for_bit(moe_model_path):
    """Values and gradients, with and without gradient checkpointing (whose recomputation must replay too)."""
    model = load(moe_model_path)
    hooks = hooks_of(model)
    ids = torch.randint(4, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
        with hooks.recording() as calls:
            plain = model(input_ids=ids, use_cache=False).logits
        own = torch.stack(calls, 1).view(2, 12, hooks.shape.layers, hooks.shape.top_k)
        model.zero_grad()
        plain.square().sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        replayed = model(input_ids=ids, use_cache=False, **{REPLAY_KWARG: own}).logits
        replayed.square().sum().backward()
        assert torch.equal(plain, replayed)
        assert all(torch.equal(grads[n], p.grad) for n, p in model.named_parameters()), checkpointing
        assert routers(model)[0].weight.grad.abs().sum() > 0  # the router is still trained through its gates


def test_replaying_other_experts_changes_exactly_the_tokens_they_reach(moe_model_path):
    """One (position, layer) decision changed: it and every later position of its row change (attention carries
    it on); the positions before it and the other row move only by rounding (an expert's matmul now holds
    another number of tokens, so its blocking differs: the batch variance rlmm measures elsewhere)."""
    model = load(moe_model_path)
    hooks = hooks_of(model)
    ids = torch.randint(4, 90, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), hooks.recording() as calls:
        plain = model(input_ids=ids, use_cache=False).logits
    own = torch.stack(calls, 1).view(2, 12, hooks.shape.layers, hooks.shape.top_k)
    changed, position = own.clone(), 5
    unused = [e for e in range(hooks.shape.experts) if e not in own[0, position, 0].tolist()]
    changed[0, position, 0, 1] = unused[0]
    with torch.no_grad():
        other = model(input_ids=ids, use_cache=False, **{REPLAY_KWARG: changed}).logits
    moved = (other - plain).abs().amax(-1)
    assert moved[0, :position].max() < 1e-6 and moved[1].max() < 1e-6
    assert (moved[0, position:] > 1e-4).all()
    # In the last MoE layer (here the last decoder layer) it reaches its own position's logits only: a prompt
    # position's decision there moves no scored log-prob (`differing_decisions`, the probe's routing part).
    last = hooks.shape.layers - 1
    assert hooks.shape.last_layer_is_final
    changed = own.clone()
    changed[0, position, last, 1] = [e for e in range(hooks.shape.experts) if e not in own[0, position, last].tolist()][0]
    with torch.no_grad():
        moved = (model(input_ids=ids, use_cache=False, **{REPLAY_KWARG: changed}).logits - plain).abs().amax(-1)
    assert moved[0, position] > 1e-4
    assert moved[0, :position].max() < 1e-6 and moved[0, position + 1:].max() < 1e-6 and moved[1].max() < 1e-6
    counted = differing_decisions([own[0]], [changed[0]], [position + 2], last_layer_is_final=True)
    assert counted == {"differing_decisions": 1, "differing_decisions_reaching_scores": 0}
    counted = differing_decisions([own[0]], [changed[0]], [position + 1], last_layer_is_final=True)
    assert counted["differing_decisions_reaching_scores"] == 1  # position P - 1 predicts the first response token
    # NO_ROUTE keeps the model's own choice at that position.
    unrouted = own.clone()
    unrouted[:, :3] = NO_ROUTE
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, use_cache=False, **{REPLAY_KWARG: unrouted}).logits, plain)


def test_an_moe_checkpoint_takes_replay_and_rlmm_train_refuses_it_for_a_dense_one_before_any_engine(moe_model_path):
    from_yaml("routing", "r3", measure=True, compare=False).check_checkpoint(moe_model_path)
    import subprocess
    import sys

    from tests.conftest import ending, subprocess_env

    refused = subprocess.run([sys.executable, "-m", "rlmm.cli", "train", "debug=train", "routing=r3"], text=True,
                             capture_output=True, timeout=300, env=subprocess_env(), stdin=subprocess.DEVNULL)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert ending(refused) == ("rlmm: error: routing=r3: the model (Qwen2ForCausalLM) has no mixture-of-experts router; "
                               "routing replay needs an MoE model such as model=tiny_moe (a dense model takes "
                               "routing=none)")
    assert "vllm" not in refused.stderr.lower() and "deepspeed" not in refused.stderr.lower(), refused.stderr[-3000:]


@pytest.mark.parametrize("option", ["none", "r2", "r3"])
def test_each_routing_option_is_its_own_class_and_knows_its_name(option):
    """conf/routing/<option>.yaml builds the class of that routing, which names itself as the YAML is named
    (the name its messages give) and replays what that routing replays."""
    routing = from_yaml("routing", option)
    assert routing.name == option
    assert routing.replays == (option != "none") and routing.replays_own_routing == (option == "r2")
    assert routing.capture == (routing.measure or routing.compare or option == "r3")


def test_a_router_the_replay_cannot_reproduce_is_refused_by_name(small_model_path):
    model = load(small_model_path)
    assert routers(model) == [] and moe_shape(model) is None
    with pytest.raises(ValueError, match="routing=r3: the model \\(Qwen2ForCausalLM\\) has no mixture-of-experts"):
        from_yaml("routing", "r3", measure=True, compare=False).bind(model)
    # the same from the checkpoint's config.json, before any engine starts
    with pytest.raises(ValueError, match="routing=r2: the model \\(Qwen2ForCausalLM\\) has no mixture-of-experts"):
        from_yaml("routing", "r2", measure=True, compare=False).check_checkpoint(small_model_path)
    with pytest.raises(ValueError, match="routing.measure: must be true or false, got 'yes'"):
        from_yaml("routing", "none", measure="yes")
    from_yaml("routing", "none", measure=True, compare=False).bind(model)  # a dense model takes routing=none


# -- the capture ----------------------------------------------------------------------------------------------

def test_the_hf_samplers_experts_are_its_routers_top_k_at_each_fed_token(moe_model_path):
    """The ids `sampler=hf` returns are topk(softmax(W x)) of the router's own input x (recorded by the test's
    own hook) at the forward where each position was the input: prompt positions from the prefill, response
    token j from the decode step that fed it; the last response token NO_ROUTE."""
    from transformers import AutoTokenizer

    from tests.conftest import build_sampler

    tokenizer = AutoTokenizer.from_pretrained(moe_model_path)
    sampler = build_sampler("hf", moe_model_path, FP32, OPTIONS, seed=0, capture_routing=True)
    inputs: list[torch.Tensor] = []
    layer0 = routers(sampler.model)[0]
    handle = layer0.register_forward_pre_hook(lambda module, args: inputs.append(args[0].detach().clone()))
    try:
        prompts = [tokenizer(p).input_ids for p in ("3+4=", "12*11=")]
        rollouts = sampler.generate(prompts, n=2)
    finally:
        handle.remove()
        sampler.close()
    k, width, rows = layer0.top_k, max(map(len, prompts)), 4
    hand = [torch.topk(torch.softmax(x.float() @ layer0.weight.detach().T.float(), -1), k).indices for x in inputs]
    prefill = hand[0].view(rows, width, k)
    for row in range(rows):
        routed, prompt, response = (rollouts.routed_experts[row], rollouts.prompt_ids[row],
                                    rollouts.response_ids[row])
        assert routed.shape == (len(prompt) + len(response), 2, k) and routed.dtype == torch.int16
        assert torch.equal(routed[:len(prompt), 0].long(), prefill[row, width - len(prompt):])
        for j in range(len(response) - 1):
            assert torch.equal(routed[len(prompt) + j, 0].long(), hand[1 + j].view(rows, k)[row])
        assert (routed[-1] == NO_ROUTE).all()


def test_the_captured_experts_line_up_with_the_trainers_positions(moe_model_path):
    """fp32 on both sides: the sampler's experts (KV cache, left padding) agree with the trainer's own (full
    forward, right padding) almost everywhere; the same comparison shifted by one position does not."""
    from transformers import AutoTokenizer

    from tests.conftest import build_sampler

    tokenizer = AutoTokenizer.from_pretrained(moe_model_path)
    sampler = build_sampler("hf", moe_model_path, FP32, OPTIONS, seed=0, capture_routing=True)
    try:
        rollouts = sampler.generate([tokenizer(p).input_ids for p in ("5+5=", "61-9=", "2*2=")], n=2)
    finally:
        sampler.close()
    trainer = build_trainer("torch", moe_model_path, FP32, OPTIONS)
    try:
        own = own_routing(trainer, rollouts)
    finally:
        trainer.close()
    assert routing_disagreement(rollouts.routed_experts, own)["routing/frac_decisions_differ"] < 0.02
    shifted = [torch.cat([r[1:], r[:1]]) for r in rollouts.routed_experts]
    assert routing_disagreement(shifted, own)["routing/frac_decisions_differ"] > 0.3


def test_routing_disagreement_on_a_hand_example():
    """Two tokens, two layers, top-2: sets compared (order ignored); NO_ROUTE decisions not counted."""
    last = [[1, 2], [3, 4]]  # a row's last position: never counted (no scored log-prob depends on it)
    sampler = [torch.tensor([[[0, 1], [2, 3]], [[4, 5], [NO_ROUTE, NO_ROUTE]], last], dtype=torch.int16)]
    trainer = [torch.tensor([[[1, 0], [2, 6]], [[4, 5], [7, 0]], [[5, 6], [7, 0]]], dtype=torch.int16)]
    m = routing_disagreement(sampler, trainer)
    assert m["routing/frac_decisions_differ"] == pytest.approx(1 / 3)  # (t0,l1) of 3 counted decisions
    assert m["routing/frac_tokens_differ"] == pytest.approx(1 / 2)
    assert m["routing/expert_overlap"] == pytest.approx(5 / 6)  # 2 + 1 + 2 shared of 2 x 3
    assert m["routing/frac_decisions_differ_layer_0"] == 0 and m["routing/frac_decisions_differ_layer_1"] == 1


# -- the trainer ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", [{}, {"padding_free": True}, {"micro_batch_tokens": 40}])
def test_a_trainer_replaying_its_own_experts_scores_and_steps_as_without(moe_model_path, moe_rollouts, layout):
    """TorchTrainer, every layout: the rollouts with the trainer's own experts to replay give the log-probs and
    the update of the rollouts without, bit for bit; other experts (each id + 1) give other log-probs."""
    plain = dataclasses.replace(moe_rollouts, replayed_experts=None)
    shifted = dataclasses.replace(moe_rollouts, replayed_experts=[
        torch.where(r == NO_ROUTE, r, (r + 1) % 8) for r in moe_rollouts.routed_experts])
    results = {}
    for name, rollouts in (("plain", plain), ("own", None), ("other", shifted)):
        trainer = build_trainer("torch", moe_model_path, FP32, OPTIONS, micro_batch_size=4, **layout)
        try:
            rollouts = rollouts or dataclasses.replace(plain, replayed_experts=own_routing(trainer, plain))
            logprobs = trainer.logprobs(rollouts)
            minibatch_step(trainer, rollouts, list(range(len(rollouts))),
                           lambda micro, lp, ent: ((lp * lp).sum() / 10, {}))
            results[name] = logprobs, {k: v.clone() for k, v in trainer.state_dict().items()}
        finally:
            trainer.close()
    assert torch.equal(results["own"][0], results["plain"][0])
    assert all(torch.equal(results["own"][1][k], v) for k, v in results["plain"][1].items())
    assert (results["other"][0] - results["plain"][0]).abs().max() > 1e-3


def test_the_step_logs_routing_metrics_and_compares_both_ways(moe_model_path, arithmetic_task):
    """rl_step with routing=none, measure and compare on: routing/ metrics, and the mismatch both ways; under
    r3 the replayed way is the step's own mismatch."""
    from tests.test_update import OddLengthReward, algo

    from rlmm.corrections.tis import TokenTIS
    from rlmm.run.components import Components
    from rlmm.run.step import rl_step
    from tests.conftest import build_sampler
    from transformers import AutoTokenizer

    metrics = {}
    for mode in ("none", "r3"):
        torch.manual_seed(0)
        sampler = build_sampler("hf", moe_model_path, BF16, OPTIONS, seed=0, capture_routing=True)
        trainer = build_trainer("torch", moe_model_path, FP32, OPTIONS)
        routing = from_yaml("routing", mode, measure=True, compare=True).bind(trainer.model)
        c = Components(task=OddLengthReward(arithmetic_task), tokenizer=AutoTokenizer.from_pretrained(moe_model_path),
                       sampler=sampler, trainer=trainer, correction=TokenTIS(cap=2.0), algo=algo(), sampling=OPTIONS,
                       routing=routing)
        try:
            metrics[mode] = rl_step(c, arithmetic_task.examples("train", 3), ratio_cap=2.0, reuse_training_forward=True)
        finally:
            c.close()
    for mode, m in metrics.items():
        assert 0 < m["routing/frac_decisions_differ"] < 0.5, mode
        assert m["routing/own/kl_k3"] > m["routing/replayed/kl_k3"] > 0, mode
    assert metrics["none"]["mismatch/kl_k3"] == metrics["none"]["routing/own/kl_k3"]
    assert metrics["r3"]["mismatch/kl_k3"] == metrics["r3"]["routing/replayed/kl_k3"]


def recorded(moe_model_path, arithmetic_task) -> dict:
    """Rollouts of 6 prompts x 4 (bf16 sampler, experts captured) as tests/ranks_step.py replays them."""
    from transformers import AutoTokenizer

    from tests.conftest import build_sampler
    from tests.test_update import GROUP, OPTIONS as STEP_OPTIONS

    tokenizer = AutoTokenizer.from_pretrained(moe_model_path)
    prompts = arithmetic_task.examples("train", 6)
    sampler = build_sampler("hf", moe_model_path, BF16, STEP_OPTIONS, seed=0, capture_routing=True)
    try:
        rollouts = sampler.generate([tokenizer(e.prompt).input_ids for e in prompts], n=GROUP)
    finally:
        sampler.close()
    return {"prompts": [e.prompt for e in prompts], "group_size": GROUP, "prompt_ids": rollouts.prompt_ids,
            "response_ids": rollouts.response_ids, "sampler_logprobs": [lp.tolist() for lp in rollouts.sampler_logprobs],
            "routed_experts": [r.tolist() for r in rollouts.routed_experts]}


@pytest.mark.parametrize("backend", ["torch", "deepspeed", "fsdp"])
def test_r3_reaches_the_update_of_every_backend(moe_model_path, arithmetic_task, tmp_path, backend):
    """One rank: r3's step (the sampler's bf16 experts replayed) moves the weights otherwise than routing=none's,
    and r3 given the trainer's own experts moves them as none does, bit for bit."""
    from tests.ranks_step import step_on_share

    rows = recorded(moe_model_path, arithmetic_task)
    trainer = build_trainer("torch", moe_model_path, FP32, sampling(max_new_tokens=6, temperature=0.9))
    try:
        own = own_routing(trainer, Rollouts(rows["prompt_ids"], rows["response_ids"],
                                            [torch.tensor(lp) for lp in rows["sampler_logprobs"]],
                                            ["stop"] * len(rows["prompt_ids"])))
    finally:
        trainer.close()
    none = step_on_share(moe_model_path, rows, backend, tmp_path, routing="none")
    r3 = step_on_share(moe_model_path, rows, backend, tmp_path, routing="r3")
    r3_own = step_on_share(moe_model_path, {**rows, "routed_experts": [r.tolist() for r in own]}, backend, tmp_path,
                           routing="r3")
    assert max((r3[k] - none[k]).abs().max().item() for k in none) > 1e-4
    assert all(torch.equal(r3_own[k], none[k]) for k in none)


@pytest.mark.slow
def test_r2_and_r3_two_ranks_take_the_one_rank_step_on_every_backend(moe_model_path, arithmetic_task, tmp_path):
    """torchrun, 2 gloo ranks (tests/ranks_step.py) under routing=r2 and r3 (r2 with two epochs, so its second
    update replays π_old's routing): the averaged update equals one rank's on all the rows, on torch, DeepSpeed
    and FSDP; and r3's update differs from routing=none's (the replay reached the update)."""
    from safetensors.torch import load_file

    from tests.ranks_step import BACKENDS, step_on_share
    from tests.test_update import relative_error

    replay = tmp_path / "rollouts.json"
    replay.write_text(json.dumps(recorded(moe_model_path, arithmetic_task)))
    recorded_rows = json.loads(replay.read_text())
    initial = {k: v.clone() for k, v in load(moe_model_path).state_dict().items()}  # fused experts: runtime names
    for mode in ("r3", "r2"):
        out = tmp_path / mode
        out.mkdir()
        torchrun(["tests/ranks_step.py", moe_model_path, str(replay), str(out), json.dumps({}), mode], timeout=900)
        for backend in BACKENDS:
            one = {k: v - initial[k] for k, v in step_on_share(moe_model_path, recorded_rows, backend, out,
                                                                routing=mode).items()}
            two = {k: v - initial[k] for k, v in load_file(out / f"{backend}-2.safetensors").items()}
            assert max(v.abs().max().item() for v in one.values()) > 0
            assert relative_error(two, one) < 1e-4, (mode, backend)
    none = step_on_share(moe_model_path, recorded_rows, "torch", tmp_path, routing="none")
    r3 = step_on_share(moe_model_path, recorded_rows, "torch", tmp_path, routing="r3")
    assert relative_error({k: v - initial[k] for k, v in r3.items()},
                          {k: v - initial[k] for k, v in none.items()}) > 1e-3


@pytest.mark.parametrize("normalise", [True, False])
def test_replayed_gates_are_the_routers_softmax_on_the_replayed_experts(normalise):
    """g_e = p_e / Σ_{e' in E} p_e' (normalised top-k) or p_e, p = softmax(z) of the router's own logits; a token
    whose replayed ids are NO_ROUTE keeps its own experts and gates; the router gets a gradient through g."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from rlmm.mismatch.routing import _replayed

    router = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=4, num_experts=4, num_experts_per_tok=2,
                                               norm_topk_prob=normalise))
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.5, 0.0, 3.0, 1.0]], requires_grad=True)
    own = torch.tensor([[0, 1], [2, 3]])
    gates, ids = _replayed(router, logits, own, torch.tensor([[3, 2], [NO_ROUTE, NO_ROUTE]]))
    p = torch.softmax(logits.detach(), -1)
    expected = torch.stack([p[0, [3, 2]], p[1, [2, 3]]])
    if normalise:
        expected = expected / expected.sum(-1, keepdim=True)
    assert torch.equal(ids, torch.tensor([[3, 2], [2, 3]]))
    assert torch.allclose(gates, expected, rtol=0, atol=1e-7)
    (gates[0] * torch.tensor([1.0, 2.0])).sum().backward()
    assert logits.grad[0, [2, 3]].abs().min() > 0 and torch.equal(logits.grad[1], torch.zeros(4))


def test_a_conversations_stitched_experts_line_up_with_the_trainers_positions(moe_model_path):
    """token_path=tokens over three turns of a real sampler (fp32 transformers, experts captured), the environment's
    text between them: the row's experts, each taken from the forward that first fed its token while sampling
    (`stitched_routing`), agree with the trainer's own on the whole row almost everywhere, as a single response's do;
    taking every position's from the last turn's prefill instead (what sampled tokens were *not* routed by) is not
    what the step replays, and a stitch one position off disagrees."""
    from rlmm.conversation.chat import TemplatePrompts
    from rlmm.conversation.token_path import Conversation, TokenInTokenOut, Turn, stitched_routing
    from rlmm.models.loading import load_tokenizer
    from tests.conftest import build_sampler

    tokenizer = load_tokenizer(moe_model_path)
    chat = TemplatePrompts(tokenizer, None)
    path = TokenInTokenOut()
    sampler = build_sampler("hf", moe_model_path, FP32, sampling(max_new_tokens=6), seed=0, capture_routing=True)
    conversations = []
    try:
        for question in ("5+5=", "61-9=", "2*2="):
            conversation = Conversation([{"role": "user", "content": question}])
            prompt = chat.encode(chat.render(conversation.messages, generation_prompt=True))
            for answer in ("7", "ok", "12"):
                out = sampler.generate([prompt], n=1)
                # whatever it sampled, the turn ends on <eos> as a finished one does (a random model rarely stops)
                output = out.response_ids[0][:5] + [tokenizer.eos_token_id]
                fed = sampler.generate([prompt + output[:-1]], n=1, max_new_tokens=1)  # the forwards that fed them
                routed = torch.cat([fed.routed_experts[0][:len(prompt) + len(output) - 1],
                                    torch.full_like(fed.routed_experts[0][:1], NO_ROUTE)])
                conversation.turns.append(Turn(prompt, output, torch.zeros(len(output)), "stop", routed=routed))
                conversation.messages += [{"role": "assistant", "content": chat.decode(output)},
                                          {"role": "tool", "content": answer}]
                prompt = path.next_prompt(chat, conversation)
            conversations.append(conversation)
    finally:
        sampler.close()
    rows = [path.trained(chat, c) for c in conversations]
    rollouts = Rollouts([r.prompt_ids for r in rows], [r.response_ids for r in rows],
                        [torch.zeros(len(r.response_ids)) for r in rows], ["stop"] * len(rows),
                        routed_experts=[r.routed for r in rows])
    assert all(len(r.routed) == len(r.prompt_ids) + len(r.response_ids) for r in rows)
    assert torch.equal(rows[0].routed, stitched_routing(conversations[0].turns))
    trainer = build_trainer("torch", moe_model_path, FP32, OPTIONS)
    try:
        own = own_routing(trainer, rollouts)
    finally:
        trainer.close()
    assert routing_disagreement(rollouts.routed_experts, own)["routing/frac_decisions_differ"] < 0.02
    shifted = [torch.cat([r[1:], r[:1]]) for r in rollouts.routed_experts]
    assert routing_disagreement(shifted, own)["routing/frac_decisions_differ"] > 0.3
