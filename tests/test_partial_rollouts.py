"""`train.partial_rollouts` (rlmm/run/partial_rollouts.py): the batches in flight are sampled a chunk per weight sync,
each token labelled with the version that sampled it. In-process runs use the tests' small model with transformers
sampling and the torch trainer in fp32 (tests/test_staleness.py's components); the resume goes through `rlmm train`
with the real vLLM sampler."""
import subprocess

import pytest
import torch

from rlmm.mismatch.metrics import staleness_decomposition
from rlmm.policy.rollouts import KeptTokens
from rlmm.run.records import read_steps
from rlmm.run.rollout_source import DelayLine
from rlmm.run.step import rl_update, token_staleness_metrics
from tests.conftest import subprocess_env
from tests.test_reliability import comparable, train_command
from tests.test_staleness import (PROMPTS_PER_STEP, closing, components, fingerprint, prompts_of,
                                  stopped_after_step_two, without_timings)
from tests.test_train import ParityTask

MAX_NEW_TOKENS = 6  # tests/test_staleness.py's components sample at most 6 tokens


def run(c, task, steps, staleness, chunk, decompose=False):
    """`steps` updates through the delay line with partial rollouts of `chunk` tokens (None: whole responses)."""
    pool = task.examples("train", steps * PROMPTS_PER_STEP)
    line = DelayLine(c, prompts_of(pool), staleness, decompose, last_step=steps, chunk=chunk)
    taken = []

    def steps_taken():
        metrics = []
        for step in range(1, steps + 1):
            batch = line.take(step)
            taken.append(batch)
            metrics.append(rl_update(c, batch, 2.0, True))
        return metrics

    return closing(c, steps_taken), taken


def spans(versions: torch.Tensor) -> list[tuple[int, int, int]]:
    """(start, end, version) of each run of equal versions in a row."""
    out, start = [], 0
    for t in range(1, len(versions) + 1):
        if t == len(versions) or versions[t] != versions[start]:
            out.append((start, t, int(versions[start])))
            start = t
    return out


def test_each_token_is_labelled_with_the_weights_that_sampled_it(small_model_path, arithmetic_task):
    """k = 2, chunks of 1 token: batch j starts at step s0 = max(1, j - 2) and token t of a response is sampled under
    v_{min(s0 - 1 + t, j - 1)}. Every generate call is fingerprinted by the sampler's weights and every update by the
    trainer's: each span of a response's versions is exactly the tokens one call returned for that row's prefix, under
    the weights of that version. With the decomposition the trainer scored each chunk at those weights: the numerical
    part is rounding, token by token."""
    steps, staleness = 5, 2
    c = components(small_model_path, ParityTask(arithmetic_task))
    produced, trained = {}, []  # (prefix, tokens) -> the sampler weights that returned them; v_{u-1} per update u
    generate, begin_update = c.sampler.generate, c.trainer.begin_update

    def generate_seen(prompt_ids, **kwargs):
        rollouts = generate(prompt_ids, **kwargs)
        if not kwargs.get("greedy"):
            for prefix, tokens in zip(rollouts.prompt_ids, rollouts.response_ids):
                produced.setdefault((tuple(prefix), tuple(tokens)), set()).add(fingerprint(c.sampler.model))
        return rollouts

    def begin_update_seen(rollouts, rows):
        trained.append(fingerprint(c.trainer.model))
        return begin_update(rollouts, rows)

    c.sampler.generate, c.trainer.begin_update = generate_seen, begin_update_seen
    metrics, batches = run(c, ParityTask(arithmetic_task), steps, staleness, chunk=1, decompose=True)
    assert len(set(trained)) == steps  # every update moved the weights
    mixed = 0
    for j, batch in enumerate(batches, start=1):
        start = max(1, j - staleness)
        r = batch.rollouts
        for row, versions in enumerate(r.versions):
            expected = [min(start - 1 + t, j - 1) for t in range(len(versions))]
            assert versions.tolist() == expected, (j, row)
            for begin, end, version in spans(versions):
                prefix = tuple(r.prompt_ids[row]) + tuple(r.response_ids[row][:begin])
                assert trained[version] in produced[(prefix, tuple(r.response_ids[row][begin:end]))], (j, row, begin)
            mixed += len(spans(versions)) > 1
        # what the update saw: each token's updates behind v_{j-1}
        behind = batch.token_staleness
        assert [behind[row, :len(v)].tolist() for row, v in enumerate(r.versions)] == \
               [(j - 1 - v).tolist() for v in r.versions]
        m = metrics[j - 1]
        assert m["rollout/staleness"] == min(j - 1, staleness)
        assert m["rollout/token_staleness_max"] <= min(j - 1, staleness)
        assert m["mismatch/numerical/logprob_abs_diff_max"] < 1e-5, j  # fp32 at the same weights, per token
        if j > 1:
            assert m["mismatch/policy_lag/logprob_abs_diff_max"] > 1e-3, j
    assert mixed > 0  # some responses straddle a sync
    assert metrics[-1]["rollout/frac_responses_mixed"] > 0


def test_a_chunk_of_the_whole_answer_is_whole_response_staleness(small_model_path, arithmetic_task):
    """rollout_chunk = max_new_tokens: each batch is sampled whole when it starts, by the same call with the same
    seeds as whole-response staleness, so the run is that run: the same metrics, the same weights."""
    results = {}
    for chunk in (None, MAX_NEW_TOKENS):
        c = components(small_model_path, ParityTask(arithmetic_task))
        metrics, _ = run(c, ParityTask(arithmetic_task), 4, staleness=2, chunk=chunk)
        results[chunk] = (metrics, c.final_weights)
    (whole, whole_weights), (partial, partial_weights) = results[None], results[MAX_NEW_TOKENS]
    assert [without_timings(m) for m in partial] == [without_timings(m) for m in whole]
    assert all(torch.equal(partial_weights[k], v) for k, v in whole_weights.items())
    assert [m["rollout/token_staleness_mean"] for m in whole] == [0, 1, 2, 2]
    assert {m["rollout/frac_responses_mixed"] for m in whole} == {0.0}


def test_the_decomposition_of_a_two_version_response_by_hand():
    """Tokens 0-1 sampled by v0, 2-3 by v1; the trainer scored each chunk at its own version (pi_stale) and scores
    all four now at v2. numerical = mu against pi_stale token by token, policy lag = pi_stale against pi_now: each
    token against the trainer at its own version."""
    trainer_v0 = torch.tensor([-1.0, -0.5])
    trainer_v1 = torch.tensor([-2.0, -0.25])
    stale = torch.cat([trainer_v0, trainer_v1])[None].double()
    sampler = stale + torch.tensor([[0.01, -0.02, 0.03, -0.04]], dtype=torch.float64)
    now = torch.tensor([[-1.1, -0.4, -2.3, -0.25]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    parts = staleness_decomposition(now, stale, sampler, mask)
    assert parts["numerical/logprob_abs_diff_mean"] == pytest.approx((0.01 + 0.02 + 0.03 + 0.04) / 4, rel=1e-12)
    assert parts["policy_lag/logprob_abs_diff_mean"] == pytest.approx((0.1 + 0.1 + 0.3 + 0.0) / 4, rel=1e-12)
    assert parts["numerical/kl_k1"] + parts["policy_lag/kl_k1"] == pytest.approx(
        float((sampler - now).mean()), rel=1e-12)  # k1 = E[log mu - log pi]: the parts add up


def test_token_staleness_metrics_by_hand():
    """Row 0: versions 2, 2, 1, 0 behind (3 spans); row 1: 1, 1 (1 span); row 2 empty (not counted)."""
    behind = torch.tensor([[2, 2, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    assert token_staleness_metrics(behind, mask) == {"token_staleness_mean": 7 / 6, "token_staleness_max": 2.0,
                                                     "frac_responses_mixed": 0.5, "version_spans_mean": 2.0}


def test_kept_sets_join_across_chunks():
    first = KeptTokens.of_sets([[1, 2], [3]], [False, True])
    second = KeptTokens.of_sets([[4, 5, 6]], [False])
    joined = KeptTokens.joined([first, second])
    whole = KeptTokens.of_sets([[1, 2], [3], [4, 5, 6]], [False, True, False])
    assert all(torch.equal(getattr(joined, k), getattr(whole, k)) for k in ("ids", "offsets", "capped"))


# slow: three processes (20 s with hf, 2 min with vLLM); the default suite resumes a partial run killed mid-chunk in
# tests/test_crash_consistency.py (its `partial` variant's default point)
@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["hf", "vllm"])
def test_partial_rollouts_stopped_by_sigterm_resume_to_the_uninterrupted_numbers(small_model_path, tmp_path, sampler):
    """k = 2, chunks of 2 tokens, with the decomposition; SIGTERM after step 2: the checkpoint holds batches 3 and 4
    part-sampled (3 by v0 and v1, 4 by v1), and the resumed run logs every number the uninterrupted one logs."""
    common = (f"sampler={sampler}", "trainer=torch", "logger=none", "train.checkpoint_every=0", "train.steps=5", "train.staleness=2",
              "train.partial_rollouts=true", "train.rollout_chunk=2", "train.decompose_staleness=true")
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    result = subprocess.run(train_command(small_model_path, straight, *common), capture_output=True, text=True,
                            timeout=600, env=subprocess_env(), stdin=subprocess.DEVNULL)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    command = train_command(small_model_path, interrupted, *common)
    _, in_flight = stopped_after_step_two(command, interrupted)
    assert [(b["index"], b["version"]) for b in in_flight] == [(3, 0), (4, 1)]
    held = [{int(v) for row in b["partial"]["rollouts"]["versions"] for v in row} for b in in_flight]
    assert held == [{0, 1}, {1}]  # batch 3: a chunk under v0, the open rows one more under v1

    resumed = subprocess.run(command, capture_output=True, text=True, timeout=600, env=subprocess_env(),
                             stdin=subprocess.DEVNULL)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    rows = read_steps(interrupted)
    assert [row["step"] for row in rows] == list(range(6))
    assert comparable(rows) == comparable(read_steps(straight))
    assert max(row["rollout/frac_responses_mixed"] for row in rows[1:]) > 0
