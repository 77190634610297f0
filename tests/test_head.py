"""The trainer's output head (rlmm/models/head.py): chunked scoring equals the full computation, never
holds more than a chunk of logits, and keeps a real vocabulary's memory bounded; the one-pass budget and
gradient checkpointing leave the update unchanged."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlmm.config.options import from_yaml
from rlmm.models.head import OutputHead
from rlmm.policy.logprobs import mask_logits
from rlmm.policy.rollouts import KeptTokens
from tests.conftest import build_trainer, sampling, subprocess_env

SHARP = dict(temperature=0.7, top_k=20, top_p=0.9, logprobs="processed")
OPTIONS = {"raw": sampling(logprobs="raw"),
           **{f"processed-{support}": sampling(**SHARP, support=from_yaml("support", support))
              for support in ("sampler", "trainer", "full")}}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def full_scores(weight, hidden, tokens, options, fp32, kept):
    """The textbook computation on whole [b, T, V] logits: log_softmax over the support, gather, softmax entropy.
    The support written out: the sampler's kept set `kept` [b, T, V] with the token; the trainer's own top-k/top-p
    set (-inf masks) with the token; or every token (temperature only)."""
    logits = torch.nn.functional.linear(hidden.float() if fp32 else hidden, weight)
    z = logits.float()
    if options.logprobs == "processed":
        tempered = logits.float() / options.temperature
        keep = {"sampler": kept, "trainer": torch.isfinite(mask_logits(logits, options)),
                "full": torch.ones_like(kept)}[options.support.name].clone()
        keep.scatter_(-1, tokens[..., None], True)  # the sampled token always in
        z = tempered.masked_fill(~keep, float("-inf"))
    log_p = z.log_softmax(-1)
    logprobs = log_p.gather(-1, tokens[..., None])[..., 0]
    entropy = -(log_p.exp() * log_p.where(torch.isfinite(log_p), 0.0)).sum(-1)  # 0 log 0 = 0, finite gradient
    return logprobs, entropy


@pytest.mark.parametrize("mode", list(OPTIONS))
@pytest.mark.parametrize("dtype,fp32", [(torch.float32, False), (torch.bfloat16, False), (torch.float16, False),
                                        (torch.bfloat16, True), (torch.float16, True)],
                         ids=["fp32", "bf16", "fp16", "bf16_fp32head", "fp16_fp32head"])
def test_chunked_scores_equal_the_full_computation(dtype, fp32, mode):
    """Values and gradients (to the hidden states and the head's weight) of log π and entropy at a few
    positions, chunked by 1, 5 and more than all of them, against the same maths on full logits."""
    options = OPTIONS[mode]
    generator = torch.Generator().manual_seed(0)
    rows, width, length, hidden_size, vocab = 3, 9, 4, 16, 50
    weight = (torch.randn(vocab, hidden_size, generator=generator) * 0.5).to(dtype)
    hidden_states = torch.randn(rows, width, hidden_size, generator=generator).to(dtype)
    index = torch.randint(0, width, (rows, length), generator=generator)
    chosen = torch.randint(0, vocab, (rows, length), generator=generator)
    # a token the processed distribution keeps (top-k/top-p could mask a random one to -inf)
    head_weight = weight.float() if fp32 else weight
    picked = hidden_states.gather(1, index[..., None].expand(-1, -1, hidden_size))
    tokens = torch.where(torch.rand(rows, length, generator=generator) < 0.5, chosen,
                         torch.nn.functional.linear(picked.float() if fp32 else picked, head_weight).argmax(-1))
    # a sampler's kept sets: a few random tokens and the sampled one at each position
    kept = torch.rand(rows, length, vocab, generator=generator) < 0.1
    kept.scatter_(-1, tokens[..., None], True)
    laid_out = KeptTokens.of_masks(kept.view(rows * length, vocab), tokens.view(-1), torch.zeros(rows * length, vocab),
                                   max_kept=vocab)

    def run(chunk_size):
        w = torch.nn.Parameter(head_weight.clone())
        h = hidden_states.clone().requires_grad_(True)
        if chunk_size is None:
            logprobs, entropy = full_scores(w, h.gather(1, index[..., None].expand(-1, -1, hidden_size)), tokens,
                                            options, fp32, kept)
        else:
            head = OutputHead(w, fp32=False, chunk_size=chunk_size)
            head.fp32 = fp32  # w is already fp32 when asked: keep this very Parameter to read its gradient
            with head.aimed_at(index, tokens, options, entropy=True, kept=laid_out):
                out = head(h)
            logprobs, entropy = out[..., 0], out[..., 1]
        assert torch.isfinite(logprobs).all()  # a sampled token is scored whatever the support
        finite = torch.isfinite(logprobs)
        (logprobs.where(finite, 0.0).sum() + 0.3 * entropy.sum()).backward()
        return logprobs.detach(), entropy.detach(), h.grad, w.grad

    expected = run(None)
    assert all(torch.isfinite(grad).all() for grad in expected[2:])  # even where top-k/top-p mask tokens
    head_tolerance = TOLERANCE[torch.float32 if fp32 else dtype]  # the head computes in fp32 when asked
    tolerances = (head_tolerance, head_tolerance, TOLERANCE[dtype], head_tolerance)  # the hidden states' grad is 16-bit
    for chunk_size in (1, 5, 1000):
        for got, want, tolerance in zip(run(chunk_size), expected, tolerances):
            torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance, equal_nan=True)


def test_never_more_than_a_chunk_of_logits():
    """The projection is applied to at most chunk_size positions at a time, forward and backward."""
    head = OutputHead(torch.nn.Parameter(torch.randn(30, 8)), chunk_size=4)
    sizes = []
    project = head.project
    head.project = lambda h: sizes.append(h.shape[0]) or project(h)
    hidden = torch.randn(2, 10, 8, requires_grad=True)
    index, tokens = torch.arange(7).repeat(2, 1), torch.randint(0, 30, (2, 7))
    with head.aimed_at(index, tokens, OPTIONS["raw"], entropy=True):
        head(hidden).sum().backward()
    assert max(sizes) == 4 and sum(sizes) == 2 * 14  # 14 positions, each projected once forward, once backward
    assert head(hidden).shape == (2, 10, 30)  # not aimed: the plain projection


def test_one_pass_fallback_and_gradient_checkpointing_leave_the_update_unchanged(small_model_path, arithmetic_task):
    """The one-pass step scoring first when the graphs would not fit, and gradient checkpointing, give the
    update (SGD, fp32) and the scored log-probs of holding every graph without checkpointing."""
    from rlmm.corrections.none import NoCorrection
    from rlmm.policy.precision import SidePrecision
    from rlmm.run.components import Components
    from rlmm.run.step import rl_step
    from rlmm.samplers.hf import HFSampler
    from tests.test_update import OddLengthReward, algo
    from transformers import AutoTokenizer

    fp32 = SidePrecision("fp32", False)
    options = sampling(max_new_tokens=6)
    results = {}
    for name, checkpointing, fits in (("held", False, True), ("scored_first", False, False),
                                      ("checkpointed", True, True)):  # False/True: forced, not left to the budget
        trainer = build_trainer("torch", small_model_path, fp32, options, micro_batch_size=5, grad_clip=0.0,
                                gradient_checkpointing=checkpointing)
        trainer.optimizer = torch.optim.SGD(trainer.optimized_params, lr=1.0)
        trainer.budget.graphs_fit = lambda checkpointing, fits=fits: (lambda tokens: fits)
        forwards = []
        forward = trainer._forward
        trainer._forward = lambda *args: forwards.append(1) or forward(*args)
        before = {k: v.clone() for k, v in trainer.state_dict().items()}
        c = Components(task=OddLengthReward(arithmetic_task), tokenizer=AutoTokenizer.from_pretrained(small_model_path),
                       sampler=HFSampler(small_model_path, fp32, options, seed=0, batch_size=0, perturb=0.0),
                       trainer=trainer,
                       correction=NoCorrection(), algo=algo(), sampling=options)
        metrics = rl_step(c, arithmetic_task.examples("train", 4), ratio_cap=2.0, reuse_training_forward=True)
        results[name] = ({k: v for k, v in metrics.items() if not k.startswith("perf/")},
                         {k: v - before[k] for k, v in trainer.state_dict().items()}, len(forwards))
        trainer.close()
    (held, held_change, held_forwards) = results["held"]
    assert held_forwards == 4 and results["scored_first"][2] == 8  # 16 rows in micro-batches of 5: 4, twice
    for name in ("scored_first", "checkpointed"):
        metrics, change, _ = results[name]
        assert metrics == pytest.approx(held, rel=1e-5, abs=1e-7), name
        for key, value in held_change.items():
            torch.testing.assert_close(change[key], value, rtol=1e-4, atol=1e-6)


MEMORY_SCRIPT = r"""
import json, sys, torch
from rlmm.cli import set_runtime_env
set_runtime_env()
from rlmm.config.options import from_yaml
from rlmm.policy.precision import SidePrecision
from rlmm.policy.rollouts import Rollouts, SamplingOptions
from rlmm.trainers.update import minibatch_step

def rss(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1]) * 1024

path, chunk = sys.argv[1], int(sys.argv[2])
options = SamplingOptions(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=64, logprobs="processed",
                          support=from_yaml("support", "sampler"))
trainer = from_yaml("trainer", "torch", model_path=path, precision=SidePrecision("fp32", False), sampling=options,
                    micro_batch_size=32, logits_chunk_size=chunk)
vocab = trainer.model.config.vocab_size
g = torch.Generator().manual_seed(0)
rows = 32
rollouts = Rollouts([[1] + torch.randint(3, vocab, (8,), generator=g).tolist() for _ in range(rows)],
                    [torch.randint(3, vocab, (64,), generator=g).tolist() for _ in range(rows)],
                    [torch.zeros(64) for _ in range(rows)], ["length"] * rows)
trainer.logprobs(rollouts)  # warm up allocator pools
before = rss("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
trainer.logprobs(rollouts)
def loss_fn(chunk, logprobs, entropy):
    return -(logprobs.sum() + entropy.sum()) / 1000, {"loss": 0.0}
minibatch_step(trainer, rollouts, list(range(rows)), loss_fn)
print(json.dumps({"growth": rss("VmHWM:") - before, "vocab": vocab}))
"""


def test_scoring_and_a_step_at_a_real_vocabulary_stay_within_a_chunk(tmp_path):
    """A small body with Qwen2.5's 151,936-token vocabulary (fp32): scoring and one training step of
    32 rows x 64 response tokens grow the process's peak memory by less than 1.2 GB with 128-position
    chunks. Whole fp32 logits of those 2,048 positions would be 1.25 GB each, and the softmax, log-softmax
    and their gradients several times that."""
    from benchmarks.models import build_bench_model

    model = tmp_path / "wide"
    build_bench_model(model, hidden_size=64, num_layers=2, num_heads=1, num_kv_heads=1, intermediate_size=128,
                      vocab_size=151936)
    result = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(model), "128"], capture_output=True, text=True,
                            timeout=600, env=subprocess_env(OMP_NUM_THREADS="2"), cwd=Path(__file__).parent.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["vocab"] == 151936
    assert figures["growth"] < 1.2e9, figures


def test_activation_budget_checkpoints_and_scores_first_only_when_needed(monkeypatch):
    """The per-update choices: checkpoint when the largest micro-batch does not fit in half the free memory
    less the optimizer state still to come; hold every graph only when all of them fit."""
    from types import SimpleNamespace

    from rlmm.trainers import memory

    config = SimpleNamespace(hidden_size=896, intermediate_size=4864, num_hidden_layers=24)  # Qwen2.5-0.5B
    assert memory.activation_bytes_per_token(config, torch.bfloat16, False) == 24 * (8 * 896 + 4 * 4864) * 2
    assert memory.activation_bytes_per_token(config, torch.float32, True) == 24 * 896 * 4
    monkeypatch.setattr(memory, "free_bytes", lambda device: 16e9)
    budget = memory.ActivationBudget(config, torch.bfloat16, torch.device("cpu"), None, pending_bytes=6e9)
    assert budget.room() == 0.5 * 10e9
    assert budget.checkpointing(3000) is False  # 3.8 GB fits in 5 GB
    assert budget.checkpointing(4400) is True  # 5.6 GB does not
    assert budget.graphs_fit(False)(3000) and not budget.graphs_fit(False)(4400)
    assert budget.graphs_fit(True)(4400)  # 0.19 GB with checkpointing
    budget.settled()
    assert budget.room() == 8e9 and budget.checkpointing(4400) is False
    forced = memory.ActivationBudget(config, torch.bfloat16, torch.device("cpu"), False, pending_bytes=0)
    assert forced.checkpointing(10**9) is False


def saved_activation_bytes_per_token_and_layer(model, tokens: int = 32, rows: int = 2) -> float:
    """What a forward through the decoder (no LM head) saves for its backward: the storages of the floating
    tensors autograd keeps that are not parameters (nor views of one: an expert's slice of a stacked weight)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if tensor.is_floating_point() and storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids = torch.randint(0, 100, (rows, tokens), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.model(input_ids=ids)
    return sum(saved.values()) / (rows * tokens) / model.config.num_hidden_layers


@pytest.mark.parametrize("layout", ["qwen2_dense", "qwen3_moe", "olmoe", "mixtral", "qwen2_moe_shared_expert"])
def test_activation_estimate_is_what_a_forward_saves_for_dense_and_moe_layers(layout):
    """The activation estimate that decides gradient checkpointing and the one-pass step, against the bytes a
    real forward keeps (fp32, sdpa attention, transformers' default grouped_mm experts). Counting a sparse
    layer as one dense MLP put OLMoE's layout at 0.22 of them (k = 8 experts per token) and Qwen3-MoE's at
    0.67: a micro-batch 4x too large for memory would have gone unchecked."""
    import transformers

    from rlmm.trainers import memory

    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    config = {
        "qwen2_dense": lambda: transformers.Qwen2Config(intermediate_size=176, **common),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(intermediate_size=176, moe_intermediate_size=88,
                                                         num_experts=8, num_experts_per_tok=2, **common),
        "olmoe": lambda: transformers.OlmoeConfig(intermediate_size=32, num_experts=16, num_experts_per_tok=8,
                                                  **common),
        "mixtral": lambda: transformers.MixtralConfig(intermediate_size=224, num_local_experts=8,
                                                      num_experts_per_tok=2, **common),
        "qwen2_moe_shared_expert": lambda: transformers.Qwen2MoeConfig(
            intermediate_size=176, moe_intermediate_size=44, shared_expert_intermediate_size=176, num_experts=8,
            num_experts_per_tok=4, **common),
    }[layout]()
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    measured = saved_activation_bytes_per_token_and_layer(model)
    estimate = memory.activation_bytes_per_token(config, torch.float32, False) / config.num_hidden_layers
    assert 0.75 <= estimate / measured <= 1.1, (layout, estimate, measured)


def test_only_the_sparse_layers_count_experts():
    """`decoder_sparse_step`, `mlp_only_layers` and `first_k_dense_replace` keep some layers dense."""
    from types import SimpleNamespace

    from rlmm.trainers.memory import mlp_elements_per_token

    qwen3_moe = SimpleNamespace(hidden_size=64, intermediate_size=176, moe_intermediate_size=88, num_experts=8,
                                num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3])
    assert [mlp_elements_per_token(qwen3_moe, layer) for layer in range(4)] == [
        4 * 176, 2 * 8 + 2 * (2 * 64 + 4 * 88), 4 * 176, 4 * 176]
    deepseek = SimpleNamespace(hidden_size=64, intermediate_size=176, moe_intermediate_size=32, n_routed_experts=16,
                               num_experts_per_tok=4, n_shared_experts=2, first_k_dense_replace=1)
    assert [mlp_elements_per_token(deepseek, layer) for layer in range(2)] == [
        4 * 176, 2 * 16 + 4 * (2 * 64 + 4 * 32) + 4 * 2 * 32]
