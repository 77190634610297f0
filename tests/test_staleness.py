"""`train.staleness` (rlmm/run/rollout_source.py): update u trains on rollouts sampled with the weights of update
u-1-k (the initial weights for the first k+1 updates); `train.decompose_staleness` splits the mismatch into a
numerical and a policy-lag part; the rollouts in flight survive a SIGTERM and a resume; DAPO, PPO and two
ranks run with it. In-process runs use the tests' small model with transformers sampling and the torch trainer
in fp32 (seconds a step); the resume and the two-rank runs go through `rlmm train`."""
import hashlib
import json
import signal
import subprocess
import sys

import pytest
import torch

from rlmm.config.options import from_yaml
from rlmm.policy.precision import SidePrecision
from rlmm.policy.rollouts import Rollouts
from rlmm.run import checkpoint
from rlmm.run.records import read_steps
from rlmm.run.rollout_source import DelayLine, InFlight
from rlmm.run.rollout_source import prompt_stream
from rlmm.run.step import SampledBatch, rl_step, rl_update
from tests.conftest import build_trainer, sampling, subprocess_env, torchrun
from tests.test_reliability import comparable, train_command
from tests.test_train import ALGO, ParityTask

PROMPTS_PER_STEP = 4
# The decomposition's parts add up to the total for the metrics linear in the log-ratio.
ADDITIVE = ("kl_k1", "seq_logratio_mean", "seq_geo_logratio_mean")


class ConstantTask(ParityTask):
    """Every response rewarded alike: every advantage is 0, so the gradient is 0 and (without weight decay) the
    weights stand still, update after update."""

    def reward(self, example, completion):
        return 0.0


def components(model_path, task, algo=None, **trainer_values):
    from transformers import AutoTokenizer

    from rlmm.algos import GRPO
    from rlmm.corrections.tis import TokenTIS
    from rlmm.run.components import Components

    options, fp32 = sampling(max_new_tokens=6), SidePrecision("fp32", False)
    sampler = from_yaml("sampler", "hf", model_path=model_path, precision=fp32, sampling=options, seed=0)
    trainer = build_trainer("torch", model_path, fp32, options, micro_batch_size=8,
                            **{"lr": 1e-3, **trainer_values})
    return Components(task=task, tokenizer=AutoTokenizer.from_pretrained(model_path), sampler=sampler,
                      trainer=trainer, correction=TokenTIS(cap=2.0), algo=algo or GRPO(**ALGO), sampling=options)


def prompts_of(pool, seed=0, count=PROMPTS_PER_STEP):
    """Batch j's prompts and refill, as the train loop deals them."""
    return prompt_stream(pool, seed, count)


def run(c, task, steps, staleness, decompose=False, reuse_training_forward=True):
    """`steps` updates through the delay line, as the train loop takes them: each update's metrics (the
    components closed after, `c.final_weights` the trainer's last weights)."""
    pool = task.examples("train", steps * PROMPTS_PER_STEP)
    line = DelayLine(c, prompts_of(pool), staleness, decompose, last_step=steps)
    return closing(c, lambda: [rl_update(c, line.take(step), 2.0, reuse_training_forward)
                               for step in range(1, steps + 1)])


def closing(c, steps):
    torch.manual_seed(0)
    try:
        metrics = steps()
        c.final_weights = {k: v.clone() for k, v in c.trainer.state_dict().items()}
        return metrics
    finally:
        c.critic.close()
        c.trainer.close()
        c.sampler.close()


def without_timings(metrics):
    return {k: v for k, v in metrics.items() if not k.startswith("perf/")}


def fingerprint(module: torch.nn.Module) -> str:
    return hashlib.sha1(b"".join(p.detach().cpu().contiguous().numpy().tobytes()
                                 for p in module.parameters())).hexdigest()


def responses(rollouts) -> tuple:
    return tuple(map(tuple, rollouts.response_ids))


def test_staleness_0_is_the_step_before_staleness(small_model_path, arithmetic_task):
    """k = 0 through the delay line is the loop as it was (`rl_step` on step u's prompts and refill): the same
    metrics, no staleness key, the same weights after 3 steps."""
    steps = 3
    before = components(small_model_path, ParityTask(arithmetic_task))
    deal = prompts_of(arithmetic_task.examples("train", steps * PROMPTS_PER_STEP))
    metrics_before = closing(before, lambda: [rl_step(before, *deal(step)[:1], 2.0, True, deal(step)[1])
                                              for step in range(1, steps + 1)])
    after = components(small_model_path, ParityTask(arithmetic_task))
    metrics_after = run(after, arithmetic_task, steps, staleness=0)
    assert [without_timings(m) for m in metrics_after] == [without_timings(m) for m in metrics_before]
    assert not [k for m in metrics_after for k in m if k == "rollout/staleness" or k.startswith("mismatch/numerical/")]
    assert all(torch.equal(after.final_weights[k], v) for k, v in before.final_weights.items())


@pytest.mark.parametrize("staleness", [1, 2])
def test_each_update_trains_on_rollouts_sampled_k_updates_earlier(small_model_path, arithmetic_task, staleness):
    """Update u trains on the rollouts of step u's prompts that the sampler drew holding the weights the trainer
    held at update max(1, u-k), i.e. v_{max(0, u-1-k)}: every generate call and every update is fingerprinted by
    the weights it ran with. With the decomposition, each batch was scored by the trainer at those same
    weights, its parts add up to the total, and the lag part is the one that grows."""
    steps = 5
    c = components(small_model_path, ParityTask(arithmetic_task))
    sampled, trained, scored = {}, [], {}
    generate, begin_update, logprobs = c.sampler.generate, c.trainer.begin_update, c.trainer.logprobs

    def generate_seen(prompt_ids, **kwargs):
        rollouts = generate(prompt_ids, **kwargs)
        if not kwargs.get("greedy"):
            sampled[responses(rollouts)] = fingerprint(c.sampler.model)
        return rollouts

    def begin_update_seen(rollouts, rows):
        trained.append((fingerprint(c.trainer.model), responses(rollouts), rollouts.prompt_ids))
        return begin_update(rollouts, rows)

    def logprobs_seen(rollouts, *args, **kwargs):
        scored.setdefault(responses(rollouts), fingerprint(c.trainer.model))  # the first scoring: at sampling
        return logprobs(rollouts, *args, **kwargs)

    c.sampler.generate, c.trainer.begin_update, c.trainer.logprobs = generate_seen, begin_update_seen, logprobs_seen
    metrics = run(c, arithmetic_task, steps, staleness, decompose=True)

    versions = [weights for weights, _, _ in trained]  # versions[u - 1]: v_{u-1}, the weights update u starts from
    assert len(set(versions)) == steps  # every update moved the weights: the lineage below means something
    tokenizer = c.tokenizer
    pool = arithmetic_task.examples("train", steps * PROMPTS_PER_STEP)
    for u, (_, rows, prompt_ids) in enumerate(trained, start=1):
        sampling_weights = versions[max(1, u - staleness) - 1]
        assert sampled[rows] == sampling_weights, f"update {u}"
        assert scored[rows] == sampling_weights, f"update {u}"  # the stale log-probs: the trainer at those weights
        expected_prompts = [tokenizer(e.prompt).input_ids for e in pool[(u - 1) * PROMPTS_PER_STEP:
                                                                      u * PROMPTS_PER_STEP]]
        assert prompt_ids == [p for p in expected_prompts for _ in range(ALGO["group_size"])]  # step u's prompts
        assert metrics[u - 1]["rollout/staleness"] == min(u - 1, staleness)
    assert len(sampled) == steps  # nothing sampled for updates past the last one

    for u, m in enumerate(metrics, start=1):
        for key in ADDITIVE:
            assert m[f"mismatch/numerical/{key}"] + m[f"mismatch/policy_lag/{key}"] == pytest.approx(
                m[f"mismatch/{key}"], rel=1e-9, abs=1e-12), (u, key)
        numerical, lag = m["mismatch/numerical/logprob_abs_diff_mean"], m["mismatch/policy_lag/logprob_abs_diff_mean"]
        assert numerical < 1e-5  # fp32 against fp32 at the same weights: rounding
        if u == 1:
            assert lag < 1e-5  # the same weights: the update's own forward against the no-grad scoring
        else:
            assert lag > 100 * numerical, u  # k updates of lr 1e-3 move the log-probs far beyond rounding


def test_with_weights_standing_still_the_numerical_part_is_the_synchronous_mismatch(small_model_path,
                                                                                   arithmetic_task):
    """Every advantage 0 and no weight decay: the weights never move, so staleness 2 samples what staleness 0 samples
    (the same seeds, batch by batch), its numerical part is the staleness-0 run's mismatch and its lag part is 0,
    exactly (both scored without grad: `reuse_training_forward=false`)."""
    steps, runs = 4, {}
    for staleness, decompose in ((0, False), (2, True)):
        c = components(small_model_path, ConstantTask(arithmetic_task), weight_decay=0.0)
        start = fingerprint(c.trainer.model)
        drawn = []
        generate = c.sampler.generate

        def generate_seen(prompt_ids, _generate=generate, _drawn=drawn, **kwargs):
            rollouts = _generate(prompt_ids, **kwargs)
            if not kwargs.get("greedy"):
                _drawn.append(responses(rollouts))
            return rollouts

        c.sampler.generate = generate_seen
        model = c.trainer.model
        runs[staleness] = (run(c, arithmetic_task, steps, staleness, decompose, reuse_training_forward=False), drawn)
        assert fingerprint(model) == start  # the weights stood still
    (synchronous, drawn_0), (stale, drawn_2) = runs[0], runs[2]
    assert drawn_2 == drawn_0  # the same rollouts, batch by batch
    for u, (now, then) in enumerate(zip(synchronous, stale), start=1):
        assert then["rollout/staleness"] == min(u - 1, 2)
        for key, value in now.items():
            if key.startswith("mismatch/"):
                assert then[f"mismatch/numerical/{key.removeprefix('mismatch/')}"] == value, (u, key)
                assert then[key] == value, (u, key)  # and so is the total
        assert then["mismatch/policy_lag/logprob_abs_diff_max"] == 0.0
        assert then["mismatch/policy_lag/kl_k1"] == 0.0


def test_a_checkpoint_must_match_the_runs_staleness():
    """Resuming needs the batches the run's own staleness keeps in flight, scored if it decomposes."""
    line = DelayLine(None, prompts_of([]), staleness=2, decompose=False, last_step=4)
    with pytest.raises(ValueError, match=r"^train.resume: the checkpoint was written with train.staleness=0, this "
                                         r"run has 2 \(resume with the run's own, or another hydra.run.dir\)$"):
        line.load_state_dict(None, first_step=3)
    DelayLine(None, prompts_of([]), staleness=0, decompose=True, last_step=4).load_state_dict(None, first_step=3)
    unscored = DelayLine(None, prompts_of([]), staleness=1, decompose=False, last_step=4)
    unscored.in_flight.append(InFlight(3, 1, SampledBatch(Rollouts([[1]], [[2]], [torch.zeros(1)], ["stop"]),
                                                          torch.zeros(1), {}, {})))
    with pytest.raises(ValueError, match=r"^train.resume: the checkpoint's rollouts in flight were not scored"):
        DelayLine(None, prompts_of([]), staleness=1, decompose=True, last_step=4).load_state_dict(
            unscored.state_dict(), first_step=3)
    with pytest.raises(ValueError, match=r"^train.staleness: must be >= 0, got -1$"):
        DelayLine(None, prompts_of([]), staleness=-1, decompose=False, last_step=4)


SIGNAL_AFTER_STEP_TWO = """
import os, signal, sys
from rlmm.run.records import RunRecord

log = RunRecord.log

def log_then_signal(self, metrics, step):
    log(self, metrics, step)
    if step == 2:  # the run checkpoints at the end of step 2, with batches 3 and 4 in flight
        os.kill(os.getpid(), signal.SIGTERM)

RunRecord.log = log_then_signal
from rlmm.cli import main
main(sys.argv[1:])
"""


def stopped_after_step_two(command: list[str], run_dir) -> tuple[dict, list[dict]]:
    """`rlmm train` `command` (tests/test_reliability.py's `train_command`, writing to `run_dir`) SIGTERMed after
    step 2: it must exit as a stop does, its newest checkpoint at step 2; returns that checkpoint's state.json and
    its rank 0's rollouts in flight."""
    stopped = subprocess.run([sys.executable, "-c", SIGNAL_AFTER_STEP_TWO, *command[3:]], capture_output=True,
                             text=True, timeout=600, env=subprocess_env(), stdin=subprocess.DEVNULL)
    assert stopped.returncode == 128 + signal.SIGTERM, (stopped.stdout + stopped.stderr)[-3000:]
    last = checkpoint.latest(run_dir)
    state = json.loads((last / "state.json").read_text())
    assert state["step"] == 2
    return state, torch.load(last / "rank0.pt", weights_only=True)["rollouts"]["in_flight"]


def test_staleness_2_stopped_by_sigterm_resumes_to_the_uninterrupted_numbers(small_model_path, tmp_path):
    """k = 2 with the decomposition, SIGTERM after step 2: the checkpoint holds the two batches in flight (sampled
    with v_0 and v_1) with their stale log-probs, and the resumed run logs every number the uninterrupted one
    logs."""
    common = ("sampler=hf", "trainer=torch", "logger=none", "train.checkpoint_every=0", "train.steps=5",
              "train.staleness=2", "train.decompose_staleness=true")
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    command = train_command(small_model_path, straight, *common)
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=subprocess_env(),
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]

    command = train_command(small_model_path, interrupted, *common)
    _, in_flight = stopped_after_step_two(command, interrupted)
    assert [(b["index"], b["version"]) for b in in_flight] == [(3, 0), (4, 1)]
    assert all(b["stale_logprobs"].shape[0] == 4 * 4 for b in in_flight)  # 4 prompts x 4 samples, scored

    resumed = subprocess.run(command, capture_output=True, text=True, timeout=600, env=subprocess_env(),
                             stdin=subprocess.DEVNULL)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    rows = read_steps(interrupted)
    assert [row["step"] for row in rows] == list(range(6))
    assert [row["rollout/staleness"] for row in rows[1:]] == [0, 1, 2, 2, 2]
    assert comparable(rows) == comparable(read_steps(straight))


@pytest.mark.parametrize("algo_name", ["dapo", "ppo"])
def test_dapo_and_ppo_train_with_staleness_1(small_model_path, arithmetic_task, algo_name):
    """DAPO's dynamic sampling refills each batch when it is sampled (its refills of (seed, j, round)); PPO's critic
    scores and trains on the stale rollouts with its current weights."""
    from rlmm.run.critic import ValueCritic

    task = arithmetic_task if algo_name == "dapo" else ParityTask(arithmetic_task)  # DAPO: groups all wrong drop
    algo = from_yaml("algo", algo_name, group_size=4, **({"critic_warmup_steps": 1} if algo_name == "ppo" else {}))
    c = components(small_model_path, task, algo=algo)
    if algo.critic:
        c.critic = ValueCritic(build_trainer("torch", small_model_path, SidePrecision("fp32", False), c.sampling,
                                             micro_batch_size=8, value_head=True, lr=algo.critic["lr"]),
                               algo.critic["warmup_steps"])
    metrics = run(c, task, 3, staleness=1, decompose=True)
    assert [m["rollout/staleness"] for m in metrics] == [0, 1, 1]
    assert not any(m["train/skipped"] for m in metrics)
    assert all(torch.isfinite(torch.tensor(m["mismatch/policy_lag/kl_k3"])) for m in metrics)
    if algo_name == "dapo":
        assert sum(m["rollout/sampling_rounds"] for m in metrics) > 0  # some batch was refilled
    else:
        assert [m["critic/warming_up"] for m in metrics] == [1, 0, 0]
        assert all("loss/pg_loss" in m for m in metrics[1:])


@pytest.mark.slow  # torchrun or a stop and resume: minutes (docs/testing.md)
def test_two_ranks_with_staleness_1(small_model_path, tmp_path):
    """Two ranks (gloo), k = 1 with the decomposition: each rank samples its share ahead and keeps its own batches
    in flight; every prompt of every step is still rewarded on exactly one rank, group_size times."""
    from collections import Counter

    from rlmm.tasks.arithmetic import _in_test_split

    records = tmp_path / "rewarded"
    records.mkdir()
    torchrun(["-m", "rlmm.cli", "train", "model=hf", f"model.path={small_model_path}", "sampler=hf",
              "trainer=torch", "precision=fp32", "task._target_=tests.recording.RecordedArithmetic",
              f"+task.record_dir={records}", "train.steps=3", "train.eval_every=3", "train.eval_prompts=8",
              "train.prompts_per_step=4", "algo.group_size=4", "logger=none", "train.staleness=1",
              "train.decompose_staleness=true", f"hydra.run.dir={tmp_path / 'run'}"])
    rows = read_steps(tmp_path / "run")
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    assert [row["rollout/staleness"] for row in rows[1:]] == [0, 1, 1]
    for row in rows[1:]:
        for key in ADDITIVE:  # means over the ranks of parts that add up on each rank
            assert row[f"mismatch/numerical/{key}"] + row[f"mismatch/policy_lag/{key}"] == pytest.approx(
                row[f"mismatch/{key}"], rel=1e-9, abs=1e-12)
    rewarded = [Counter(p for p in (records / f"rank{r}.txt").read_text().split() if not _in_test_split(p))
                for r in (0, 1)]
    trained = from_yaml("task", "arithmetic", seed=0).examples("train", 3 * 4)
    assert rewarded[0] + rewarded[1] == Counter({p: 4 * n for p, n in Counter(e.prompt for e in trained).items()})
    assert not set(rewarded[0]) & set(rewarded[1])
