"""Preemption and resume, numeric faults: a killed run resumes to the same numbers; NaN steps are
skipped, never reach the sampler, and too many in a row stop the run with a checkpoint."""
import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from rlmm.config.options import from_yaml
from rlmm.policy.precision import SidePrecision
from rlmm.run import checkpoint
from rlmm.run.records import read_steps
from tests.conftest import ending, sampling, subprocess_env


def train_command(model_path, run_dir, *overrides):
    return [sys.executable, "-m", "rlmm.cli", "train", "model=hf", f"model.path={model_path}", "precision=fp32",
            "train.steps=4", "train.prompts_per_step=4", "train.eval_every=2", "train.eval_prompts=8",
            "algo.group_size=4", f"hydra.run.dir={run_dir}", *overrides]


def comparable(rows):
    """Every logged number except wall-clock timings."""
    return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in rows]


@pytest.mark.slow  # 112 s on the AVX2 EPYC; by default the same stop and resume run in test_staleness (SIGTERM at
# staleness 2, rollouts in flight) and test_damaged_runs (Ctrl-C)
def test_sigterm_midway_then_resume_repeats_the_uninterrupted_run(small_model_path, tmp_path):
    """fp32 on CPU: a run stopped by SIGTERM early on and started again from its checkpoint logs
    exactly the numbers of a run that was never interrupted (same seed), in one W&B run."""
    env = subprocess_env()
    # at 4 the one-pass step once (probably) outran the signal to the last step; the signal goes as step 0 is
    # logged and lands in step 1, so 6 leaves 4 steps to spare (12 until the default run had to fit 30 min)
    steps = 6
    straight = tmp_path / "straight"
    result = subprocess.run(train_command(small_model_path, straight, "logger=none", f"train.steps={steps}"), capture_output=True, text=True,
                            timeout=600, env=env, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]

    interrupted = tmp_path / "interrupted"
    command = train_command(small_model_path, interrupted, "train.checkpoint_every=0", f"train.steps={steps}")
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                           stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    # Signal as soon as step 0 is logged: on a fast machine the run did two more steps between the
    # test seeing a step and the signal landing, so a later trigger left nothing to resume.
    while not read_steps(interrupted):
        assert job.poll() is None and time.monotonic() < deadline, job.stdout.read()[-3000:]
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)
    output = job.communicate(timeout=300)[0]
    assert job.returncode == 128 + signal.SIGTERM, output[-3000:]
    stopped_at = json.loads((checkpoint.latest(interrupted) / "state.json").read_text())["step"]
    assert stopped_at < steps, "the run reached its last step before the signal landed: nothing left to resume"
    assert not (interrupted / "summary.json").exists()
    run_id = (interrupted / "wandb-run-id").read_text()

    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from {checkpoint.latest(interrupted)}" in result.stdout + result.stderr
    assert (interrupted / "wandb-run-id").read_text() == run_id  # the same W&B run continues
    resumed_rows = read_steps(interrupted)
    assert [row["step"] for row in resumed_rows] == list(range(steps + 1))  # none missing, none twice
    assert comparable(resumed_rows) == comparable(read_steps(straight))
    summary = json.loads((interrupted / "summary.json").read_text())
    assert summary["resumed_at_step"] == stopped_at + 1


SIGNAL_AFTER_STEP_ZERO = """
import os, signal, sys
from rlmm.run.records import RunRecord

log = RunRecord.log

def log_then_signal(self, metrics, step):
    log(self, metrics, step)
    if step == 0:  # the moment the test above signals at: step 0 logged, the loop not yet entered
        os.kill(os.getpid(), signal.SIGTERM)

RunRecord.log = log_then_signal
from rlmm.cli import main
main(sys.argv[1:])
"""


def test_a_rank_that_stops_for_another_ranks_signal_exits_as_for_sigterm():
    """The loop stops every rank when any one received a stop signal; one that received none itself hands over
    nothing and exits 128 + SIGTERM (it used to fail on 128 + None, a traceback on every such rank)."""
    import signal

    from rlmm.run.preemption import StopSignals

    with pytest.raises(SystemExit) as exited:
        with StopSignals() as stop:
            stop.hand_over()
    assert exited.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))


def test_ctrl_c_is_a_stop_signal_and_twice_stops_at_once():
    """SIGINT is recorded like SIGTERM (the loop checkpoints at the end of its step), and handing it over exits 130
    without Python's handler, which would raise KeyboardInterrupt; a second one raises it at once."""
    import os
    import signal

    from rlmm.run.preemption import StopSignals

    # Python's own handler, as an interactive start installs it: a pytest started in the background by a
    # non-interactive shell inherits SIGINT ignored, and StopSignals gives back what it found.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    with pytest.raises(SystemExit) as exited:
        with StopSignals() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.received == signal.SIGINT
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
            stop.hand_over()
    assert exited.value.code == 128 + signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    signal.signal(signal.SIGINT, before)


def test_sigterm_right_after_step_zero_still_checkpoints(small_model_path, tmp_path):
    """The signal lands the instant step 0's evaluation is recorded, before the first training step
    (in CI the default handler was still in place there and the process died without a checkpoint)."""
    run_dir = tmp_path / "run"
    command = train_command(small_model_path, run_dir, "sampler=hf", "trainer=torch", "logger=none",
                            "train.checkpoint_every=0")
    result = subprocess.run([sys.executable, "-c", SIGNAL_AFTER_STEP_ZERO, *command[3:]], capture_output=True,
                            text=True, timeout=600, env=subprocess_env(), stdin=subprocess.DEVNULL)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr[-3000:]
    assert json.loads((checkpoint.latest(run_dir) / "state.json").read_text())["step"] == 1
    assert [row["step"] for row in read_steps(run_dir)] == [0, 1]


@pytest.mark.parametrize("trainer_name", ["fsdp"])
def test_a_stopped_run_resumes_to_the_uninterrupted_numbers(small_model_path, tmp_path, trainer_name):
    """SIGTERM right after step 0 (a checkpoint of step 1), then a restart: every logged number of the 4
    steps equals those of a run never interrupted (FSDP: its full optimizer state and schedule restored)."""
    assert_resume_repeats(small_model_path, tmp_path, "sampler=hf", f"trainer={trainer_name}", "logger=none",
                          "train.checkpoint_every=0")


@pytest.mark.parametrize("routing", [pytest.param("r2", marks=pytest.mark.slow), "r3"])
def test_a_stopped_moe_run_with_routing_replay_resumes_to_the_uninterrupted_numbers(moe_model_path, tmp_path,
                                                                                    routing):
    """The same with an MoE model, its experts in every batch (r3: the sampler's; r2, over two epochs: π_old's)
    and the routing/ metrics logged."""
    assert_resume_repeats(moe_model_path, tmp_path, "sampler=hf", "trainer=torch", "logger=none",
                          "train.checkpoint_every=0", f"routing={routing}", "algo.epochs=2")
    assert "routing/frac_decisions_differ" in read_steps(tmp_path / "straight")[1]


def assert_resume_repeats(model_path, tmp_path, *common):
    """A run of `common` overrides stopped by SIGTERM right after step 0 and restarted logs what it logs
    uninterrupted."""
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    for run_dir, signal_first in ((straight, False), (interrupted, True)):
        command = train_command(model_path, run_dir, *common)
        if signal_first:
            stopped = subprocess.run([sys.executable, "-c", SIGNAL_AFTER_STEP_ZERO, *command[3:]],
                                     capture_output=True, text=True, timeout=600, env=subprocess_env(),
                                     stdin=subprocess.DEVNULL)
            assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
            assert json.loads((checkpoint.latest(run_dir) / "state.json").read_text())["step"] == 1
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=subprocess_env(),
                                stdin=subprocess.DEVNULL)
        assert result.returncode == 0, result.stderr[-3000:]
    assert [row["step"] for row in read_steps(interrupted)] == list(range(5))
    assert comparable(read_steps(interrupted)) == comparable(read_steps(straight))


def make_faulty_components(model_path, task, trainer_name, dtype):
    from transformers import AutoTokenizer

    from rlmm.algos import GRPO
    from rlmm.corrections.tis import TokenTIS
    from rlmm.run.components import Components
    from tests.test_train import ALGO

    options = sampling(max_new_tokens=6)
    precision = SidePrecision(dtype, False)
    faulty = "tests.faults." + ("NaNTorchTrainer" if trainer_name == "torch" else "NaNDeepSpeedTrainer")
    trainer = from_yaml("trainer", trainer_name, _target_=faulty, model_path=model_path, precision=precision,
                        sampling=options, micro_batch_size=8, lr=1e-3, nan_from_update=2)
    return Components(task=task, tokenizer=AutoTokenizer.from_pretrained(model_path),
                      sampler=from_yaml("sampler", "hf", model_path=model_path, precision=SidePrecision("fp32", False),
                                        sampling=options, seed=0), trainer=trainer,
                      correction=TokenTIS(cap=2.0), algo=GRPO(**ALGO), sampling=options)


@pytest.mark.parametrize("reuse_training_forward", [False, True])
@pytest.mark.parametrize("trainer_name,dtype", [("torch", "fp32"), ("deepspeed", "fp32"), ("deepspeed", "bf16")])
def test_nan_gradient_step_is_skipped_and_never_synced(small_model_path, arithmetic_task, trainer_name, dtype,
                                                       reuse_training_forward):
    from rlmm.run.step import rl_step
    from tests.test_train import ParityTask

    c = make_faulty_components(small_model_path, ParityTask(arithmetic_task), trainer_name, dtype)
    synced = []
    load_weights = c.sampler.load_weights
    c.sampler.load_weights = lambda weights: (synced.append(1), load_weights(weights))
    prompts = arithmetic_task.examples("train", 4)
    try:
        # update 1: healthy
        good = rl_step(c, prompts, ratio_cap=2.0, reuse_training_forward=reuse_training_forward)
        assert good["train/skipped"] == 0 and len(synced) == 1
        before = {k: v.clone() for k, v in c.trainer.state_dict().items()}
        # update 2: NaN logits -> NaN loss and gradients (and, in one pass, NaN scored log-probs)
        bad = rl_step(c, prompts, ratio_cap=2.0, reuse_training_forward=reuse_training_forward)
        assert bad["train/skipped"] == 1
        assert len(synced) == 1  # nothing was sent to the sampler
        for key, value in c.trainer.state_dict().items():
            assert torch.equal(value, before[key]), key  # and the trainer's weights did not move
    finally:
        c.trainer.close()
        c.sampler.close()


def test_fp16_overflow_skips_the_step_and_halves_the_loss_scale(small_model_path, arithmetic_task):
    """trainer=torch in fp16 with a loss scale far too large (2^24: this model's fp16 gradients overflow
    from 2^17 on): each step overflows, its optimizer step is skipped without touching the weights or the
    sampler, and halves the scale, until the scale fits and a step goes through and is synced. The skips
    are the loss scaler's normal business: logged as train/loss_scale_skipped, not as bad steps (before,
    each counted as one, and train.max_bad_steps=3 ended an fp16 run before its scale settled)."""
    from transformers import AutoTokenizer

    from rlmm.algos import GRPO
    from rlmm.corrections.tis import TokenTIS
    from rlmm.run.components import Components
    from rlmm.run.step import rl_step
    from tests.test_train import ALGO, ParityTask

    options = sampling(max_new_tokens=6)
    trainer = from_yaml("trainer", "torch", model_path=small_model_path, precision=SidePrecision("fp16", False),
                        sampling=options, micro_batch_size=8, lr=1e-3,
                        initial_loss_scale=2.0 ** 24)
    sampler = from_yaml("sampler", "hf", model_path=small_model_path, precision=SidePrecision("fp16", False),
                        sampling=options, seed=0)
    synced = []
    load_weights = sampler.load_weights
    sampler.load_weights = lambda weights: (synced.append(1), load_weights(weights))
    c = Components(task=ParityTask(arithmetic_task), tokenizer=AutoTokenizer.from_pretrained(small_model_path),
                   sampler=sampler, trainer=trainer, correction=TokenTIS(cap=2.0), algo=GRPO(**ALGO),
                   sampling=options)
    prompts = arithmetic_task.examples("train", 4)
    try:
        scales, skipped = [], []
        while not skipped or skipped[-1]:
            assert len(skipped) < 12, f"no step went through: loss scales {scales}"
            before = {k: v.clone() for k, v in trainer.state_dict().items()}
            master_before = [p.clone() for p in trainer.master_params]
            metrics = rl_step(c, prompts, ratio_cap=2.0, reuse_training_forward=False)
            scales.append(metrics["train/loss_scale"])
            skipped.append(metrics["train/loss_scale_skipped"])
            assert metrics["train/skipped"] == 0  # not a bad step
            if metrics["train/loss_scale_skipped"]:
                assert len(synced) == 0  # nothing was sent to the sampler
                assert all(torch.equal(v, before[k]) for k, v in trainer.state_dict().items())
                assert all(torch.equal(p, q) for p, q in zip(trainer.master_params, master_before))
        assert skipped[0] == 1 and scales[0] == 2.0 ** 24
        assert scales == [2.0 ** (24 - i) for i in range(len(scales))]  # halved after every overflow
        assert len(synced) == 1  # the step that fit was synced, and its weights moved
        assert any(not torch.equal(v, before[k]) for k, v in trainer.state_dict().items())
        assert all(v.dtype == torch.float16 for v in trainer.state_dict().values())
        assert trainer.grad_scaler.get_scale() == scales[-1]  # a clean step keeps the scale (growth after 1000)
    finally:
        trainer.close()
        sampler.close()


def test_all_finite_is_exact():
    from rlmm.trainers.weight_sync import all_finite

    weights = [torch.randn(64, 32), torch.randn(32, dtype=torch.bfloat16), torch.randn(8, dtype=torch.float16)]
    assert all_finite(weights)
    for bad in (float("nan"), float("inf"), -float("inf")):
        for i in range(len(weights)):
            poisoned = [w.clone() for w in weights]
            poisoned[i][3] = bad
            assert not all_finite(poisoned), (bad, i)
    huge = [torch.full((1000,), 3e38), torch.full((100,), 60000.0, dtype=torch.float16)]  # squares overflow
    assert all_finite(huge)


def test_nan_weights_are_never_sent_to_the_sampler(small_model_path, arithmetic_task):
    """An update that leaves NaN in the weights (with finite gradients: no skip) stops the step before
    the sync; the sampler keeps the weights it had."""
    from rlmm.run.step import rl_step
    from rlmm.runtime.errors import NonFiniteWeights
    from tests.test_train import ParityTask

    c = make_faulty_components(small_model_path, ParityTask(arithmetic_task), "torch", "fp32")
    c.trainer.nan_from_update = 10 ** 9  # no NaN gradients: the weights go bad after a healthy update
    state_dict = c.trainer.state_dict

    def poisoned_state_dict():
        weights = state_dict()
        next(iter(weights.values())).view(-1)[0] = float("nan")
        return weights

    c.trainer.state_dict = poisoned_state_dict
    synced = []
    c.sampler.load_weights = lambda weights: synced.append(1)
    try:
        with pytest.raises(NonFiniteWeights, match="were not sent to the sampler"):
            rl_step(c, arithmetic_task.examples("train", 4), ratio_cap=2.0, reuse_training_forward=True)
        assert synced == []
    finally:
        c.trainer.close()
        c.sampler.close()


def test_run_stops_after_max_bad_steps_with_a_checkpoint(small_model_path, tmp_path):
    result = subprocess.run(
        train_command(small_model_path, tmp_path, "logger=none", "trainer=torch", "sampler=hf",
                      "trainer._target_=tests.faults.NaNTorchTrainer", "+trainer.nan_from_update=2",
                      "train.max_bad_steps=2", "train.steps=6", "train.checkpoint_every=1"),
        capture_output=True, text=True, timeout=600, env=subprocess_env(), stdin=subprocess.DEVNULL)
    assert result.returncode == 3, result.stderr[-3000:]
    assert ending(result).startswith("rlmm: stopped: 2 bad steps in a row (train.max_bad_steps=2) at step 3")
    rows = read_steps(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["train/skipped"] for r in rows[1:]] == [0, 1, 1]
    assert [r["train/bad_steps"] for r in rows[1:]] == [0, 1, 2]
    # One pass (the default): the poisoned training forward is also the scoring, so the scored log-probs
    # name the fault; the NaN loss it gives is then skipped by the trainer.
    assert "bad step skipped: non-finite trainer logprobs" in result.stdout + result.stderr
    from safetensors.torch import load_file

    # The checkpoints of the two bad steps hold the same weights: the skipped updates changed nothing.
    last = checkpoint.latest(tmp_path)
    assert last.name == "step-000003"
    # the streak travels with the checkpoint: resumed, the run's next bad step is its third in a row
    assert json.loads((last / "state.json").read_text())["loop"] == {"bad_steps": 2, "bad_steps_in_a_row": 2,
                                                                     "monitor": {}}
    after_bad = load_file(last / "model.safetensors")
    before_bad = load_file(last.parent / "step-000002" / "model.safetensors")
    assert all(torch.equal(after_bad[k], before_bad[k]) for k in after_bad)


def test_nonfinite_logprobs_say_which_side_how_many_and_the_fp16_cause():
    """fp16 activations overflow in some models (Qwen2's do): the probe stops with one line naming the side,
    the share and the cause, and a training step's skip reason says the same."""
    from types import SimpleNamespace

    from rlmm.probe.checks import check_finite
    from rlmm.run.step import nonfinite_hint

    report = {"actual": {"sampler": {"dtype": "fp16"}, "trainer": {"dtype": "fp32"}}}
    with pytest.raises(ValueError, match=r"^probe: non-finite log-probs: 25.0% of the sampler's \(fp16\); fp16 "
                                         r"activations overflow in some models \(Qwen2 is known to\): use "
                                         r"precision=bf16 or fp32$"):
        check_finite({"sampler": torch.tensor([0.1, float("nan"), -1.0, -2.0]), "trainer": torch.zeros(4)}, report)
    check_finite({"sampler": torch.zeros(3), "trainer": torch.zeros(3)}, report)  # all finite: nothing to say
    engines = SimpleNamespace(sampler=SimpleNamespace(actual_precision={"dtype": "bf16"}),
                              trainer=SimpleNamespace(actual_precision={"dtype": "fp16"}))
    assert nonfinite_hint({"trainer": 0.5, "sampler": 0.0}, engines) == (
        " (50.0% of the trainer's); fp16 activations overflow in some models (Qwen2 is known to): use precision=bf16 "
        "or fp32")
    engines.trainer.actual_precision["dtype"] = "fp32"
    assert nonfinite_hint({"trainer": 0.5, "sampler": 0.0}, engines) == " (50.0% of the trainer's)"


def test_a_sampler_that_dropped_its_weights_gets_them_back_after_a_skipped_step(small_model_path, arithmetic_task):
    """vLLM's sleep level 2 (the GPU default) discards the sampler's weights while the trainer updates. A skipped
    step changed no weights, but the sampler no longer holds them: the step must re-send the trainer's unchanged
    weights, or the next generation runs on whatever the freed memory holds. The sampler here drops its weights
    as level 2 does (its `sleep` sets `needs_weights`, its `generate` refuses until a sync)."""
    from rlmm.run.step import rl_step
    from tests.test_train import ParityTask

    c = make_faulty_components(small_model_path, ParityTask(arithmetic_task), "torch", "fp32")
    sampler, synced = c.sampler, []
    load_weights, generate = sampler.load_weights, sampler.generate

    def sleep():
        sampler.needs_weights = True

    def reload(weights):
        synced.append({k: v.clone() for k, v in weights.items()})
        load_weights(weights)
        sampler.needs_weights = False

    def generate_with_weights(*args, **kwargs):
        assert not sampler.needs_weights, "generate after the weights were dropped and not sent again"
        return generate(*args, **kwargs)

    sampler.sleep, sampler.load_weights, sampler.generate = sleep, reload, generate_with_weights
    prompts = arithmetic_task.examples("train", 4)
    try:
        assert rl_step(c, prompts, ratio_cap=2.0, reuse_training_forward=True)["train/skipped"] == 0
        assert rl_step(c, prompts, ratio_cap=2.0, reuse_training_forward=True)["train/skipped"] == 1  # NaN update
        assert len(synced) == 2 and all(torch.equal(synced[0][k], synced[1][k]) for k in synced[0])  # unchanged, re-sent
        rl_step(c, prompts, ratio_cap=2.0, reuse_training_forward=True)  # generates (NaN again from update 2 on)
        assert len(synced) == 3
    finally:
        c.trainer.close()
        c.sampler.close()
