"""`rlmm probe` end to end: the real CLI, the built-in tiny model, real engines."""
import json
import subprocess
from pathlib import Path
import sys

import pytest

from rlmm.config.options import from_yaml
from tests.conftest import subprocess_env
from tests.this_cpu import aten_vectorized

SMALL = ["probe.num_prompts=8", "probe.samples_per_prompt=2", "probe.trainer_micro_batch_sizes=[1,16]",
         "probe.batch_invariance.num_prompts=2", "probe.batch_invariance.num_completions=3",
         "probe.batch_invariance.max_batch_size=8"]


def run_probe(tmp_path, *overrides: str) -> dict:
    result = subprocess.run([sys.executable, "-m", "rlmm.cli", "probe", *SMALL, *overrides, f"hydra.run.dir={tmp_path}"],
                            capture_output=True, text=True, timeout=900, env=subprocess_env())
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert (tmp_path / "probe.png").stat().st_size > 10_000
    # strict JSON: a NaN figure (an early-vs-late window no answer reaches) is null, never a bare NaN
    record = json.loads((tmp_path / "probe.json").read_text(), parse_constant=lambda name: pytest.fail(name))
    record["stdout"] = result.stdout
    return record


def test_default_probe_vllm_deepspeed(tmp_path):
    """The built-in default: vLLM bf16 sampler, DeepSpeed fp32 trainer, W&B offline; with the op-class
    attribution (probe.attribution) and the layer attribution (probe.layers) in the record, their tables, their
    plots and `rlmm table`'s values."""
    from rlmm.mismatch.layer_attribution import site_names
    from rlmm.table.discovery import probe_values

    record = run_probe(tmp_path, "probe.attribution=true", "probe.layers=true")
    assert record["choices"]["sampler"] == "vllm" and record["choices"]["trainer"] == "deepspeed"
    assert record["precision"]["actual"]["sampler"]["dtype"] == "bf16"
    assert record["precision"]["actual"]["trainer"]["dtype"] == "fp32"
    assert record["precision"]["silent_casts"] == []
    metrics = record["sampler_vs_trainer"]
    assert metrics["num_tokens"] > 0 and metrics["logprob_abs_diff_mean"] > 0  # bf16 vs fp32 differ
    assert record["trainer_vs_itself"]["logprob_abs_diff_mean"] < metrics["logprob_abs_diff_mean"]
    agreement = record["agreement"]  # bf16 vs fp32: never every token to the same bits
    assert agreement["num_tokens"] == metrics["num_tokens"] and not agreement["bitwise_identical"]
    assert 0 <= agreement["frac_tokens_identical"] < 1
    assert f"not bitwise identical, {agreement['frac_tokens_identical']:.1%} of {metrics['num_tokens']} tokens" in record["stdout"]
    assert record["trainer_vs_itself"]["micro_batch_sizes"] == [1, 16]
    assert record["trainer_vs_itself"]["num_tokens"] == metrics["num_tokens"]  # the same rows, scored twice
    inv = record["sampler_vs_itself"]  # SMALL: 3 greedy completions in batches of 1, 4 and 8; 2 prompts
    assert inv["num_greedy_completions"] == 3 and inv["batch_sizes"] == [1, 4, 8]
    assert 1 <= inv["unique_greedy_completions"] <= 3
    assert inv["frac_identical_alone_vs_batched"] in (0, 0.5, 1)
    assert len(inv["first_divergence_index"]) == round(2 * (1 - inv["frac_identical_alone_vs_batched"]))
    assert all(0 <= i < 16 for i in inv["first_divergence_index"])
    assert 0 <= inv["logprob_abs_diff_mean"] <= inv["logprob_abs_diff_max"] < 1
    assert f"{inv['unique_greedy_completions']} unique of 3 completions" in record["stdout"]
    assert 1 <= inv["unique_greedy_completions_mean"] <= 3 and inv["num_observations"] == 1 + 2 + 2  # sizes 1, 4, 8
    assert 0 <= record["rollouts"]["mean_reward"] <= 1
    assert "sampler vs trainer" in record["stdout"] and "kl_k3" in record["stdout"]
    decoding = record["decode_vs_prefill"]  # vLLM re-scoring its own tokens in one prefill
    assert decoding["num_tokens"] == metrics["num_tokens"] and 0 <= decoding["frac_responses_identical"] <= 1
    assert decoding["bitwise_identical"] == (decoding["first_divergence_min"] is None)
    assert decoding["logprob_abs_diff_max"] < 0.1 and "decode vs prefill" in record["stdout"]
    assert record["real_vs_simulated"] == {}  # probe.simulated: [] by default
    attribution = record["attribution"]  # bf16 against the fp32 DeepSpeed trainer, on the probe's own rollouts
    assert attribution["dtype"] == "bf16" and attribution["tokens"] == metrics["num_tokens"]
    assert list(attribution["ops"]) == ["embeddings", "rmsnorm", "attn_proj", "rope", "attention", "mlp", "residual",
                                        "lm_head"]
    assert attribution["all_low"]["logprob_abs_diff_mean"] > 0
    assert "attribution: the bf16 gap against fp32" in record["stdout"]
    assert (tmp_path / "attribution.png").stat().st_size > 10_000
    values = probe_values(record)
    assert values["attribution/lm_head/share_raised/kl_k3"] == attribution["ops"]["lm_head"]["share_raised"]["kl_k3"]
    layers = record["layers"]  # the vLLM sampler's hidden states against the DeepSpeed trainer's, in bf16 and fp32
    assert layers["sites"] == site_names(4) and list(layers["comparisons"]) == ["kernels", "precision", "total"]
    assert layers["tokens"] == layers["prompt_tokens"] + layers["response_tokens"]
    assert layers["response_tokens"] == metrics["num_tokens"] - record["rollouts"]["num"]  # each row's last: never fed
    for name, figures in layers["comparisons"].items():
        assert all(0 <= e < 1 for e in figures["rel_error"]), (name, figures["rel_error"])
        assert all(0 <= f <= 1 for f in figures["frac_identical"])
    kernels = layers["comparisons"]["kernels"]
    assert kernels["frac_identical"][0] == 1.0  # an embedding lookup of the same bf16 weights, in either engine
    assert layers["comparisons"]["precision"]["rel_error"][0] > 0  # the fp32 embeddings rounded to bf16
    assert "layers: at bf16 the sampler" in record["stdout"] and (tmp_path / "layers.png").stat().st_size > 10_000
    assert values["layers/kernels/rel_error/norm"] == kernels["rel_error"][-1]
    by_entropy = record["entropy_profile"]  # the trainer's H_t of its scoring forward: finite on every response token
    assert by_entropy["bucket_start"] == [0, 0.1, 0.5, 1, 2]
    assert by_entropy["bucket_end"] == [0.1, 0.5, 1, 2, None]  # the last one's inf: null in strict JSON
    assert sum(by_entropy["num_tokens"]) == metrics["num_tokens"]
    for i, tokens in enumerate(by_entropy["num_tokens"]):  # an empty bucket's figures are null in strict JSON
        figures = [by_entropy[key][i] for key in ("logprob_abs_diff_mean", "kl_k3", "ratio_std")]
        assert all(f is None for f in figures) if tokens == 0 else all(f >= 0 for f in figures), (i, figures)
    for key in ("logprob_abs_diff_mean", "kl_k3"):  # the buckets split the same tokens' sampler-vs-trainer figures
        assert sum(n * by_entropy[key][i] for i, n in enumerate(by_entropy["num_tokens"]) if n) == pytest.approx(
            metrics[key] * metrics["num_tokens"], rel=1e-6), key
    assert "by the trainer's token entropy H" in record["stdout"]
    assert list((tmp_path / "wandb").glob("offline-run-*")), "W&B offline run directory missing"
    assert "WANDB_API_KEY" not in (tmp_path / "probe.json").read_text()


def test_fp32_hf_sampler_vs_fp32_trainer_is_near_zero(tmp_path, small_model_path):
    """Any Hugging Face checkpoint directory works as model=hf."""
    record = run_probe(tmp_path, "model=hf", f"model.path={small_model_path}", "sampler=hf", "trainer=torch",
                       "precision=fp32", "logger=none")
    assert record["model_path"] == small_model_path
    assert record["precision"]["actual"]["sampler"] == {"dtype": "fp32", "head_dtype": "fp32"}
    assert record["sampler_vs_trainer"]["logprob_abs_diff_max"] < 1e-4
    assert record["sampler_vs_itself"]["unique_greedy_completions"] >= 1
    # transformers' KV-cache decoding against one forward over the same tokens: fp32 rounding apart, the same.
    assert record["decode_vs_prefill"]["num_tokens"] == record["sampler_vs_trainer"]["num_tokens"]
    assert record["decode_vs_prefill"]["logprob_abs_diff_max"] < 1e-4
    # Whether fp32 transformers generate and fp32 torch scoring agree to the bit depends on the CPU's kernels:
    # the verdict must follow the measured gap either way.
    agreement = record["agreement"]
    assert agreement["bitwise_identical"] == (record["sampler_vs_trainer"]["logprob_abs_diff_max"] == 0)
    assert ("bitwise identical on all" in record["stdout"]) == agreement["bitwise_identical"]


@pytest.mark.parametrize("backend", ["torch", "deepspeed", "fsdp"])
def test_trainer_entropy_is_that_of_the_scoring_forward(backend, small_model_path, prompts):
    """`logprobs_with_entropy` (the probe's scoring): `logprobs`' values to the bit, and H_t = per_token_entropy of
    the processed (here tempered) logits at each response position, 0 past each response."""
    import torch

    from rlmm.algos.entropy import per_token_entropy
    from rlmm.policy.precision import SidePrecision
    from rlmm.policy.rollouts import Rollouts
    from tests.conftest import build_trainer, sampling

    responses = [[5, 9, 12, 7], [3], [20, 21, 22, 23, 24, 25], [8, 8]]  # ragged rows: a padded micro-batch of 3, then 1
    rollouts = Rollouts(prompt_ids=prompts[:4], response_ids=responses,
                        sampler_logprobs=[torch.zeros(len(r)) for r in responses], finish_reasons=["length"] * 4)
    trainer = build_trainer(backend, small_model_path, SidePrecision("fp32", False), sampling(temperature=0.7),
                            micro_batch_size=3)
    logprobs, entropy = trainer.logprobs_with_entropy(rollouts)
    assert torch.equal(logprobs, trainer.logprobs(rollouts))
    assert entropy.shape == logprobs.shape and entropy.dtype == torch.float32
    with torch.no_grad():
        for i, (prompt, response) in enumerate(zip(rollouts.prompt_ids, responses)):
            logits = trainer.model(input_ids=torch.tensor([prompt + response])).logits[0]  # the head unaimed: all V
            expected = per_token_entropy(logits[len(prompt) - 1:-1] / 0.7)  # the positions predicting the response
            torch.testing.assert_close(entropy[i, :len(response)], expected, rtol=1e-5, atol=1e-5)
            assert not entropy[i, len(response):].any()
    trainer.close()


def test_entropy_edges_are_checked_before_any_engine_starts():
    from rlmm.probe.checks import check_entropy_edges

    assert check_entropy_edges([0.1, 1]) == (0.1, 1.0)
    for bad in ([], [0.0, 1.0], [1.0, 0.5], [0.5, 0.5]):
        with pytest.raises(ValueError, match=r"^probe.entropy_edges: increasing values > 0 \(nats\), got"):
            check_entropy_edges(bad)


def test_token_agreement_counts_tokens_scored_to_the_same_bits():
    import torch

    from rlmm.mismatch.metrics import token_agreement
    from rlmm.probe.report import agreement_verdict

    train = torch.tensor([[-0.5, -1.0, -2.0], [-0.25, -3.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    sampler = train.clone()
    sampler[1, 2] = -9.0  # a padded position: never counted
    same = token_agreement(train, sampler, mask)
    assert same == {"num_tokens": 5, "frac_tokens_identical": 1.0, "bitwise_identical": True}
    assert "bitwise identical on all 5 tokens" in agreement_verdict(same)
    sampler[0, 1] = torch.nextafter(train[0, 1], torch.tensor(0.0))  # one ulp apart: not the same bits
    one_off = token_agreement(train, sampler, mask)
    assert one_off == {"num_tokens": 5, "frac_tokens_identical": 0.8, "bitwise_identical": False}
    assert agreement_verdict(one_off).endswith("not bitwise identical, 80.0% of 5 tokens score the same bits")


def test_gsm8k_task_with_longer_answers(tmp_path, small_model_path):
    """Word problems from a local JSONL file (the arithmetic-trained model answers them badly, which is
    fine: the probe measures mismatch, not skill)."""
    data = Path(__file__).parent / "data" / "gsm8k_sample.jsonl"
    record = run_probe(tmp_path, "model=hf", f"model.path={small_model_path}", "task=gsm8k", f"task.path={data}",
                       "sampler=hf", "trainer=torch", "precision=bf16_sampler_fp32_trainer", "logger=none",
                       "sampling.max_new_tokens=32", "probe.num_prompts=2", "probe.split=test",
                       "probe.early_vs_late.response_tokens=2", "probe.early_vs_late.window=1")
    profile = record["position_profile"]
    assert sum(profile["num_tokens"]) == record["sampler_vs_trainer"]["num_tokens"]  # every token in a bucket
    early_late = record["early_vs_late"]  # 4 rollouts (3-4-token answers); those of >= 2 tokens, positions 0 and 1
    assert 1 <= early_late["num_sequences"] <= 4 and early_late["early_logprob_abs_diff_mean"] > 0  # bf16 vs fp32
    assert f"early vs late in the same {early_late['num_sequences']} responses of >= 2 tokens" in record["stdout"]
    from rlmm.table.discovery import probe_values

    assert probe_values(record)["position/late_minus_early_logprob_abs_diff"] == pytest.approx(
        early_late["late_logprob_abs_diff_mean"] - early_late["early_logprob_abs_diff_mean"])
    assert len(profile["bucket_start"]) <= 8
    assert record["sampler_vs_trainer"]["logprob_abs_diff_mean"] > 0


def bf16_rollouts_and_trainer(model_path, prompts):
    """A bf16 transformers sampler, its 8 rollouts of 4 prompts, and a bf16 torch trainer in micro-batches of 3."""
    from rlmm.policy.precision import SidePrecision
    from tests.conftest import sampling

    options = sampling(max_new_tokens=6)
    bf16 = SidePrecision("bf16", False)
    sampler = from_yaml("sampler", "hf", model_path=model_path, precision=bf16, sampling=options, seed=0)
    rollouts = sampler.generate(prompts[:4], n=2)  # 8 rows
    trainer = from_yaml("trainer", "torch", model_path=model_path, precision=bf16, sampling=options,
                        micro_batch_size=3)
    return sampler, rollouts, trainer


def test_trainer_against_itself_scores_at_the_two_micro_batch_sizes(small_model_path, prompts):
    """The trainer-vs-itself figures come from two scorings of the same rows in micro-batches of each size."""
    import torch

    from rlmm.probe.measurements import trainer_against_itself

    sampler, rollouts, trainer = bf16_rollouts_and_trainer(small_model_path, prompts)
    shapes = []
    forward = trainer._forward
    trainer._forward = lambda batch: shapes.append(batch.ids.size(0)) or forward(batch)
    record = trainer_against_itself(trainer, rollouts, [8, 2], ratio_cap=2.0)
    assert record["micro_batch_sizes"] == [2, 8]
    assert sorted(shapes) == [2, 2, 2, 2, 8]  # one pass in micro-batches of 2, one of all 8 rows
    assert record["num_tokens"] == sum(map(len, rollouts.response_ids))
    with torch.no_grad():  # the figures are those of the two scorings, larger size first
        from rlmm.mismatch.metrics import mismatch_metrics

        _, mask = rollouts.padded_sampler_logprobs()
        trainer._forward = forward
        expected = mismatch_metrics(trainer.logprobs(rollouts, 8), trainer.logprobs(rollouts, 2), mask, ratio_cap=2.0)
    assert {k: v for k, v in record.items() if k != "micro_batch_sizes"} == pytest.approx(expected, nan_ok=True)
    with pytest.raises(ValueError, match=r"probe.trainer_micro_batch_sizes: two different sizes >= 1, got \[4, 4\]"):
        trainer_against_itself(trainer, rollouts, [4, 4], ratio_cap=2.0)
    trainer.close()
    sampler.close()


class BatchDependentSampler:
    """A scripted greedy engine that is not batch-invariant: in a batch of more than 4 prompts its third
    token changes (7 -> 9), and every log-prob drops by 0.001 per prompt in the batch beyond the first."""

    def generate(self, prompt_ids, *, n=1, greedy=False):
        import torch

        from rlmm.policy.rollouts import Rollouts

        size = len(prompt_ids)
        tokens = [5, 6, 7, 8] if size <= 4 else [5, 6, 9, 8]
        return Rollouts(prompt_ids=list(prompt_ids), response_ids=[list(tokens) for _ in prompt_ids],
                        sampler_logprobs=[torch.full((4,), -0.5 - 0.001 * (size - 1)) for _ in prompt_ids],
                        finish_reasons=["length"] * size)


def test_sampler_against_itself_counts_what_the_batch_changes(small_model_path, arithmetic_task):
    """The sampler-vs-itself figures on an engine whose output is known to depend on the batch size:
    batches of 1, 4 (linspace(1, 8, 3) rounded) and 8 give 2 distinct completions of each target; each
    target decoded alone vs in the batch of 8 first differs at token 2, and their log-probs differ by
    0.007 before it."""
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from rlmm.conversation.chat import RawPrompts
    from rlmm.probe.measurements import batch_invariance

    options = OmegaConf.create({"split": "test", "batch_invariance": {"num_prompts": 2, "num_completions": 3,
                                                                      "max_batch_size": 8}})
    record = batch_invariance(BatchDependentSampler(), arithmetic_task,
                              RawPrompts(AutoTokenizer.from_pretrained(small_model_path), arithmetic_task), options)
    assert record["batch_sizes"] == [1, 4, 8]
    assert record["unique_greedy_completions"] == 2 and record["num_greedy_completions"] == 3
    # The second target is in the batches of 4 and 8 (not 1): 2 completions, 2 observations.
    assert record["unique_greedy_completions_mean"] == 2 and record["frac_prompts_batch_invariant"] == 0
    assert record["num_observations"] == 5
    assert record["frac_identical_alone_vs_batched"] == 0
    assert record["first_divergence_index"] == [2, 2]
    assert record["logprob_abs_diff_mean"] == pytest.approx(0.007, abs=1e-6)
    assert record["logprob_abs_diff_max"] == pytest.approx(0.007, abs=1e-6)


LAYOUTS = ["trainer.micro_batch_size=4", "probe.trainer_layouts.token_budget.micro_batch_tokens=64",
           "probe.trainer_layouts.budget_padding_free.micro_batch_tokens=64"]


def test_trainer_across_layouts_fp32_in_the_record_table_and_plot(tmp_path, small_model_path):
    """fp32: every layout scores the trainer's log-probs to within rounding of the padded reference, and the
    reference against itself (`padded`, the same layout) exactly; `rlmm table` reads each figure."""
    from rlmm.table.discovery import probe_values

    record = run_probe(tmp_path, "model=hf", f"model.path={small_model_path}", "sampler=hf", "trainer=torch",
                       "precision=fp32", "logger=none", *LAYOUTS)
    itself = record["trainer_vs_itself"]
    layouts = itself["layouts"]
    assert list(layouts) == ["reference", "padded", "token_budget", "padding_free", "budget_padding_free"]
    assert layouts["reference"] == {"micro_batch_size": 4, "micro_batch_tokens": None, "padding_free": False,
                                    "micro_batches": 4}  # 16 rows, 4 a micro-batch
    assert layouts["token_budget"]["micro_batch_tokens"] == 64 and layouts["token_budget"]["micro_batches"] != 4
    assert layouts["padding_free"]["padding_free"] and layouts["padding_free"]["micro_batches"] == 4
    assert itself["padded/logprob_abs_diff_max"] == 0 and itself["padded/kl_k3"] == 0
    for name in ("token_budget", "padding_free", "budget_padding_free"):
        assert itself[f"{name}/num_tokens"] == record["sampler_vs_trainer"]["num_tokens"]
        assert 0 <= itself[f"{name}/logprob_abs_diff_mean"] <= itself[f"{name}/logprob_abs_diff_max"] < 1e-5, name
        assert f"{name} " in record["stdout"]
    assert "trainer vs itself across layouts" in record["stdout"]
    values = probe_values(record)
    assert values["trainer_vs_itself/padding_free/logprob_abs_diff_max"] == itself["padding_free/logprob_abs_diff_max"]
    assert values["trainer_vs_itself/token_budget/logprob_abs_diff_mean"] == itself["token_budget/logprob_abs_diff_mean"]
    assert not any(key.startswith("trainer_vs_itself/layouts") for key in values)


def test_trainer_across_layouts_scores_each_layout(small_model_path, prompts):
    """Each layout's figures come from forwards laid out as it says (a token budget: micro-batches within it,
    rows longest first; padding-free: one packed row a micro-batch), and in bf16 packing changes the
    log-probs (nonzero |Δ|), while the reference scored twice does not."""
    from rlmm.probe.checks import check_layouts
    from rlmm.probe.measurements import trainer_across_layouts

    sampler, rollouts, trainer = bf16_rollouts_and_trainer(small_model_path, prompts)
    from omegaconf import OmegaConf

    settings = OmegaConf.create({"budget": {"micro_batch_tokens": 40, "padding_free": False},
                                 "packed": {"micro_batch_tokens": None, "padding_free": True},
                                 "same": {"micro_batch_tokens": None, "padding_free": False}})
    layouts = check_layouts(settings, 2)
    batches = []
    forward = trainer._forward
    trainer._forward = lambda batch: batches.append(batch) or forward(batch)
    record = trainer_across_layouts(trainer, rollouts, layouts, ratio_cap=2.0)
    trainer._forward = forward
    lengths = [len(p) + len(r) for p, r in zip(rollouts.prompt_ids, rollouts.response_ids)]
    counts = {name: layout["micro_batches"] for name, layout in record["layouts"].items()}
    assert counts["reference"] == counts["packed"] == counts["same"] == 4  # 8 rows, 2 a micro-batch
    reference, budget = batches[:4], batches[4:4 + counts["budget"]]
    packed, same = batches[4 + counts["budget"]:8 + counts["budget"]], batches[8 + counts["budget"]:]
    assert len(same) == 4 and all(b.positions is None and b.ids.size(0) == 2 for b in reference + same)
    assert all(b.positions is None and b.attention.sum() <= 40 for b in budget)  # real tokens within the budget
    assert sorted(int(b.attention.sum()) for b in budget) != sorted(int(b.attention.sum()) for b in reference)
    assert all(b.positions is not None and b.ids.size(0) == 1 and b.attention is None for b in packed)
    assert sum(b.ids.size(1) for b in packed) == sum(lengths)  # no padding computed
    assert record["same/logprob_abs_diff_max"] == 0
    assert 0 <= record["packed/logprob_abs_diff_max"] < float("inf")
    if aten_vectorized():
        # bf16: packing changes the vectorized kernels' shapes and so their reduction order; ATen's unvectorized
        # kernels (`default`) reduce in one order at every shape and give 0 (docs/testing.md, machine-dependent)
        assert record["packed/logprob_abs_diff_max"] > 0
    # regrouped padded rows: the same rows' scores to bf16 rounding (0 on row-wise kernels); a row scored
    # against another row's tokens would differ by nats
    assert record["budget/logprob_abs_diff_max"] < 0.05, record["budget/logprob_abs_diff_max"]
    assert record["packed/num_tokens"] == sum(map(len, rollouts.response_ids))
    with pytest.raises(ValueError, match="probe.trainer_layouts.bad: trainer.micro_batch_tokens: must be null"):
        check_layouts(OmegaConf.create({"bad": {"micro_batch_tokens": 0, "padding_free": False}}), 2)
    with pytest.raises(ValueError, match="probe.trainer_layouts: 'a/b' is not a name"):
        check_layouts(OmegaConf.create({"a/b": {"micro_batch_tokens": None, "padding_free": False}}), 2)
    trainer.close()
    sampler.close()


def test_real_vs_simulated_interpolates_the_matching_epsilon_log_log():
    from rlmm.probe.measurements import real_vs_simulated

    simulated = {0.01: {"logprob_abs_diff_mean": 1e-3, "kl_k3": 1e-5}, 0.1: {"logprob_abs_diff_mean": 1e-2, "kl_k3": 1e-3},
                 0.2: {"logprob_abs_diff_mean": 4e-2, "kl_k3": 4e-3}}
    record = real_vs_simulated({"logprob_abs_diff_mean": 1e-2 * 2 ** 0.5, "kl_k3": 1e-4}, simulated)
    assert record["epsilons"] == [0.01, 0.1, 0.2] and set(record["simulated"]) == {"0.01", "0.1", "0.2"}
    assert record["matching_epsilon"]["logprob_abs_diff_mean"] == pytest.approx(0.1 * 2 ** 0.25)  # between 0.1 and 0.2
    assert record["matching_epsilon"]["kl_k3"] == pytest.approx(0.01 * 10 ** 0.5)  # halfway in log between 0.01, 0.1
    assert real_vs_simulated({"logprob_abs_diff_mean": 1.0, "kl_k3": 1e-9}, simulated)["matching_epsilon"] == {
        "logprob_abs_diff_mean": None, "kl_k3": None}  # outside the grid


def test_decode_vs_prefill_finds_where_the_engine_departs_from_itself(small_model_path, prompts):
    """sampler=hf in fp32: decoding and one prefill agree to fp32 rounding; a response whose decode log-probs are
    moved from position 1 on is reported as first differing at 1."""
    import torch

    from rlmm.policy.precision import SidePrecision
    from rlmm.probe.measurements import decode_vs_prefill
    from tests.conftest import build_sampler, sampling

    options = sampling(max_new_tokens=8)
    sampler = build_sampler("hf", small_model_path, SidePrecision("fp32", False), options, seed=0)
    rollouts = sampler.generate(prompts[:4], n=2)
    prefill = sampler.prefill_logprobs(rollouts.prompt_ids, rollouts.response_ids)
    assert all(torch.allclose(p, d, atol=1e-5) for p, d in zip(prefill, rollouts.sampler_logprobs))
    long = next(i for i, r in enumerate(rollouts.response_ids) if len(r) > 2)
    for i, row in enumerate(prefill):  # the decode log-probs made exactly the prefill's, then one row moved
        rollouts.sampler_logprobs[i] = row.clone()
    rollouts.sampler_logprobs[long][1:] -= 0.5
    record = decode_vs_prefill(sampler, rollouts, options, ratio_cap=2.0, bucket_size=2)
    assert record["first_divergence_min"] == record["first_divergence_max"] == 1
    assert record["frac_responses_identical"] == pytest.approx(1 - 1 / len(prefill))
    assert record["logprob_abs_diff_max"] == pytest.approx(0.5)
    tempered = sampling(max_new_tokens=8, temperature=0.7)
    assert "skipped" in decode_vs_prefill(sampler, rollouts, tempered, ratio_cap=2.0, bucket_size=2)
