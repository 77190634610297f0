"""A model whose LM head is tied to its input embedding (Qwen2.5-0.5B's is): the weights a trainer sends
name the shared tensor twice (`lm_head.weight` and `model.embed_tokens.weight`), and the transformers
sampler takes both. Found on a GPU: `rlmm train trainer=fsdp sampler=hf` on a tied model failed at its
first weight sync."""
from __future__ import annotations

import pytest
import torch

from rlmm.policy.precision import SidePrecision
from tests.conftest import build_sampler, build_trainer, sampling


def tied_model(path) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def test_a_trainers_weights_of_a_tied_model_load_into_the_transformers_sampler(small_model_path, tmp_path):
    from transformers import AutoTokenizer

    path = tied_model(tmp_path / "tied")
    AutoTokenizer.from_pretrained(small_model_path).save_pretrained(path)
    fp32 = SidePrecision("fp32", False)
    trainer = build_trainer("fsdp", path, fp32, sampling())
    sampler = build_sampler("hf", path, fp32, sampling(), seed=0)
    try:
        weights = {k: v + 0.01 for k, v in trainer.state_dict().items()}
        assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(weights)
        sampler.load_weights(weights)
        head = sampler.model.get_output_embeddings().weight
        assert torch.equal(head, weights["lm_head.weight"])
        assert head is sampler.model.get_input_embeddings().weight  # still one tensor
    finally:
        trainer.close()
        sampler.close()


def tied_twins(small_model_path, root) -> tuple[str, str]:
    """Two checkpoints of one model whose head is its input embedding: stored tied (as Qwen2.5-0.5B is), and
    stored untied with the head a copy of the embedding. Every engine must run them identically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(small_model_path)
    paths = []
    for name, tie in (("tied", True), ("untied", False)):
        model = AutoModelForCausalLM.from_pretrained(small_model_path, dtype=torch.float32)
        model.config.tie_word_embeddings = tie
        with torch.no_grad():
            model.get_output_embeddings().weight.copy_(model.get_input_embeddings().weight)
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        paths.append(str(root / name))
    return paths[0], paths[1]


@pytest.mark.parametrize("sampler_name", ["vllm", "hf"])
def test_a_trained_fp32_head_of_a_tied_model_reaches_the_sampler(small_model_path, tmp_path, prompts, sampler_name):
    """An fp32 head unties a tied one in the trainer. After a weight sync the sampler must sample with the
    trained head, not with its input embedding: vLLM builds a tied checkpoint tied and its loader drops
    `lm_head.weight` as an alias (at debug log level), and the transformers sampler wrote the head into
    the shared tensor, the embedding included. Measured before the fix with the head moved by 0.5 x N(0, 1):
    sampler vs trainer mean |δ| 15 nats (vLLM), against 9e-7 after (fp32 both sides)."""
    tied, _ = tied_twins(small_model_path, tmp_path)
    fp32 = SidePrecision("fp32", False)
    trainer = build_trainer("torch", tied, SidePrecision("fp32", True), sampling())
    sampler = build_sampler(sampler_name, tied, fp32, sampling(), seed=0, untie_head=True)
    try:
        weights = dict(trainer.state_dict())
        generator = torch.Generator().manual_seed(0)
        trained_head = weights["lm_head.weight"] + 0.5 * torch.randn(weights["lm_head.weight"].shape,
                                                                     generator=generator)
        with torch.no_grad():
            trainer.model.get_output_embeddings().weight.copy_(trained_head)
        weights = dict(trainer.state_dict())
        sampler.load_weights(weights)
        rollouts = sampler.generate(prompts, n=2)
        sampler_logprobs, mask = rollouts.padded_sampler_logprobs()
        gap = (trainer.logprobs(rollouts) - sampler_logprobs)[mask].abs().max().item()
        assert gap < 1e-4, f"sampler vs trainer max |δ| {gap:.3g} after the sync (fp32 both sides)"
        if sampler_name == "hf":  # the embedding kept its own values
            assert torch.equal(sampler.model.get_input_embeddings().weight, weights["model.embed_tokens.weight"])
            assert torch.equal(sampler.model.get_output_embeddings().weight, trained_head)
    finally:
        trainer.close()
        sampler.close()


@pytest.mark.parametrize("sampler_name", ["vllm", "hf"])
def test_a_tied_sampler_refuses_a_head_trained_apart(small_model_path, tmp_path, sampler_name):
    """A sampler that ties the head (built without `untie_head`) and is sent a head that differs from the
    embedding says so, naming the tensor, instead of sampling with one of the two."""
    tied, _ = tied_twins(small_model_path, tmp_path)
    fp32 = SidePrecision("fp32", False)
    sampler = build_sampler(sampler_name, tied, fp32, sampling(), seed=0)
    trainer = build_trainer("torch", tied, SidePrecision("fp32", True), sampling())
    try:
        weights = {k: v.clone() for k, v in trainer.state_dict().items()}
        sampler.load_weights(weights)  # equal values: the tie holds
        weights["lm_head.weight"] += 0.01
        with pytest.raises(ValueError, match=r"sampler=(vllm|hf): the trainer sent '.*(lm_head|embed_tokens).*' and "
                                             r"'.*(lm_head|embed_tokens).*' with different values"):
            sampler.load_weights(weights)
    finally:
        trainer.close()
        sampler.close()


def test_tied_and_untied_twins_train_identically_with_an_fp32_head(small_model_path, tmp_path, arithmetic_task):
    """The issue's measurement as a test: the same model stored tied and untied, trained with vLLM sampling in
    bf16 and DeepSpeed training in bf16 with an fp32 head (lr 1e-3, entropy bonus 0.1, so the weights move
    whatever the rewards), must log the same mismatch step by step. Measured before the fix: equal at step 1
    (the checkpoint's head), then 17x larger for the tied copy from step 2 on (its sampler's head was the
    trainer's embedding)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from rlmm.algos import GRPO, ClippedSurrogate
    from rlmm.config.options import CONF_DIR, from_yaml
    from rlmm.run.components import Components
    from rlmm.run.step import rl_step

    policy = instantiate(OmegaConf.load(CONF_DIR / "precision" / "bf16_fp32head.yaml"))
    options = sampling(max_new_tokens=6)
    algo = dict(group_size=4, normalize_std=True, objective=ClippedSurrogate(0.2, 0.28, None), loss_aggregation="token",
                kl_coef=0.0, kl_estimator="k3", entropy_coef=0.1, count_rejected=False, epochs=1, minibatches=1)
    curves = {}
    for name, path in zip(("tied", "untied"), tied_twins(small_model_path, tmp_path)):
        sampler = from_yaml("sampler", "vllm", model_path=path, precision=policy.sampler, sampling=options, seed=0,
                            untie_head=policy.trainer.fp32_head)
        trainer = from_yaml("trainer", "deepspeed", model_path=path, precision=policy.trainer, sampling=options,
                            micro_batch_size=16, lr=1e-3)
        c = Components(task=arithmetic_task, tokenizer=AutoTokenizer.from_pretrained(path), sampler=sampler,
                       trainer=trainer, correction=from_yaml("correction", "none"), algo=GRPO(**algo), sampling=options)
        try:
            examples = arithmetic_task.examples("train", 16)
            curves[name] = [rl_step(c, examples[4 * s:4 * s + 4], ratio_cap=2.0, reuse_training_forward=True)
                            ["mismatch/logprob_abs_diff_mean"] for s in range(4)]
        finally:
            c.close()
    tied, untied = curves["tied"], curves["untied"]
    # From the first sync on, both samplers hold the trainer's weights: the same figures. At step 1 they hold the
    # checkpoint's as vLLM loaded them, the tied copy's head one tensor with its embedding, which on some CPUs
    # takes another bf16 kernel path (AVX512-BF16 + AMX, 2026-12-02: 2% apart at step 1, equal after; equal at
    # every step on AVX2): a size the kernels set, so step 1 is held to 10%, far inside the bug's 17x.
    assert tied[1:] == pytest.approx(untied[1:], rel=1e-3), f"tied {tied} vs untied {untied}"
    assert tied[0] == pytest.approx(untied[0], rel=0.1), f"tied {tied} vs untied {untied}"
    assert max(tied[1:]) < 3 * tied[0], f"the mismatch grew after the first sync: {tied}"
