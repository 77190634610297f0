"""`rlmm train`: the RL step on real engines; every correction runs 2 steps; the main job end to end."""
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from rlmm.algos.surrogate import ClippedSurrogate
from rlmm.config.options import CONF_DIR, from_yaml, group_options
from rlmm.corrections.base import check_versions
from rlmm.policy.precision import SidePrecision
from rlmm.run.components import Components
from rlmm.run.step import SampledBatch, rl_step, rl_update
from tests.conftest import build_trainer, sampling, subprocess_env
from tests.test_corrections import mixed_staleness

# Every option, those that read each token's staleness (`needs_versions`) on stand-in versions (`step_with_versions`)
CORRECTIONS = sorted(p.stem for p in (CONF_DIR / "correction").glob("*.yaml"))
ALGO = dict(group_size=4, normalize_std=True, objective=ClippedSurrogate(0.2, 0.28, None), loss_aggregation="token",
            kl_coef=0.0, kl_estimator="k3", entropy_coef=0.0, count_rejected=False, epochs=1, minibatches=1)


def step_with_versions(c: Components, prompts: list, **step) -> dict[str, float]:
    """`rl_step`, for a correction that reads each token's staleness: a synchronous run tracks no versions and
    refuses it (`check_versions`), so the batch it samples gets `mixed_staleness` as its versions, a stand-in for
    those partial rollouts give (the tokens are sampled now; the correction reads only the numbers)."""
    with pytest.raises(ValueError, match="does not track"):
        check_versions(c.correction, tracked=False)
    batch = SampledBatch.now(c, prompts, step.pop("refill", None))
    batch = replace(batch, token_staleness=mixed_staleness(batch.rollouts.padded_sampler_logprobs()[1]))
    return rl_update(c, batch, **step)


def make_components(model_path, task, sampler_name, trainer_name, precision_name):
    from transformers import AutoTokenizer

    from rlmm.algos import GRPO

    policy = instantiate(OmegaConf.load(CONF_DIR / "precision" / f"{precision_name}.yaml"))
    options = sampling(max_new_tokens=6)
    sampler = from_yaml("sampler", sampler_name, model_path=model_path, precision=policy.sampler, sampling=options,
                        seed=0)
    try:
        trainer = from_yaml("trainer", trainer_name, model_path=model_path, precision=policy.trainer, sampling=options,
                            micro_batch_size=8, lr=1e-4)
    except BaseException:
        sampler.close()  # one engine per process at a time: never leave a vLLM engine behind
        raise
    return Components(task=task, tokenizer=AutoTokenizer.from_pretrained(model_path), sampler=sampler,
                      trainer=trainer, correction=None, algo=GRPO(**ALGO), sampling=options)


class ParityTask:
    """Arithmetic prompts with a reward that varies inside every group (odd-length completions win), so
    each step has non-zero advantages and really moves the weights."""

    def __init__(self, task):
        self.task = task

    def examples(self, split, n):
        return self.task.examples(split, n)

    def reward(self, example, completion):
        return float(len(completion) % 2)


PRECISIONS = sorted(p.stem for p in (CONF_DIR / "precision").glob("*.yaml"))
TRAINERS = group_options("trainer")  # not conf/trainer/_base.yaml, the keys they share
COMBINATIONS = [(s, t, p) for s in ("vllm", "hf") for t in TRAINERS for p in PRECISIONS]
# The built-in default first, then each sampler, trainer and kind of precision once; the rest of the grid
# (vllm-deepspeed-bf16 and hf-deepspeed-fp32 among it) runs under `slow`.
QUICK = {("vllm", "deepspeed", "bf16_sampler_fp32_trainer"), ("hf", "torch", "fp32"), ("vllm", "torch", "bf16_fp32head"),
         ("hf", "fsdp", "bf16_fp32head")}


@pytest.mark.parametrize("sampler_name,trainer_name,precision_name", [
    pytest.param(*combo, marks=() if combo in QUICK else pytest.mark.slow) for combo in COMBINATIONS])
def test_every_correction_runs_two_steps(small_model_path, arithmetic_task, sampler_name, trainer_name,
                                         precision_name):
    from rlmm.trainers.deepspeed_backend import DeepSpeedTrainer

    policy = instantiate(OmegaConf.load(CONF_DIR / "precision" / f"{precision_name}.yaml"))
    if trainer_name == "deepspeed" and DeepSpeedTrainer.unsupported(policy.trainer):
        pytest.skip(DeepSpeedTrainer.unsupported(policy.trainer))
    c = make_components(small_model_path, ParityTask(arithmetic_task), sampler_name, trainer_name, precision_name)
    prompts = arithmetic_task.examples("train", 4)  # 4 prompts x 4 samples = 16 rows = 2 micro-batches
    try:
        for name in CORRECTIONS:
            c.correction = instantiate(OmegaConf.load(CONF_DIR / "correction" / f"{name}.yaml"))
            before = {k: v.clone() for k, v in c.trainer.state_dict().items()}
            step = step_with_versions if c.correction.needs_versions else rl_step
            for reuse_training_forward in (False, True):  # scoring pass first, then the one-pass step
                metrics = step(c, prompts, ratio_cap=2.0, reuse_training_forward=reuse_training_forward)
            namespaces = ("rollout", "mismatch", "agreement", "correction", "loss", "perf", "train")
            assert all(k.split("/")[0] in namespaces for k in metrics)
            assert metrics["train/skipped"] == 0
            assert metrics["mismatch/num_tokens"] > 0 and torch.isfinite(torch.tensor(metrics["loss/loss"]))
            after = c.trainer.state_dict()
            assert any(not torch.equal(before[k], after[k]) for k in before), f"{name}: weights did not change"
            # the sampler has the trainer's new weights: fp32 engines agree to rounding after the sync
            if precision_name == "fp32":
                rollouts = c.sampler.generate([c.tokenizer(e.prompt).input_ids for e in prompts])
                sampler_lp, mask = rollouts.padded_sampler_logprobs()
                assert (c.trainer.logprobs(rollouts) - sampler_lp)[mask].abs().max() < 1e-4, name
    finally:
        c.trainer.close()
        c.sampler.close()


ALGOS = sorted(p.stem for p in (CONF_DIR / "algo").glob("*.yaml"))


@pytest.mark.parametrize("algo_name,correction_name", [
    pytest.param(a, k, marks=() if k == "tis" or (a, k) == ("dapo", "icepop") else pytest.mark.slow)
    for a in ALGOS for k in CORRECTIONS])
def test_every_algorithm_runs_two_steps_with_each_correction(small_model_path, arithmetic_task, algo_name,
                                                             correction_name):
    """Each algorithm x correction (TIS with every algorithm by default, the product under `slow`): two steps,
    scored first and one-pass, with a refill for dynamic sampling; the weights move and reach the sampler."""
    c = make_components(small_model_path, ParityTask(arithmetic_task), "hf", "torch", "fp32")
    c.algo = from_yaml("algo", algo_name, group_size=4)  # 4 prompts x 4 = 16 rows: 4 rows per GSPO minibatch
    c.correction = from_yaml("correction", correction_name)
    if c.algo.critic:  # PPO: a value model trained by the same backend (rlmm/run/critic.py)
        from rlmm.run.critic import ValueCritic

        c.critic = ValueCritic(build_trainer("torch", small_model_path, SidePrecision("fp32", False), c.sampling,
                                             micro_batch_size=8, value_head=True, lr=c.algo.critic["lr"]),
                               warmup_steps=0)
    prompts = arithmetic_task.examples("train", 8)
    try:
        before = {k: v.clone() for k, v in c.trainer.state_dict().items()}
        step = step_with_versions if c.correction.needs_versions else rl_step
        for reuse_training_forward in (False, True):
            metrics = step(c, prompts[:4], ratio_cap=2.0, reuse_training_forward=reuse_training_forward,
                           refill=lambda sampling_round: prompts[4:])
            assert metrics["train/skipped"] == 0 and torch.isfinite(torch.tensor(metrics["loss/loss"]))
        after = c.trainer.state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before), "the weights did not change"
        rollouts = c.sampler.generate([c.tokenizer(e.prompt).input_ids for e in prompts[:2]])
        sampler_lp, mask = rollouts.padded_sampler_logprobs()
        assert (c.trainer.logprobs(rollouts) - sampler_lp)[mask].abs().max() < 1e-4  # synced
    finally:
        c.close()


def test_fp32_none_and_tis_give_identical_updates(small_model_path, arithmetic_task):
    """With fp32 on both sides the TIS weights are 1 up to rounding, so the update is PPO's."""
    from rlmm.algos import GRPO
    from rlmm.corrections.none import NoCorrection
    from rlmm.corrections.tis import TokenTIS
    from rlmm.run.components import Components
    from transformers import AutoTokenizer

    fp32 = SidePrecision("fp32", False)
    options = sampling(max_new_tokens=6)
    prompts = arithmetic_task.examples("train", 4)
    results = {}
    for name, correction in (("none", NoCorrection()), ("tis", TokenTIS(cap=2.0))):
        torch.manual_seed(0)
        trainer = from_yaml("trainer", "torch", model_path=small_model_path, precision=fp32, sampling=options,
                            micro_batch_size=8, lr=1e-3, grad_clip=0.0)
        # SGD with lr 1 makes the update exactly minus the gradient (Adam's 1/sqrt(v) would magnify
        # rounding-level differences wherever a gradient is ~0).
        trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=1.0)
        initial = {k: v.clone() for k, v in trainer.state_dict().items()}
        c = Components(task=ParityTask(arithmetic_task), tokenizer=AutoTokenizer.from_pretrained(small_model_path),
                       sampler=from_yaml("sampler", "hf", model_path=small_model_path, precision=fp32,
                                                 sampling=options, seed=0), trainer=trainer,
                       correction=correction, algo=GRPO(**ALGO), sampling=options)
        metrics = rl_step(c, prompts, ratio_cap=2.0, reuse_training_forward=False)
        results[name] = (metrics, {k: v - initial[k] for k, v in trainer.state_dict().items()})
    (none_metrics, none_update), (tis_metrics, tis_update) = results["none"], results["tis"]
    assert abs(tis_metrics["correction/weight_mean"] - 1) < 1e-5
    assert none_metrics["rollout/reward_mean"] == tis_metrics["rollout/reward_mean"]  # same rollouts
    largest = max(u.abs().max().item() for u in none_update.values())
    assert largest > 0  # the update is not trivially zero
    for key in none_update:
        torch.testing.assert_close(tis_update[key], none_update[key], rtol=1e-4, atol=1e-5 * largest)


@pytest.mark.parametrize("trainer_name", ["torch", "deepspeed"])
def test_one_pass_step_equals_scoring_first(small_model_path, arithmetic_task, trainer_name):
    """One epoch over one minibatch: taking the old policy's log-probs from the training forward gives
    the step that a no-grad scoring pass first gives: the same mismatch, correction and loss metrics
    and the same new weights. A bf16 sampler against the fp32 trainer, and an IcePop band narrow
    enough to drop tokens, so the kept-token count that normalises the loss comes from the scoring."""
    from rlmm.corrections.token_mask import TokenMask

    prompts = arithmetic_task.examples("train", 4)
    results = {}
    for reuse in (False, True):
        torch.manual_seed(0)
        c = make_components(small_model_path, ParityTask(arithmetic_task), "hf", trainer_name,
                            "bf16_sampler_fp32_trainer")
        c.correction = TokenMask(low=0.99, high=1.01, reweight=True)
        try:
            metrics = rl_step(c, prompts, ratio_cap=2.0, reuse_training_forward=reuse)
            results[reuse] = ({k: v for k, v in metrics.items() if not k.startswith("perf/")},
                              {k: v.clone() for k, v in c.trainer.state_dict().items()},
                              {k for k in metrics if k.startswith("perf/")})
        finally:
            c.trainer.close()
            c.sampler.close()
    (scored_first, weights_first, perf_first), (one_pass, weights_one, perf_one) = results[False], results[True]
    assert 0 < scored_first["correction/frac_tokens_masked"] < 1  # the mask matters to the normaliser
    assert one_pass == pytest.approx(scored_first, rel=1e-6, abs=1e-9)
    for key, value in weights_first.items():
        torch.testing.assert_close(weights_one[key], value, rtol=1e-6, atol=1e-8)
    assert perf_first - perf_one == {"perf/trainer_logprobs_seconds"}  # the scoring pass was not run


def test_main_job_end_to_end(tmp_path):
    """`rlmm train` with the built-in default (shortened): record, plots, summary, W&B offline; the W&B
    key in the environment appears in no file the run writes (config, record, logs, W&B's own files)."""
    secret = "rlmm0test0secret0" + "7" * 23  # 40 characters, the length of a W&B API key
    result = subprocess.run([sys.executable, "-m", "rlmm.cli", "train", "train.steps=2", "train.eval_every=1",
                             "train.eval_prompts=16", "train.prompts_per_step=4", f"hydra.run.dir={tmp_path}"],
                            capture_output=True, text=True, timeout=900, env=subprocess_env(WANDB_API_KEY=secret))
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(written) > 10 and not [p for p in written if secret.encode() in p.read_bytes()]
    assert secret not in result.stdout + result.stderr
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert {k.split("/")[0] for k in steps[1]} >= {"rollout", "mismatch", "correction", "loss", "perf"}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["choices"]["correction"] == "tis" and summary["choices"]["sampler"] == "vllm"
    assert (tmp_path / "training.png").stat().st_size > 10_000
    assert (tmp_path / "config.yaml").exists() and list((tmp_path / "wandb").glob("offline-run-*"))
    assert "eval_accuracy_end" in result.stdout
    assert all(0 <= s["eval/accuracy_trained"] <= 1 for s in steps)  # the trainer's own weights, every eval
    assert 0 <= summary["eval_accuracy_trained_end"] <= 1


@pytest.mark.parametrize("trainer_name", ["deepspeed", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_two_ranks_with_torchrun(tmp_path, small_model_path, trainer_name):
    """Two ranks on CPU (gloo): each samples its share with its own vLLM engine, the trainer averages
    the gradients (DeepSpeed; FSDP2 over its shards, under `slow`: tests/test_update.py's two-rank step
    covers FSDP by default), rank 0 writes the record. Every prompt of every step is rewarded on exactly
    one rank, group_size times (tests/recording.py writes down who rewarded what)."""
    from collections import Counter

    from rlmm.tasks.arithmetic import _in_test_split

    torchrun = Path(sys.executable).parent / "torchrun"
    env = subprocess_env(OMP_NUM_THREADS="1")
    records = tmp_path / "rewarded"
    records.mkdir()
    result = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "rlmm.cli", "train",
                             "model=hf", f"model.path={small_model_path}", "task._target_=tests.recording.RecordedArithmetic",
                             f"+task.record_dir={records}", "train.steps=2", "train.eval_every=2",
                             "train.eval_prompts=8", "train.prompts_per_step=4", "algo.group_size=4", "logger=none",
                             f"trainer={trainer_name}", f"hydra.run.dir={tmp_path / 'run'}"],
                            capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["ranks"] == 2
    steps = [json.loads(line) for line in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1, 2]  # one record, written once (rank 0)
    assert steps[1]["mismatch/num_tokens"] > 0
    rewarded = [Counter(p for p in (records / f"rank{r}.txt").read_text().split() if not _in_test_split(p))
                for r in (0, 1)]
    trained = from_yaml("task", "arithmetic", seed=0).examples("train", 2 * 4)  # the run's seed 0: steps x prompts_per_step
    assert rewarded[0] + rewarded[1] == Counter({p: 4 * n for p, n in Counter(e.prompt for e in trained).items()})
    assert not set(rewarded[0]) & set(rewarded[1])  # no prompt on both ranks
    assert sum(rewarded[0].values()) == sum(rewarded[1].values()) == 2 * 2 * 4  # 2 prompts a step each


class FingerprintTask(ParityTask):
    """A reward that is a hash of the completion: the mean over prompts moves when any greedy
    completion does (the tests' small model has too little accuracy to show a change)."""

    def reward(self, example, completion):
        import hashlib

        return int(hashlib.sha256(completion.encode()).hexdigest(), 16) % 1000 / 999


def test_evaluation_reads_the_deployed_sampler_and_the_trainers_own_weights(small_model_path, arithmetic_task):
    """eval/accuracy is the sampler's greedy accuracy, eval/accuracy_trained the trainer's weights' (unperturbed,
    through transformers: trainer=torch's own module): equal while both hold the same fp32 weights;
    noise in the sampler moves only the first, noise in the trainer only the second."""
    import torch

    from rlmm.policy.precision import SidePrecision
    from rlmm.run.evaluation import Evaluation

    task = FingerprintTask(arithmetic_task)
    c = make_components(small_model_path, task, "hf", "torch", "fp32")
    c.model_path, c.trainer_precision = small_model_path, SidePrecision("fp32", False)
    evaluate = Evaluation(c, arithmetic_task.examples("test", 64), trained_weights=True, rank=0)
    try:
        clean = evaluate()
        assert clean["eval/accuracy"] == clean["eval/accuracy_trained"]
        generator = torch.Generator().manual_seed(0)

        def noisy(weights):
            return {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=generator) if v.dim() > 1 else v
                    for k, v in weights.items()}

        c.sampler.load_weights(noisy(c.trainer.state_dict()))
        deployed_noisy = evaluate()
        assert deployed_noisy["eval/accuracy_trained"] == clean["eval/accuracy_trained"]
        assert deployed_noisy["eval/accuracy"] != clean["eval/accuracy"]
        c.sampler.load_weights(c.trainer.state_dict())
        c.trainer.model.load_state_dict(noisy(c.trainer.state_dict()))
        trainer_noisy = evaluate()
        assert trainer_noisy["eval/accuracy"] == clean["eval/accuracy"]
        assert trainer_noisy["eval/accuracy_trained"] != clean["eval/accuracy_trained"]
    finally:
        evaluate.close()
        c.trainer.close()
        c.sampler.close()


def evaluated_components(model_path, task, trainer_name, precision_name, **trainer_values):
    """An hf sampler and `trainer_name` in `precision_name`, as the app builds them for the evaluation (the
    model path and the trainer side's precision set), the trainer's values as its YAML's but `trainer_values`."""
    from transformers import AutoTokenizer

    from rlmm.algos import GRPO

    policy = instantiate(OmegaConf.load(CONF_DIR / "precision" / f"{precision_name}.yaml"))
    options = sampling(max_new_tokens=6)
    sampler = from_yaml("sampler", "hf", model_path=model_path, precision=policy.sampler, sampling=options, seed=0)
    trainer = build_trainer(trainer_name, model_path, policy.trainer, options, micro_batch_size=8, lr=1e-3,
                            **trainer_values)
    return Components(task=task, tokenizer=AutoTokenizer.from_pretrained(model_path), sampler=sampler,
                      trainer=trainer, correction=from_yaml("correction", "tis"), algo=GRPO(**ALGO), sampling=options,
                      model_path=model_path, trainer_precision=policy.trainer)


@pytest.mark.parametrize("trainer_name,precision_name,trainer_values", [
    ("torch", "bf16", {}), ("deepspeed", "bf16_sampler_fp32_trainer", {}),  # the default's trainer side
    ("deepspeed", "bf16_sampler_fp32_trainer", {"gradient_checkpointing": True}),  # the scale check's: train mode
    ("deepspeed", "bf16", {}), ("deepspeed", "bf16_fp32head", {"zero_stage": 2}),
    pytest.param("torch", "bf16_fp32head", {}, marks=pytest.mark.slow),
    pytest.param("deepspeed", "bf16", {"zero_stage": 1}, marks=pytest.mark.slow),
    pytest.param("fsdp", "bf16", {}, marks=pytest.mark.slow),
    pytest.param("fsdp", "bf16_sampler_fp32_trainer", {}, marks=pytest.mark.slow)])
def test_trained_accuracy_is_the_same_on_the_trainers_module_as_on_a_copy(small_model_path, arithmetic_task,
                                                                          trainer_name, precision_name,
                                                                          trainer_values):
    """After a step, greedy generation with the trainer's own module (what the evaluation now uses where it
    holds the full weights) gives the copy's tokens and log-probs bit for bit, so eval/accuracy_trained is
    the number the copy gave: the same weights in the same dtypes (an fp32 head too) through the same kernels."""
    from rlmm.run.evaluation import Evaluation, TrainedCopyEngine, TrainerModuleEngine, accuracy

    task = FingerprintTask(arithmetic_task)
    c = evaluated_components(small_model_path, task, trainer_name, precision_name, **trainer_values)
    examples = arithmetic_task.examples("test", 64)
    evaluate, copy = Evaluation(c, examples, trained_weights=True, rank=0), TrainedCopyEngine(c)
    in_place = evaluate.trained
    try:
        assert c.trainer.generates_in_place and isinstance(in_place, TrainerModuleEngine)
        before = {k: v.clone() for k, v in c.trainer.state_dict().items()}
        rl_step(c, arithmetic_task.examples("train", 4), ratio_cap=2.0, reuse_training_forward=True)
        assert any(not torch.equal(before[k], v) for k, v in c.trainer.state_dict().items())  # trained weights
        for engine in (in_place, copy):
            engine.sync(0)
        prompt_ids = [c.tokenizer(e.prompt).input_ids for e in examples]
        ours, theirs = in_place.generate(prompt_ids, greedy=True), copy.generate(prompt_ids, greedy=True)
        assert ours.response_ids == theirs.response_ids
        for own, copied in zip(ours.sampler_logprobs, theirs.sampler_logprobs, strict=True):
            assert torch.equal(own, copied)
        assert accuracy(c, in_place, examples) == accuracy(c, copy, examples)
    finally:
        evaluate.close()
        copy.close()
        c.close()


@pytest.mark.parametrize("trainer_name,trainer_values,copies", [
    ("deepspeed", {"zero_stage": 3}, True), ("torch", {"padding_free": True}, True), ("deepspeed", {}, False)])
def test_evaluation_copies_the_weights_only_where_the_trainers_module_cannot_generate(
        small_model_path, arithmetic_task, trainer_name, trainer_values, copies):
    """ZeRO-3 (each rank holds a partition) and padding-free attention need the copy; ZeRO-0 on one rank
    does not. (FSDP over several ranks: tests/test_update.py's two-rank runs are its place; one rank is here
    in the slow grid above.)"""
    from rlmm.run.evaluation import Evaluation, TrainedCopyEngine, TrainerModuleEngine

    c = evaluated_components(small_model_path, FingerprintTask(arithmetic_task), trainer_name, "fp32",
                             **trainer_values)
    evaluate = Evaluation(c, arithmetic_task.examples("test", 8), trained_weights=True, rank=0)
    try:
        assert c.trainer.generates_in_place is not copies
        assert isinstance(evaluate.trained, TrainedCopyEngine if copies else TrainerModuleEngine)
        assert 0 <= evaluate()["eval/accuracy_trained"] <= 1
    finally:
        evaluate.close()
        c.close()


@pytest.mark.parametrize("trainer_name", ["torch", "deepspeed", "fsdp"])
def test_evaluating_on_the_trainers_module_leaves_training_as_it_was(small_model_path, arithmetic_task,
                                                                     trainer_name):
    """An evaluation on the trainer's module (gradient checkpointing on, so the model is in train mode)
    leaves every submodule's mode, `requires_grad` (of the parameters registered after it too: FSDP2 keeps
    its root unit's gathered copies), the checkpointing flag, the OutputHead and each module's attributes (no
    KV cache kept) as they were and makes no gradient; the next step's new weights are those of a run
    without the evaluation, bit for bit. (The trained-weights half of an evaluation: the
    deployed sampler's greedy half is the sampler's business.)"""
    from rlmm.run.evaluation import Evaluation, accuracy

    def state(model):  # no state_dict(): FSDP2's would reshard the root unit and hide a frozen flag
        return {"training": [m.training for m in model.modules()],
                "requires_grad": [p.requires_grad for p in model.parameters()],
                "grads": [p.grad is not None for p in model.parameters()],
                "checkpointing": model.is_gradient_checkpointing,
                "head_aim": model.get_output_embeddings()._aim,
                "attributes": [sorted(vars(m)) for m in model.modules()]}

    prompts = arithmetic_task.examples("train", 4)
    updated = {}
    for evaluated in (True, False):
        torch.manual_seed(0)
        c = evaluated_components(small_model_path, ParityTask(arithmetic_task), trainer_name, "fp32",
                                 gradient_checkpointing=True)
        examples = arithmetic_task.examples("test", 16)
        evaluate = Evaluation(c, examples, trained_weights=True, rank=0)
        try:
            model = c.trainer.model
            if evaluated:
                before = state(model)
                assert before["training"] == [True] * len(before["training"]) and before["checkpointing"]
                evaluate.trained.sync(0)
                accuracy(c, evaluate.trained, examples)
                assert state(model) == before
            rl_step(c, prompts, ratio_cap=2.0, reuse_training_forward=True)  # weights changed by it would show
            updated[evaluated] = {k: v.clone() for k, v in c.trainer.state_dict().items()}
        finally:
            evaluate.close()
            c.close()
    for key, value in updated[False].items():
        assert torch.equal(updated[True][key], value), key


class ShutdownWatch:
    """Fakes for `run_train`'s parts around the loop, each writing down when it is closed, saved or finished:
    the run's shutdown (rlmm/run/train.py::shutdown) is checked without an engine."""

    def __init__(self, monkeypatch, step):
        import rlmm.run.checkpoint
        import rlmm.run.train
        from rlmm.run.records import RunRecord

        self.events = []
        events = self.events

        class Part:
            def __init__(self, name):
                self.name = name

            def close(self):
                events.append(self.name)

        class Task:
            def examples(self, split, n):
                return [split] * n

        class WatchedRecord(RunRecord):
            def close(self):
                super().close()
                events.append("record")

        class Logger:
            def log(self, metrics, step=None):
                pass

            def summary(self, metrics):
                pass

            def finish(self):
                events.append("logger")

        class FakeEvaluation(Part):
            def __init__(self, c, examples, trained_weights, rank):
                super().__init__("evaluation")

            def __call__(self):
                return {"eval/accuracy": 0.5}

        components = Part("components")
        components.task, components.trainer, components.sampler = Task(), None, None
        components.critic, components.precision_report = None, {}
        components.correction = Part("correction")  # its state goes into the checkpoint (a decay's count)
        monkeypatch.setattr(rlmm.run.train, "build_components", lambda cfg, prompts, max_rows, **kwargs: components)
        monkeypatch.setattr(rlmm.run.train, "Evaluation", FakeEvaluation)
        monkeypatch.setattr(rlmm.run.train, "RunRecord", WatchedRecord)
        class NoRollouts:  # the delay line, with nothing to sample: `step` stands for the whole RL step
            def __init__(self, *args, **kwargs):
                pass

            def take(self, step):
                return None

            def state_dict(self):
                return {}

        monkeypatch.setattr(rlmm.run.train, "DelayLine", NoRollouts)
        monkeypatch.setattr(rlmm.run.train, "rl_update", step)
        monkeypatch.setattr(rlmm.run.train, "mean_over_ranks", lambda metrics: metrics)
        self.saved_corrections = []
        monkeypatch.setattr(rlmm.run.checkpoint, "save", lambda run_dir, step, *parts, loop, rollouts, correction: (
            events.append("checkpoint"), self.saved_corrections.append(correction)))
        self.components = components
        self.logger = Logger()

    @staticmethod
    def config():
        return OmegaConf.create({"seed": 0, "algo": {"group_size": 2},
                                 "train": {**OmegaConf.load(CONF_DIR / "train.yaml").train, "steps": 3,
                                           "prompts_per_step": 2, "eval_prompts": 2, "checkpoint_every": 0}})


def step_metrics():
    return {"train/skipped": 0.0, "rollout/reward_mean": 0.5, "mismatch/kl_k3": 0.0}


def test_eval_every_0_evaluates_only_at_the_start_and_the_end(tmp_path, monkeypatch):
    """`train.eval_every=0` reads as checkpoint_every's 0 does: no evaluation between step 0 and the last step
    (it once divided by zero in the loop, after both engines had started)."""
    from rlmm.run.records import read_steps
    from rlmm.run.train import run_train
    from rlmm.runtime.devices import init_process_group

    init_process_group()
    watch = ShutdownWatch(monkeypatch, lambda *args: step_metrics())
    config = ShutdownWatch.config()
    config.train.eval_every = 0
    run_train(config, tmp_path, {}, watch.logger)
    rows = read_steps(tmp_path)
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    assert [row["step"] for row in rows if "eval/accuracy" in row] == [0, 3]


def test_the_shutdown_runs_when_the_loop_raises(tmp_path, monkeypatch):
    """A step that raises still ends the run in its one shutdown, in order: the record closed (the rows before
    the error stay on disk), the logger finished, the evaluation's engine and then the components closed."""
    from rlmm.run.records import read_steps
    from rlmm.run.train import run_train
    from rlmm.runtime.devices import init_process_group

    def broken_step(*args):
        raise RuntimeError("a step broken on purpose")

    init_process_group()
    watch = ShutdownWatch(monkeypatch, broken_step)
    with pytest.raises(RuntimeError, match="broken on purpose"):
        run_train(ShutdownWatch.config(), tmp_path, {}, watch.logger)
    assert watch.events == ["record", "logger", "evaluation", "components"]
    assert [row["step"] for row in read_steps(tmp_path)] == [0]
    assert not (tmp_path / "summary.json").exists()


def test_a_stop_signal_checkpoints_then_shuts_down_then_hands_over(tmp_path, monkeypatch):
    """SIGTERM during step 1: the step is recorded, a checkpoint written, the shutdown run, and only then the
    signal handed over (here no handler was there before: exit 128 + SIGTERM), with no summary."""
    import os
    import signal

    from rlmm.run.records import read_steps
    from rlmm.run.train import run_train
    from rlmm.runtime.devices import init_process_group

    def signalled_step(*args):
        os.kill(os.getpid(), signal.SIGTERM)
        return step_metrics()

    init_process_group()
    watch = ShutdownWatch(monkeypatch, signalled_step)
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with pytest.raises(SystemExit) as stopped:
            run_train(ShutdownWatch.config(), tmp_path, {}, watch.logger)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handler that was there is back
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert watch.events == ["checkpoint", "record", "logger", "evaluation", "components"]
    assert watch.saved_corrections == [watch.components.correction]  # the correction's state is checkpointed
    assert [row["step"] for row in read_steps(tmp_path)] == [0, 1]
    assert not (tmp_path / "summary.json").exists()
