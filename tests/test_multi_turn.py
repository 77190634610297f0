"""`rlmm train` on a multi-turn task (issue 60), end to end on the shipped calculator model: every sampler, the token
paths, stale rollouts, the bitwise arm, two ranks against one, and a run stopped and resumed."""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import subprocess_env, torchrun

# The calculator's turns need more than debug=train's 8 tokens (a call such as calc(57-43) is 11 and <eos>).
SHORT = ["task=calculator", "debug=train", "sampling.max_new_tokens=16", "train.eval_prompts=8"]


def rlmm_train(run_dir: Path, *overrides: str, timeout: float = 900) -> list[dict]:
    result = subprocess.run([sys.executable, "-m", "rlmm.cli", "train", *SHORT, *overrides, f"hydra.run.dir={run_dir}"],
                            capture_output=True, text=True, timeout=timeout, env=subprocess_env(),
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]


def test_the_calculator_trains_on_vllm_and_deepspeed(tmp_path):
    """The default engines on the calculator task: conversations of several turns, the environment's tokens outside
    the mismatch, the drift and turn-edge metrics logged, the held-out accuracy of greedy conversations."""
    steps = rlmm_train(tmp_path)
    assert [s["step"] for s in steps] == [0, 1, 2]
    for step in steps[1:]:
        assert step["conversation/turns_mean"] > 1 and step["conversation/tool_calls_mean"] > 0
        assert step["token_path/frac_turns_drifted"] == 0  # the character model re-renders what it sampled
        assert step["mismatch/num_tokens"] > 0 and step["mismatch/token_mult_prob_error_generated"] >= 1
        assert 0 <= step["eval/accuracy"] <= 1 and 0 <= step["eval/accuracy_trained"] <= 1
    assert steps[0]["eval/accuracy"] > 0.2  # the warm-started model solves problems with the calculator


@pytest.mark.slow  # each path's rows: tests/test_episodes.py, tests/test_token_path.py
@pytest.mark.parametrize("token_path", ["retokenize", "realign"])
def test_each_token_path_trains_on_transformers(tmp_path, token_path):
    steps = rlmm_train(tmp_path, "sampler=hf", "trainer=torch", f"token_path={token_path}")
    assert steps[-1]["conversation/turns_mean"] > 1 and steps[-1]["train/skipped"] == 0
    if token_path == "realign":
        assert steps[-1]["token_path/frac_turns_realign"] == 0  # nothing drifted: every turn clean


@pytest.mark.slow  # ~1-2 min
def test_the_bitwise_arm_agrees_to_the_bit_over_whole_conversations(tmp_path):
    """sampler=bitwise on conversations: the trainer scores each sampled token of every turn, with the environment's
    tokens before it, to the bits the sampler drew it with (a step that is not is an error naming the token)."""
    steps = rlmm_train(tmp_path, "sampler=bitwise", "precision=bf16", "trainer=torch")
    assert all(s["agreement/bitwise"] == 1 for s in steps[1:])
    assert steps[-1]["conversation/turns_mean"] > 1


@pytest.mark.slow  # ~30 s
def test_stale_conversations_train(tmp_path):
    steps = rlmm_train(tmp_path, "train.staleness=1", "train.steps=3", "sampler=hf", "trainer=torch")
    assert [s["rollout/staleness"] for s in steps[1:]] == [0, 1, 1]


def calculator_draws(path: Path) -> list[tuple[str, str]]:
    return [tuple(line.split("\t")) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_two_ranks_hold_the_conversations_one_rank_holds(tmp_path):
    """Two ranks hold, between them, the conversations one rank holds (fp32 vLLM, seeded requests): a turn one rank
    no longer needs is still a call there, so every later turn's seeds are the one-rank run's."""
    for ranks in (1, 2):
        record = tmp_path / f"draws{ranks}"
        record.mkdir()
        torchrun(["-m", "rlmm.cli", "train", "task=calculator", "task._target_=tests.recording.RecordedCalculator",
                  f"+task.record_dir={record}", "model=hf", f"model.path={shipped_calculator_model()}", "train.steps=1",
                  "train.eval_prompts=4", "train.eval_trained_weights=false", "train.prompts_per_step=4",
                  "algo.group_size=4", "sampling.temperature=1.5", "precision=fp32", "logger=none",
                  "train.checkpoint_every=0", f"hydra.run.dir={tmp_path / f'run{ranks}'}"], ranks=ranks)
    one = calculator_draws(tmp_path / "draws1" / "rank0.txt")
    two = calculator_draws(tmp_path / "draws2" / "rank0.txt") + calculator_draws(tmp_path / "draws2" / "rank1.txt")
    training = [d for d in one if d[0] == "train"]
    assert len(training) == 16 and Counter(training) == Counter(d for d in two if d[0] == "train")
    assert len({d[2] for d in training}) > 1  # the answers vary: the draws are not all alike


def shipped_calculator_model(model: str = "tiny", **task_values) -> str:
    """The shipped model `model=<model> task=calculator` resolves to (an error where it would have to be built)."""
    from rlmm.config.options import from_yaml, option_node, to_container
    from rlmm.models.tiny import BUILTIN_DIR, model_task_config, shipped_digests

    task_config = to_container(option_node("task", "calculator")) | task_values
    spec = from_yaml("model", model)
    name = f"{spec.prefix}-{spec.cache_key(model_task_config(from_yaml('task', 'calculator', **task_values), task_config))}"
    assert name in shipped_digests(), f"{name} does not ship (rlmm/models/builtin/SHA256SUMS)"
    return str(BUILTIN_DIR / name)


@pytest.mark.parametrize("model", ["tiny", "tiny_bpe"])
def test_the_calculators_models_ship_and_the_environments_limits_do_not_name_them(model):
    """Both built-in models of the calculator task ship; a turn limit, a context limit or a tool timeout changes no
    demonstration, so it resolves to the same shipped model (no hour-long warm start for `task.max_turns=2`), while a
    value the demonstrations read (`direct_demos`) names another."""
    shipped = shipped_calculator_model(model)
    assert shipped_calculator_model(model, max_turns=2, max_context_tokens=64, tool_timeout_s=5.0) == shipped
    with pytest.raises(AssertionError, match="does not ship"):
        shipped_calculator_model(model, direct_demos=0.25)


@pytest.mark.slow  # ~1 min
def test_conversations_in_flight_resume_to_the_uninterrupted_records(tmp_path):
    """Staleness 1 on the calculator, SIGTERM after step 2: the checkpoint holds batch 3's conversations, sampled and
    not yet trained (their messages, turns and sampled masks), and the resumed run logs every number the
    uninterrupted one logs (fp32 transformers: the same draws)."""
    from tests.test_reliability import comparable
    from tests.test_staleness import stopped_after_step_two

    from rlmm.run.records import read_steps

    common = [*SHORT, "train.steps=4", "train.staleness=1", "sampler=hf", "trainer=torch", "precision=fp32",
              "train.checkpoint_every=0"]
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    rlmm_train(straight, *common[len(SHORT):])
    command = [sys.executable, "-m", "rlmm.cli", "train", *common, f"hydra.run.dir={interrupted}"]
    _, in_flight = stopped_after_step_two(command, interrupted)
    (batch,) = in_flight
    rollouts = batch["rollouts"]
    assert batch["index"] == 3 and len(rollouts["conversations"]) == len(rollouts["sampled"]) == 4
    assert all(record["messages"][0]["role"] == "user" for record in rollouts["conversations"])
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=600, env=subprocess_env(),
                             stdin=subprocess.DEVNULL)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert comparable(read_steps(interrupted)) == comparable(read_steps(straight))


def test_the_probe_measures_conversations_and_retokenization(tmp_path):
    """`rlmm probe` on the calculator with the BPE model: the sampler-vs-trainer gap over the conversations' sampled
    tokens, their turns, and re-tokenization as its own component (the text scored as sampled and as re-rendered)."""
    result = subprocess.run([sys.executable, "-m", "rlmm.cli", "probe", "task=calculator", "model=tiny_bpe",
                             "debug=probe", "sampling.max_new_tokens=16", "sampler=hf", "trainer=torch",
                             f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=900,
                            env=subprocess_env(), stdin=subprocess.DEVNULL)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    record = json.loads((tmp_path / "probe.json").read_text())
    retokenized, conversations = record["retokenization"], record["conversations"]
    assert retokenized["num_conversations"] == record["rollouts"]["num"] > 0
    assert 0 <= retokenized["frac_turns_drifted"] <= 1 and conversations["conversation/turns_mean"] >= 1
    if retokenized["frac_conversations_drifted"] == 0:  # nothing re-rendered otherwise: the same text, the same ids
        assert retokenized["conversation_logprob_gap_abs_mean"] == 0
    assert record["sampler_vs_trainer"]["num_tokens"] > 0 and "re-tokenization:" in result.stdout
