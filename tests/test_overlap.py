"""`train.overlap` (rlmm/run/sampler_process.py, rlmm/run/rollout_source.py's `Overlapped`): each rank's sampler in a
process of its own, sampling the next batches while the trainer trains, gives the delay line's records on the same
`train.staleness` (sampler=hf, trainer=torch, fp32 on CPU: every number but the timings, bit for bit), on one rank
and on two, and through a SIGTERM and a resume, with whole responses and with partial rollouts (whose checkpoint
either mode resumes); the combinations it cannot run are refused in one line. Every run
goes through `rlmm train` (about a minute each on 2 busy cores)."""
import subprocess
from collections import Counter

import pytest
from omegaconf import OmegaConf

from rlmm.config.options import CONF_DIR
from rlmm.run.records import read_steps
from rlmm.run.train import check_options
from tests.conftest import subprocess_env, torchrun
from tests.test_reliability import comparable, train_command
from tests.test_staleness import stopped_after_step_two

# trainer.lr 1e-3: every update moves the weights well beyond rounding, so a batch sampled with other weights
# than the delay line's shows in its tokens and log-probs.
COMMON = ("sampler=hf", "trainer=torch", "trainer.lr=1e-3", "logger=none", "train.checkpoint_every=0",
          "train.steps=4", "train.staleness=1")
PARITY = "task._target_=tests.recording.ParityArithmetic"  # rewards that vary inside groups: the weights move


def replacing(base, *overrides):
    """`base`'s overrides with those of `overrides` set otherwise (Hydra refuses a key given twice), then the rest."""
    keys = {o.split("=", 1)[0] for o in overrides}
    return (*(o for o in base if o.split("=", 1)[0] not in keys), *overrides)


def rlmm_train(model_path, run_dir, *overrides):
    result = subprocess.run(train_command(model_path, run_dir, *COMMON, PARITY, *overrides), capture_output=True,
                            text=True, timeout=600, env=subprocess_env(), stdin=subprocess.DEVNULL)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return read_steps(run_dir)


@pytest.fixture(scope="module")
def delay_line_rows(small_model_path, tmp_path_factory):
    """The in-process delay line's record of the run every overlapped one must repeat."""
    return rlmm_train(small_model_path, tmp_path_factory.mktemp("delay_line"))


def test_overlapped_sampler_gives_the_delay_lines_records(small_model_path, delay_line_rows, tmp_path):
    """k = 1, one rank: the sampler process samples batch u + 1 with v_{u-1} while update u trains, with the delay
    line's seeds and rewards: every logged number but the timings is the in-process run's, evaluations included
    (the process's engine generates them). The trainer's only sampling time is what it waited."""
    rows = rlmm_train(small_model_path, tmp_path, "train.overlap=true")
    assert [row["step"] for row in rows] == list(range(5))
    assert [row["rollout/staleness"] for row in rows[1:]] == [0, 1, 1, 1]
    assert comparable(rows) == comparable(delay_line_rows)
    assert all("perf/rollout_wait_seconds" in row and "perf/generate_seconds" not in row for row in rows[1:])
    assert all("perf/generate_seconds" in row for row in delay_line_rows[1:4])
    assert all(row["loss/pg_loss"] != 0 for row in delay_line_rows[1:])  # every update moved the weights


@pytest.mark.slow  # torchrun or a stop and resume: minutes (docs/testing.md)
def test_overlapped_run_stopped_by_sigterm_resumes_to_the_uninterrupted_numbers(small_model_path, delay_line_rows,
                                                                               tmp_path):
    """SIGTERM after step 2: the checkpoint waits for the batch in flight (batch 3, sampled with v_1) and holds it
    with the sampler's call count, as the delay line's would; the resumed overlapped run repeats the uninterrupted
    in-process one."""
    command = train_command(small_model_path, tmp_path, *COMMON, PARITY, "train.overlap=true")
    state, in_flight = stopped_after_step_two(command, tmp_path)
    assert state["sampler_calls"] == 3  # batches 1, 2, 3: one generate call each
    assert [(b["index"], b["version"]) for b in in_flight] == [(3, 1)]

    resumed = subprocess.run(command, capture_output=True, text=True, timeout=600, env=subprocess_env(),
                             stdin=subprocess.DEVNULL)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert comparable(read_steps(tmp_path)) == comparable(delay_line_rows)


@pytest.mark.slow  # torchrun or a stop and resume: minutes (docs/testing.md)
@pytest.mark.parametrize("rollouts", ["whole", "partial"])
def test_two_ranks_each_with_its_sampler_process_give_the_delay_lines_records(small_model_path, tmp_path, rollouts):
    """Two trainer ranks (gloo), each with its sampler process (the two processes in a group of their own): the
    records of the two-rank delay line, and each rank's sampler process rewards that rank's prompts; with whole
    responses and with partial rollouts (k = 2, a token a chunk: each rank holds its own part-sampled rows, in the
    trainer process or in its sampler process)."""
    mode = COMMON if rollouts == "whole" else replacing(COMMON, *PARTIAL)
    runs = {}
    for overlap in (False, True):
        records = tmp_path / f"rewarded-{overlap}"
        records.mkdir()
        torchrun(["-m", "rlmm.cli", "train", "model=hf", f"model.path={small_model_path}", "precision=fp32",
                  "task._target_=tests.recording.RecordedArithmetic", f"+task.record_dir={records}",
                  "train.eval_every=4", "train.eval_prompts=8", "train.prompts_per_step=4", "algo.group_size=4",
                  *mode, f"train.overlap={str(overlap).lower()}", f"hydra.run.dir={tmp_path / str(overlap)}"])
        runs[overlap] = (read_steps(tmp_path / str(overlap)),
                         [Counter((records / f"rank{r}.txt").read_text().split()) for r in (0, 1)])
    (rows, rewarded), (delay_rows, delay_rewarded) = runs[True], runs[False]
    assert [row["step"] for row in rows] == list(range(5))
    assert comparable(rows) == comparable(delay_rows)
    assert rewarded == delay_rewarded and not set(rewarded[0]) & set(rewarded[1])
    if rollouts == "partial":
        assert [row["rollout/staleness"] for row in rows[1:]] == [0, 1, 2, 2]
        assert max(row["rollout/frac_responses_mixed"] for row in rows[1:]) > 0  # responses straddle a sync


# Partial rollouts (rlmm/run/partial_rollouts.py), k = 2, a token a chunk: every batch spans three weight versions.
PARTIAL = ("train.staleness=2", "train.partial_rollouts=true", "train.rollout_chunk=1")


def partial_command(model_path, run_dir, *overrides):
    return train_command(model_path, run_dir, *replacing((*COMMON, PARITY), *PARTIAL, *overrides))


def rlmm_train_partial(model_path, run_dir, *overrides):
    result = subprocess.run(partial_command(model_path, run_dir, *overrides), capture_output=True, text=True,
                            timeout=600, env=subprocess_env(), stdin=subprocess.DEVNULL)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return read_steps(run_dir)


@pytest.fixture(scope="module")
def partial_delay_line_rows(small_model_path, tmp_path_factory):
    """The in-process delay line's record of the partial-rollout run every overlapped one must repeat."""
    return rlmm_train_partial(small_model_path, tmp_path_factory.mktemp("partial_delay_line"))


def test_overlapped_partial_rollouts_give_the_delay_lines_records(small_model_path, partial_delay_line_rows,
                                                                  tmp_path):
    """Partial rollouts, k = 2, chunks of 1 token: the sampler process holds the batches in flight and at each step,
    after the weights of v_{u-1} arrived, finishes batch u, hands it over, then advances batch u+1 a token and
    starts u+2: the delay line's generate calls, in its order, with its weights and seeds. Every logged number but
    the timings is the in-process run's, the token staleness included."""
    rows = rlmm_train_partial(small_model_path, tmp_path, "train.overlap=true")
    assert [row["step"] for row in rows] == list(range(5))
    assert [row["rollout/staleness"] for row in rows[1:]] == [0, 1, 2, 2]
    assert comparable(rows) == comparable(partial_delay_line_rows)
    assert max(row["rollout/frac_responses_mixed"] for row in rows[1:]) > 0  # responses straddle a sync
    assert all("perf/rollout_wait_seconds" in row and "perf/generate_seconds" not in row for row in rows[1:])
    assert all(row["loss/pg_loss"] != 0 for row in partial_delay_line_rows[1:])  # every update moved the weights


@pytest.mark.slow  # two vLLM runs: minutes (docs/testing.md)
def test_overlapped_partial_rollouts_with_vllm_give_the_delay_lines_records(small_model_path, tmp_path):
    """vLLM's engine inside the sampler process, partial rollouts (k = 2, a token a chunk): each chunk is a generate
    call with `max_new_tokens` 1 from prompt + the tokens so far, in the delay line's order with its weights and seeds,
    so every logged number but the timings is the in-process run's."""
    rows = {overlap: rlmm_train_partial(small_model_path, tmp_path / str(overlap), "sampler=vllm",
                                        f"train.overlap={str(overlap).lower()}") for overlap in (False, True)}
    assert [row["rollout/staleness"] for row in rows[True][1:]] == [0, 1, 2, 2]
    assert max(row["rollout/frac_responses_mixed"] for row in rows[True][1:]) > 0
    assert comparable(rows[True]) == comparable(rows[False])


@pytest.mark.slow  # two stops and resumes: minutes (docs/testing.md)
@pytest.mark.parametrize("stopped_overlap", [True, False])
def test_partial_rollouts_resume_across_modes(small_model_path, partial_delay_line_rows, tmp_path, stopped_overlap):
    """SIGTERM after step 2 in one mode, resumed in the other: the checkpoint holds batches 3 and 4 part-sampled
    in the delay line's format (3 by v0 and v1, 4 by v1), whichever mode wrote it, and the run ends with the
    uninterrupted delay line's records."""
    command = partial_command(small_model_path, tmp_path, f"train.overlap={str(stopped_overlap).lower()}")
    _, in_flight = stopped_after_step_two(command, tmp_path)
    assert [(b["index"], b["version"]) for b in in_flight] == [(3, 0), (4, 1)]
    assert [{int(v) for row in b["partial"]["rollouts"]["versions"] for v in row} for b in in_flight] == [{0, 1}, {1}]

    other_mode = partial_command(small_model_path, tmp_path, f"train.overlap={str(not stopped_overlap).lower()}")
    resumed = subprocess.run(other_mode, capture_output=True, text=True, timeout=600, env=subprocess_env(),
                             stdin=subprocess.DEVNULL)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert comparable(read_steps(tmp_path)) == comparable(partial_delay_line_rows)


def train_options(**values):
    options = OmegaConf.load(CONF_DIR / "train.yaml").train
    options.update(values)
    return options


def test_what_cannot_overlap_is_refused_in_one_line():
    """At staleness 0 every update waits for rollouts of its own weights (nothing to overlap); the decomposition
    needs the trainer at a batch's sampling weights, which the overlapped trainer has left when it arrives."""
    with pytest.raises(ValueError, match=r"^train.overlap=true needs train.staleness >= 1, got 0 \(at 0 each update "
                                         r"waits for rollouts of its own weights: nothing to sample while it trains\)$"):
        check_options(train_options(overlap=True))
    with pytest.raises(ValueError, match=r"^train.overlap=true with train.decompose_staleness=true: .*\(run the "
                                         r"split with train.overlap=false: the same records\)$"):
        check_options(train_options(overlap=True, staleness=2, decompose_staleness=True))
    with pytest.raises(ValueError, match=r"^train.overlap=true with train.decompose_staleness=true: "):
        check_options(train_options(overlap=True, staleness=2, partial_rollouts=True, decompose_staleness=True))
    check_options(train_options(overlap=True, staleness=1))
    check_options(train_options(overlap=True, staleness=2, partial_rollouts=True))  # the sampler process runs them
    check_options(train_options(decompose_staleness=True))
