"""The op-class attribution (rlmm/mismatch/attribution.py): a plan with every class in one dtype is the trainer loaded
in that dtype, bit for bit; each plan casts exactly its op class; the model is as it was afterwards; the
shares add up as defined; the probe's checks refuse what cannot be attributed before any engine starts."""
from __future__ import annotations

import re
import sys

import pytest
import torch

from rlmm.mismatch.attribution import OP_CLASSES, OpPrecisions, Plan, attribute, check_attribution
from rlmm.policy.precision import SidePrecision
from tests.conftest import build_sampler, build_trainer, sampling

OPTIONS = sampling(max_new_tokens=8)
BF16, FP32 = torch.bfloat16, torch.float32
# Which op class each parameter of the test models belongs to, written out by name (not from the code under
# test): a plan that casts another module than its class's is caught here.
PARAMETER_CLASSES = (
    (r"linear_attn\.", "linear_attention"),  # the hybrid's Gated DeltaNet, its gated norm included
    (r"embed_tokens\.", "embeddings"), (r"lm_head\.", "lm_head"), (r"norm\.weight$|layernorm\.weight$", "rmsnorm"),
    (r"self_attn\.[qkvo]_proj\.", "attn_proj"), (r"mlp\.gate\.weight$", "router"), (r"mlp\.", "mlp"))


def expected_class(name: str) -> str:
    return next(op for pattern, op in PARAMETER_CLASSES if re.search(pattern, name))


@pytest.fixture(scope="module", params=["dense", "moe", "hybrid"])
def model_and_rollouts(request, small_model_path, moe_model_path, hybrid_model_path, prompts):
    path = {"dense": small_model_path, "moe": moe_model_path, "hybrid": hybrid_model_path}[request.param]
    sampler = build_sampler("hf", path, SidePrecision("bf16", False), OPTIONS, seed=0)
    try:
        rollouts = sampler.generate(prompts, n=2)
    finally:
        sampler.close()
    return request.param, path, rollouts


@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
def test_every_op_low_is_the_bf16_trainer_every_op_fp32_the_fp32_one_and_a_raised_head_the_fp32_head(
        model_and_rollouts, backend):
    """Bit for bit, on the dense and the MoE model: the all-bf16 plan is `precision.trainer_dtype=bf16`, the
    all-fp32 plan the fp32 trainer, bf16 with only the LM head raised the bf16 trainer with an fp32 head; and
    after each plan the fp32 trainer scores as it did before (its weights restored to the bit)."""
    _, path, rollouts = model_and_rollouts
    trainer = build_trainer(backend, path, SidePrecision("fp32", False), OPTIONS)
    try:
        reference = trainer.logprobs(rollouts)
        ops = OpPrecisions(trainer.model)
        scored = {}
        for name, plan in (("bf16", Plan(BF16)), ("fp32", Plan(FP32)), ("bf16+fp32head", Plan(BF16, {"lm_head": FP32}))):
            with ops.precisions(plan):
                scored[name] = trainer.logprobs(rollouts)
            assert torch.equal(trainer.logprobs(rollouts), reference), name
            assert all(p.dtype == FP32 for p in trainer.model.parameters())
    finally:
        trainer.close()
    assert torch.equal(scored["fp32"], reference)
    for name, side in (("bf16", SidePrecision("bf16", False)), ("bf16+fp32head", SidePrecision("bf16", True))):
        other = build_trainer(backend, path, side, OPTIONS)
        try:
            assert torch.equal(scored[name], other.logprobs(rollouts)), name
        finally:
            other.close()
    assert not torch.equal(scored["bf16"], reference)  # there is a gap to attribute


def test_each_plan_casts_exactly_its_op_class(model_and_rollouts):
    """Raised alone in a bf16 plan, an op class's parameters are fp32 and every other parameter bf16 (and the
    other way round lowered alone); the op classes of the function-level ops act where they should: raising
    `attention` hands o_proj a bf16 input, raising `residual` hands each decoder layer an fp32 one; raising
    the embeddings alone changes nothing (a lookup of rounded weights is the rounded lookup)."""
    kind, path, rollouts = model_and_rollouts
    trainer = build_trainer("torch", path, SidePrecision("fp32", False), OPTIONS)
    try:
        ops = OpPrecisions(trainer.model)
        present = {"dense": set(), "moe": {"router"}, "hybrid": {"router", "linear_attention"}}[kind]
        assert ops.classes == tuple(op for op in OP_CLASSES if op not in ("router", "linear_attention") or op in present)
        for op in ops.classes:
            for plan, inside, outside in ((Plan(BF16, {op: FP32}), FP32, BF16), (Plan(FP32, {op: BF16}), BF16, FP32)):
                with ops.precisions(plan):
                    for name, parameter in trainer.model.named_parameters():
                        want = inside if expected_class(name) == op else outside
                        assert parameter.dtype == want, (op, name, parameter.dtype)
        model = trainer.model
        layer = next(layer for layer in model.model.layers if hasattr(layer, "self_attn"))  # the hybrid's 2nd
        seen = {}

        def record(name):
            def hook(module, args):  # returns None: the inputs go on as they are
                seen.setdefault(name, args[0].dtype)
            return hook

        handles = [layer.self_attn.o_proj.register_forward_pre_hook(record("o_proj")),
                   layer.register_forward_pre_hook(record("layer"))]
        try:
            for op in ("attention", "residual"):
                seen.clear()
                with ops.precisions(Plan(BF16, {op: FP32})):
                    trainer.logprobs(rollouts)
                assert seen == {"o_proj": BF16, "layer": FP32 if op == "residual" else BF16}, (op, seen)
        finally:
            for handle in handles:
                handle.remove()
        # the rotary embedding computes in its op class's dtype: what the modeling module's function receives
        modeling = sys.modules[type(layer).__module__]
        own_rope, rope_dtypes = modeling.apply_rotary_pos_emb, []

        def recording_rope(q, k, *args, **kwargs):
            rope_dtypes.append(q.dtype)
            return own_rope(q, k, *args, **kwargs)

        modeling.apply_rotary_pos_emb = recording_rope
        try:
            for plan, want in ((Plan(BF16), BF16), (Plan(BF16, {"rope": FP32}), FP32)):
                rope_dtypes.clear()
                with ops.precisions(plan):
                    trainer.logprobs(rollouts)
                assert rope_dtypes and set(rope_dtypes) == {want}, (plan, rope_dtypes)
        finally:
            modeling.apply_rotary_pos_emb = own_rope
        with ops.precisions(Plan(BF16)):
            low = trainer.logprobs(rollouts)
        with ops.precisions(Plan(BF16, {"embeddings": FP32})):
            assert torch.equal(trainer.logprobs(rollouts), low)
        for op in ("rope", "attention", "residual") + (("linear_attention",) if kind == "hybrid" else ()):
            with ops.precisions(Plan(BF16, {op: FP32})):
                assert not torch.equal(trainer.logprobs(rollouts), low), op
    finally:
        trainer.close()


def test_the_shares_follow_from_the_gaps_as_defined(small_model_path, prompts):
    """attribute(): share raised = 1 - G_raised / G_low and share lowered = G_lowered / G_low for each measure,
    the interaction their sum minus 1, two forwards and two per class."""
    sampler = build_sampler("hf", small_model_path, SidePrecision("bf16", False), OPTIONS, seed=0)
    try:
        rollouts = sampler.generate(prompts, n=2)
    finally:
        sampler.close()
    trainer = build_trainer("torch", small_model_path, SidePrecision("fp32", False), OPTIONS)
    try:
        result = attribute(trainer, rollouts, "bf16", ratio_cap=2.0)
    finally:
        trainer.close()
    assert result["classes"] == [op for op in OP_CLASSES if op not in ("router", "linear_attention")]  # a dense model
    assert result["forwards"] == 2 + 2 * len(result["classes"])
    low = result["all_low"]
    assert low["logprob_abs_diff_mean"] > 0 and low["kl_k3"] >= 0
    for key in ("logprob_abs_diff_mean", "kl_k3"):
        for op, parts in result["ops"].items():
            assert parts["share_raised"][key] == pytest.approx(1 - parts["raised"][key] / low[key]), op
            assert parts["share_lowered"][key] == pytest.approx(parts["lowered"][key] / low[key]), op
        for direction in ("raised", "lowered"):
            total = sum(parts[f"share_{direction}"][key] for parts in result["ops"].values())
            assert result["interaction"][direction][key] == pytest.approx(total - 1)


def test_what_cannot_be_attributed_is_refused_in_one_line(small_model_path):
    from omegaconf import OmegaConf

    plain = OmegaConf.create({"zero_stage": 0})
    with pytest.raises(ValueError, match="the sampler computes in fp32, so there is no low-precision gap"):
        check_attribution("fp32", "fp32", plain)
    with pytest.raises(ValueError, match="the fp32 reference is the trainer in fp32, got precision.trainer_dtype=bf16"):
        check_attribution("bf16", "bf16", plain)
    with pytest.raises(ValueError, match="must hold the full weights"):
        check_attribution("bf16", "fp32", OmegaConf.create({"zero_stage": 3}))
    with pytest.raises(ValueError, match="unknown op class 'softmax'"):
        Plan(BF16, {"softmax": FP32})
    trainer = build_trainer("torch", small_model_path, SidePrecision("bf16", False), OPTIONS)
    try:
        with pytest.raises(ValueError, match="the trainer's weights are bf16; the fp32 reference needs an fp32"):
            OpPrecisions(trainer.model)
    finally:
        trainer.close()


def test_rlmm_train_logs_the_attribution_every_n_steps_and_changes_nothing_else(small_model_path, tmp_path):
    """train.attribution.every=2 over 2 steps: attribution/*, weights/* and logits/* at steps 0 and 2 only,
    attribution.png written; every other value of the record equal to the same run without it (the greedy
    answers it scores take no random draw of the run's)."""
    import subprocess
    import sys

    from rlmm.run.records import read_steps
    from scripts.same_run import is_timing
    from tests.conftest import subprocess_env

    records = {}
    for every in (0, 2):
        run_dir = tmp_path / f"every-{every}"
        result = subprocess.run(
            [sys.executable, "-m", "rlmm.cli", "train", "model=hf", f"model.path={small_model_path}", "sampler=hf",
             "trainer=torch", "debug=train", f"train.attribution.every={every}", "train.attribution.prompts=4",
             f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=600, env=subprocess_env(),
            stdin=subprocess.DEVNULL)
        assert result.returncode == 0, result.stderr[-3000:]
        records[every] = read_steps(run_dir)
    assert (tmp_path / "every-2" / "attribution.png").stat().st_size > 10_000
    assert not (tmp_path / "every-0" / "attribution.png").exists()
    measured = ("attribution/", "weights/", "logits/")
    for off, on in zip(records[0], records[2], strict=True):
        keys = {k for k in on if k.startswith(measured)}
        if on["step"] in (0, 2):
            assert {f"attribution/{op}/share_raised/kl_k3" for op in OP_CLASSES
                    if op not in ("router", "linear_attention")} <= keys
            assert {"weights/layer_1/max_abs", "weights/lm_head/rms", "logits/attention_max",
                    "logits/lm_head_range_mean"} <= keys
            assert all(on[k] == on[k] for k in keys)  # finite numbers, no NaN
        else:
            assert not keys
        assert {k: v for k, v in on.items() if k not in keys and not is_timing(k)} == {
            k: v for k, v in off.items() if not is_timing(k)}
