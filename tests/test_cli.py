"""Bad input gets one line naming the bad value and the allowed ones, before any work starts."""
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlmm.config.options import from_yaml, group_options
from tests.conftest import subprocess_env

CASES = [
    (["model=tiny_hybrid", "probe.layers=true"], "probe.layers=true: the layer attribution captures each layer's "
                                                 "attention block, and the Gated DeltaNet layers 0, 1, 2 of this model "
                                                 "have none (allowed for a hybrid: probe.layers=false)"),
    (["task=calculator", "probe.layers=true"], "probe.layers=true with a multi-turn task: the sampler's hidden states "
                                               "are captured per generate call"),
    (["sampler=vlm"], "unknown sampler 'vlm' (allowed: bitwise, hf, vllm)"),
    (["precision=fp8"], "unknown precision 'fp8' (allowed: bf16, bf16_fp32head,"),
    (["trainer=jax"], "unknown trainer 'jax' (allowed: deepspeed, fsdp, torch)"),
    (["-m", "precision=bf16,fp61"], "unknown precision 'fp61'"),
    (["model=hf", "model.path=/no/such/checkpoint"],
     "model.path: '/no/such/checkpoint' does not exist and is not a Hugging Face hub id"),
    (["model=hf"], "model=hf: missing required key(s) path"),
    (["precision.sampler_dtype=fp8"], "precision.sampler_dtype: unknown precision 'fp8' (allowed: fp32, bf16, fp16)"),
    (["sampling.temprature=0.7"], "Key 'temprature' not in 'SamplingOptions'"),
    (["sampling.top_p=1.5"], "sampling.top_p: must be in (0, 1], got 1.5"),
    (["sampling.top_k=-1"], "sampling.top_k: must be >= 0 (0 = off), got -1"),
    (["sampling.top_k=101"], "sampling.top_k: 101 is more than the model's vocabulary of 100 tokens (allowed: 0 = off, "
                             "or 1 to 100)"),
    (["sampling.top_p=0.9", "sampling.logprobs=raw"],
     "support=sampler: it sets the tokens the trainer's processed log-probs are normalised over, but "
     "sampling.logprobs=raw scores the untruncated distribution on both sides (with raw: support=full; or "
     "sampling.logprobs=processed)"),
    (["support=nucleus"], "unknown support 'nucleus' (allowed: full, sampler, trainer)"),
    (["support.max_kept=0"], "support.max_kept: a count of tokens >= 1, got 0"),
    (["sampler.kv_cache=2"], "(allowed: batch_invariant, kv_cache_gb,"),
    (["quantization=int4"], f"unknown quantization 'int4' (allowed: {', '.join(group_options('quantization'))})"),
    (["sampler.quantization=int8"], "sampler.quantization=int8: sampler.quantization is the config group quantization "
                                    f"now: write quantization=int8 (allowed: {', '.join(group_options('quantization'))})"),
    (["-m", "+sampler.quantization=none,int8"], "sampler.quantization=none,int8: sampler.quantization is the config "
                                                "group quantization now: write quantization=none,int8"),
    (["-m", "sampler.kv_cache_dtype=auto,fp8"],
     "sampler.kv_cache_dtype: unknown dtype 'fp8' (allowed: auto, fp8_e4m3, fp8_e5m2)"),
    (["sampler=hf", "sampler.kv_cache_dtype=fp8_e4m3"], "Key 'kv_cache_dtype' is not in struct (allowed: batch_size, "
                                                         "perturb)"),
    (["sampler.kv_scales=calibrated"], "sampler.kv_scales=calibrated: scales of an FP8 KV cache, and "
                                       "sampler.kv_cache_dtype=auto keeps K and V unscaled (allowed: unit; calibrated "
                                       "with sampler.kv_cache_dtype=fp8_e4m3 or fp8_e5m2)"),
    # the bad value first: a CPU without AVX-512 refuses the FP8 cache of an earlier job before its value is read
    (["-m", "sampler.kv_cache_dtype=fp8_e4m3", "sampler.kv_scales=amax,unit"],
     "sampler.kv_scales: unknown value 'amax' (allowed: unit, calibrated)"),
    (["+trainer.zero=3"], "trainer=deepspeed: unknown key 'zero' (allowed: micro_batch_size, zero_stage, lr,"),
    (["trainer.zero_stage=three"], "trainer=deepspeed: zero_stage: Value 'three' of type 'str' could not be converted "
                                   "to Integer"),
    (["probe.num_prompts=many"], "Value 'many' of type 'str' could not be converted to Integer"),
    (["probe.trainer_micro_batch_sizes=[4,4]"], "probe.trainer_micro_batch_sizes: two different sizes >= 1, got [4, 4]"),
    (["probe.num_prompts=0"], "probe.num_prompts: must be >= 1, got 0"),
    (["probe.position_buckets=0"], "probe.position_buckets: must be >= 1, got 0"),
    (["probe.entropy_edges=[1,0.5]"], "probe.entropy_edges: increasing values > 0 (nats), got [1.0, 0.5]"),
    (["probe.early_vs_late.response_tokens=64"],
     "probe.early_vs_late.response_tokens=64: responses are at most sampling.max_new_tokens=16 tokens long"),
    (["probe.batch_invariance.num_prompts=16", "probe.batch_invariance.max_batch_size=8"],
     "probe.batch_invariance.max_batch_size=8: must be >= probe.batch_invariance.num_prompts=16"),
    (["probe.early_vs_late.response_tokens=8", "probe.early_vs_late.window=5"],
     "probe.early_vs_late.window=5: must be between 1 and response_tokens/2 = 4"),
    (["probe.attribution=true", "precision=fp32"],
     "probe.attribution: the sampler computes in fp32, so there is no low-precision gap to attribute"),
    (["probe.attribution=true", "precision=bf16"],
     "probe.attribution: the fp32 reference is the trainer in fp32, got precision.trainer_dtype=bf16"),
    (["probe.layers=true", "trainer=torch", "precision=bf16", "precision.trainer_dtype=fp16"],
     "probe.layers: compares the sampler with the trainer computing in the sampler's dtype: the sampler computes in "
     "bf16, the trainer in fp16"),
    (["probe.layers=true", "trainer.zero_stage=3"],
     "probe.layers: with an fp32 trainer and a bf16 sampler, the trainer's module must hold the full weights"),
    # quantization both sides share (issue 52): a mode to share, a source the quantizer knows, a forward that holds it
    (["trainer.fake_quantize=true"], "trainer.fake_quantize=true: quantization=none quantizes nothing for the trainer "
                                     "to share with the sampler (quantizing modes: "
                                     f"{', '.join(o for o in group_options('quantization') if from_yaml('quantization', o).quantizes_weights)})"),
    (["quantization=int8", "quantization.source=fp32"],
     "quantization.source: unknown source 'fp32' (allowed: sent, bf16)"),
    (["trainer=fsdp", "precision=bf16", "quantization=int8", "trainer.fake_quantize=true"],
     "trainer.fake_quantize=true: trainer=fsdp sends its fp32 masters and multiplies with them cast to bf16, so its "
     "forward cannot quantize what quantization.source=sent quantizes (runs: quantization.source=bf16 with a bf16 "
     "trainer, or an fp32 trainer)"),
    (["probe.attribution=true", "quantization=int8", "trainer.fake_quantize=true"],
     "probe.attribution: the trainer's module must hold the full weights: one rank of trainer=deepspeed (ZeRO-0/1/2) "
     "or trainer=torch, without trainer.padding_free or trainer.fake_quantize"),
    *([] if from_yaml("quantization", "fp8").cpu_machine_refusal() is None else [  # the sampler's own refusal here
        (["quantization=fp8", "trainer.fake_quantize=true"],
         "quantization=fp8: vLLM-CPU's only FP8 weight kernel needs AMX")]),
]
# rlmm train's own axes and options; the same rule: one line, before any engine starts.
TRAIN_CASES = [
    # a hybrid (issue 62): what vLLM-CPU and the trainers refuse of its recurrent layers, before the model is built
    (["model=tiny_hybrid", "precision=fp32"], "precision: sampler_dtype fp32 on sampler=vllm: vLLM-CPU runs the Gated "
                                              "DeltaNet layers 0, 1, 2 of this model in bf16 only (allowed here: a "
                                              "precision whose sampler side is bf16"),
    (["model=tiny_hybrid", "precision=fp16_sampler_fp32_trainer"], "precision: sampler_dtype fp16 on sampler=vllm"),
    (["model=tiny_hybrid", "model.linear_head_dim=32"], "model: linear-attention head dim 32: vLLM-CPU's Gated DeltaNet "
                                                        "kernels know only 64, 128"),
    (["model=tiny_hybrid", "sampler=hf", "trainer.padding_free=true"],
     "trainer.padding_free=true: the Gated DeltaNet layers 0, 1, 2 of this model would carry their state from one "
     "packed sequence into the next (allowed for a hybrid: trainer.padding_free=false)"),
    (["model=tiny_hybrid", "model.linear_attention_layers=[4]"],
     "model.linear_attention_layers: [4] must be layer indices below num_layers=4 (allowed: 0..3)"),
    (["correction=tiss"], f"unknown correction 'tiss' (allowed: {', '.join(group_options('correction'))})"),
    (["correction=tis+foo"], f"correction=tis+foo: unknown stage 'foo' (allowed: {', '.join(group_options('correction'))})"),
    (["correction=tis+tis"], "correction=tis+tis: stage 'tis' is listed twice"),
    (["-m", "correction=tis,bypass+tis"], "correction=bypass+tis: the stages want different log-probs as PPO's pi_old "
                                          "(bypass the sampler's, tis the trainer's)"),
    (["correction=icepop+tis"], "correction=icepop+tis: icepop and tis both weight tokens by the importance ratio"),
    (["correction=seq_veto+tis", "correction.stages.tis.cap=0.5"],
     "correction.stages.tis.cap: must be a finite number >= 1, got 0.5"),
    (["correction=seq_veto+tis", "correction.stages.tis.capp=3"], "Key 'capp' is not in struct (allowed: cap)"),
    # the objective is a node of its own (issue 51); the old spellings point at the new ones
    (["algo.objective=cispo"], "algo.objective: 'cispo' is not a loss objective: it is a node naming its class "
                               "(CISPO: algo=cispo; the clip range: algo.objective.clip_low=..., "
                               "algo.objective.clip_high=...)"),
    (["algo.clip_high=0.3"], "Key 'clip_high' is not in struct (allowed: group_size, normalize_std, objective, "
                             "loss_aggregation, kl_coef, kl_estimator, entropy_coef, count_rejected, epochs, "
                             "minibatches; clip_high is algo.objective.clip_high)"),
    (["algo.objective.clip_low=1.5"], "algo.objective.clip_low: must be in (0, 1] (1: no lower bound), got 1.5"),
    (["algo=cispo", "algo.objective.dual_clip=3"], "Key 'dual_clip' is not in struct (allowed: clip_low, clip_high)"),
    (["-m", "correction=tis,bypas"], "unknown correction 'bypas'"),
    (["correction.cap=-1"], "correction.cap: must be a finite number >= 1, got -1"),
    (["algo.group_size=0"], "algo.group_size: must be >= 2, got 0"),
    (["train.steps=ten"], "Value 'ten' of type 'str' could not be converted to Integer"),
    (["train.steps=-3"], "train.steps: must be >= 1, got -3"),  # not the task's number of examples, -48
    (["train.eval_prompts=0"], "train.eval_prompts: must be >= 1, got 0"),
    (["train.eval_every=-1"], "train.eval_every: must be >= 0, got -1 (0: evaluate only at step 0 and the last step)"),
    (["train.staleness=-1"], "train.staleness: must be >= 0, got -1 (0: each update's rollouts sampled with the "
                             "weights it updates)"),
    (["train.overlap=true"], "train.overlap=true needs train.staleness >= 1, got 0 (at 0 each update waits for "
                             "rollouts of its own weights: nothing to sample while it trains)"),
    (["train.overlap=true", "train.staleness=1", "train.decompose_staleness=true"],
     "train.overlap=true with train.decompose_staleness=true: the overlapped trainer has trained past the weights"),
    (["train.overlap=maybe"], "Value 'maybe' is not a valid bool"),
    # partial rollouts (issue 53)
    (["train.partial_rollouts=true"], "train.partial_rollouts=true needs train.staleness >= 1, got 0 (at 0 no weight "
                                      "sync falls inside a batch's sampling: nothing to continue under new weights)"),
    (["train.partial_rollouts=true", "train.staleness=2", "train.rollout_chunk=9"],
     "train.rollout_chunk: must be 1 .. sampling.max_new_tokens (8) with train.partial_rollouts=true, got 9"),
    (["train.partial_rollouts=true", "train.staleness=2", "algo=dapo"],
     "train.partial_rollouts=true with algo.max_sampling_rounds=3: refilling dropped groups needs each batch's rewards"),
    (["correction=token_staleness_mask"], "correction: TokenStalenessMask reads each token's weight version, which "
                                          "this run does not track (train.staleness=0); use train.staleness >= 1"),
    (["correction=seq_veto+token_staleness_mask"],
     "correction: token_staleness_mask reads each token's weight version"),
    (["train.partial_rollouts=true", "train.staleness=2", "routing.compare=true"],
     "train.partial_rollouts=true with routing=none compare=true: a continued response's experts are recomputed"),
    (["train.attribution.every=-2"], "train.attribution.every: must be >= 0, got -2 (0: off)"),
    (["train.attribution.every=5", "trainer.zero_stage=3"], "train.attribution: the trainer's module must hold the full "
                                                            "weights: one rank of trainer=deepspeed (ZeRO-0/1/2)"),
    (["-m", "hydra/launcher=nope"], "unknown hydra/launcher 'nope' (allowed: basic, local, process, slurm,"),
    (["trainer=torch", "trainer.zero_stage=3"], "(allowed: micro_batch_size, micro_batch_tokens, padding_free, lr, weight_decay,"),
    # the bitwise arm (issue 52): what would keep it from being bitwise, refused before any engine starts
    (["sampler=bitwise"], "sampler=bitwise: the sampler computes in bf16 and the trainer in fp32; both sides must "
                          "compute in one precision (allowed: precision=bf16, bf16_fp32head, fp16, fp16_fp32head, fp32)"),
    (["sampler=bitwise", "precision=bf16", "quantization=int8"],
     "sampler=bitwise: quantization=int8 quantizes the sampler's weights only, which the trainer does not (allowed: "
     "quantization=none, or trainer.fake_quantize=true: both sides quantized alike)"),
    (["sampler=bitwise", "precision=bf16", "support=full", "sampling.top_p=0.9"],
     "sampler=bitwise: support=full normalises the trainer's log-probs over the vocabulary while the sampler draws "
     "from its top-k / top-p set (allowed: support=sampler, trainer)"),
    (["sampler=bitwise", "precision=bf16", "routing=r3"], "sampler=bitwise: the trainer routes every token as the "
                                                          "sampler did, so there is no routing to replay"),
    (["sampler=bitwise", "precision=bf16", "trainer.padding_free=true"],
     "trainer.padding_free=True: sampler=bitwise scores each row alone at one width, so the layout is not the "
     "trainer's to choose (allowed: trainer.padding_free=false)"),
    (["sampler=bitwise", "precision=bf16", "train.staleness=1"],
     "sampler=bitwise: with train.staleness=1 the check of every step needs the trainer's log-probs at the weights "
     "that sampled (allowed: train.decompose_staleness=true, train.overlap=false)"),
    (["-m", "trainer=torch,fsdp", "precision=bf16", "quantization=int8", "trainer.fake_quantize=true"],
     "trainer.fake_quantize=true: trainer=fsdp sends its fp32 masters and multiplies with them cast to bf16"),
    (["trainer.fake_quantize=maybe"], "trainer=deepspeed: fake_quantize: Value 'maybe' is not a valid bool"),
    # multi-turn tasks and the token path (issue 60): before the model is built
    (["task=calculator", "task.max_turns=0"], "task.max_turns: must be an integer >= 1, got 0 (a turn is one response "
                                              "of the policy)"),
    (["task=gsm8k_tools", "task.tool=sql"], "task.tool: unknown tool 'sql' (allowed: calculator, python)"),
    (["token_path=realign"], "token_path=realign: the task answers in one response, with no conversation to re-render "
                             "(allowed: token_path=tokens, or a multi-turn task such as task=calculator)"),
    (["token_path=tokenz"], f"unknown token_path 'tokenz' (allowed: {', '.join(group_options('token_path'))})"),
    (["chat_template=off"], f"unknown chat_template 'off' (allowed: {', '.join(group_options('chat_template'))})"),
    (["task=calculator", "chat_template=none"], "chat_template=none: a multi-turn task renders its turns with the "
                                                "model's chat template (allowed: chat_template=auto or model)"),
    (["task=calculator", "task.max_context_tokens=999"], "task.max_context_tokens: 999 tokens (and the one a re-scoring "
                                                         "prefill asks past them) are more than the model's 256 positions "
                                                         "(allowed: <= 255)"),
    (["task=calculator", "algo=ppo"], "algo=ppo with a multi-turn task: its critic's GAE runs over a contiguous "
                                      "response"),
    (["task=calculator", "train.partial_rollouts=true", "train.staleness=1"],
     "train.partial_rollouts=true with a multi-turn task: a conversation is not continued across weight syncs yet"),
    (["task=calculator", "token_path=realign", "routing=r3"], "routing=r3 with token_path=realign: the trainer scores ids "
                                                              "the sampler's forwards did not all see"),
    (["task=calculator", "token_path=retokenize", "sampling.temperature=0.7"],
     "token_path=retokenize: the sampler's log-probs of the re-rendered ids come from its prefill, which scores the "
     "untempered, untruncated distribution"),
]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlmm.cli", *args], capture_output=True, text=True, timeout=120,
                          env=subprocess_env())


def assert_one_line(code: int, stderr: str, message: str) -> None:
    assert code == 2, stderr[-2000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlmm: error: "), stderr[-2000:]
    assert message in lines[0]


@pytest.fixture(scope="module")
def in_one_process(tmp_path_factory):
    """Every case's exit code and stderr from `rlmm.cli.main`, the cases one after another in one fresh process
    (tests/bad_input_cases.py): what the command does but for the interpreter's start, ~1 s a case, not ~6."""
    work = tmp_path_factory.mktemp("bad-input")
    cases = [["probe", args] for args, _ in CASES] + [["train", args] for args, _ in TRAIN_CASES]
    (work / "cases.json").write_text(json.dumps(cases))
    # In a folder of its own: a case refused after its run directory is made leaves it there, not in the checkout's
    # outputs/ (where another test's run started in the same second would find it taken).
    result = subprocess.run([sys.executable, "-m", "tests.bad_input_cases", str(work / "cases.json"),
                             str(work / "results.json")], capture_output=True, text=True, timeout=600, cwd=work,
                            env=subprocess_env(PYTHONPATH=str(Path(__file__).resolve().parent.parent)),
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]
    results = {(r["app"], tuple(r["args"])): r for r in json.loads((work / "results.json").read_text())}
    return lambda app, args: (results[app, tuple(args)]["code"], results[app, tuple(args)]["stderr"])


@pytest.mark.parametrize("args,message", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_one_line_error(args, message, in_one_process):
    assert_one_line(*in_one_process("probe", args), message)


@pytest.mark.parametrize("args,message", TRAIN_CASES, ids=[" ".join(a) for a, _ in TRAIN_CASES])
def test_train_bad_input_one_line_error(args, message, in_one_process):
    assert_one_line(*in_one_process("train", args), message)


# The `rlmm` command itself, one process a case: the exit code and a stderr of one line with nothing before
# it (no import's warning), for a case of each kind: a group, a sweep, a path, a key, a rule between keys.
AS_A_COMMAND = [("probe", CASES[1]), ("probe", CASES[5]), ("probe", CASES[10]), ("train", TRAIN_CASES[8]),
                ("train", TRAIN_CASES[24]), ("train", TRAIN_CASES[0])]


@pytest.mark.parametrize("app,case", AS_A_COMMAND, ids=[f"{app} {' '.join(c[0])}" for app, c in AS_A_COMMAND])
def test_bad_input_is_one_line_from_the_command(app, case):
    args, message = case
    result = run_cli(app, *args)
    assert_one_line(result.returncode, result.stderr, message)


def test_tokenizer_without_pad_or_eos_is_named():
    from types import SimpleNamespace

    from rlmm.models.loading import padding_id

    assert padding_id(SimpleNamespace(pad_token_id=None, eos_token_id=2), "m") == 2  # EOS pads decoder-only models
    with pytest.raises(ValueError, match="^model.path: the tokenizer of 'm' has neither a pad token nor an end-of"):
        padding_id(SimpleNamespace(pad_token_id=None, eos_token_id=None), "m")


def test_a_raising_reward_function_names_the_prompt():
    from types import SimpleNamespace

    from rlmm.run.episodes import task_reward as reward

    class Broken:
        def reward(self, example, completion):
            return {}["answer"]

    with pytest.raises(ValueError, match=r"^task.reward raised KeyError \('answer'\) on prompt '12\+3=' with "
                                         r"completion '15'$"):
        reward(Broken(), SimpleNamespace(prompt="12+3="), "15")


def test_unknown_command():
    result = run_cli("trian")
    assert result.returncode == 2 and "unknown command 'trian' (allowed: train, probe, table, prefetch)" in result.stderr


def test_help_lists_commands():
    result = run_cli("--help")
    assert result.returncode == 0 and "probe" in result.stdout


def test_precision_the_trainer_cannot_run_fails_before_any_work():
    from tests.this_cpu import deepspeed_runs

    if deepspeed_runs("fp16"):
        pytest.skip("this machine's DeepSpeed accelerator runs fp16")
    result = run_cli("probe", "precision=fp16", "trainer=deepspeed")
    assert result.returncode == 2
    assert result.stderr.strip() == ("rlmm: error: precision: trainer=deepspeed cannot run fp16 on this machine's cpu "
                                     "accelerator (allowed here: fp32, bf16; trainer=torch scores in any)")


def test_hardware_checks_of_a_slurm_sweep_wait_for_the_job(monkeypatch):
    """A login node without the hardware does not refuse what a SLURM job's node may run: with the slurm
    launcher the check is left to the job (its trainer refuses with the same line when it starts there).
    The trainer here is told fp16 is unsupported, as it is on CPUs without AVX512-FP16."""
    import torch

    from rlmm.launch.overrides import check_overrides
    from rlmm.trainers.deepspeed_backend import DeepSpeedTrainer

    def no_fp16(precision):
        return "precision: no fp16 here" if precision.dtype == torch.float16 else None

    monkeypatch.setattr(DeepSpeedTrainer, "unsupported", staticmethod(no_fp16))
    with pytest.raises(SystemExit):
        check_overrides("train", ["precision=fp16", "trainer=deepspeed"])
    check_overrides("train", ["precision=fp16", "trainer=deepspeed", "hydra/launcher=slurm"])  # no refusal here


def test_the_check_builds_each_combinations_precision_policy_once(monkeypatch):
    """One PrecisionPolicy per combination checked: the constructor's own checks and the engines' support
    read the same object (the run builds its own, rlmm/run/components.py)."""
    from rlmm.launch.overrides import check_overrides
    from rlmm.policy.precision import PrecisionPolicy

    built, original = [], PrecisionPolicy.__init__

    @functools.wraps(original)  # the same signature: it is the option's schema
    def counted(self, *args, **kwargs):
        built.append(kwargs)
        original(self, *args, **kwargs)

    monkeypatch.setattr(PrecisionPolicy, "__init__", counted)
    check_overrides("train", ["precision=bf16,fp32"])
    assert [k["sampler_dtype"] for k in built] == ["bf16", "fp32"]


def test_hydras_flag_values_are_not_taken_for_overrides():
    """`rlmm train --cfg job` prints the composed config: `job` is --cfg's value, not an override."""
    from rlmm.cli import overrides_of

    assert overrides_of(["--cfg", "job", "seed=3", "-m", "-p", "trainer", "algo=ppo"]) == ["seed=3", "algo=ppo"]
    result = subprocess.run([sys.executable, "-m", "rlmm.cli", "train", "--cfg", "job", "algo=ppo"],
                            capture_output=True, text=True, timeout=300, env=subprocess_env(), stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "_target_: rlmm.algos.ppo.PPO" in result.stdout
