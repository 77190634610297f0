"""Where the train loop gets each update's rollouts (`train.staleness`): a delay line of rollout batches, in
one process, deterministic.

Update u takes the trainer's weights v_{u-1} to v_u. With staleness k it trains on rollouts sampled with
v_{u-1-k}, or with the initial weights v_0 where u-1-k < 0: updates 1 .. k+1 train on rollouts of v_0, every
later update on rollouts k updates old (`rollout/staleness` = min(u-1, k)). k = 0 is the synchronous step, the
rollouts sampled with the weights they update: the same calls in the same order as before staleness existed,
so the same run to the bit.

How: by sampling ahead, as asynchronous systems do (the sampler never goes back to old weights). Batch j holds
the rollouts of step j's prompts (the task's prompt stream, `train.prompts_per_step` a step; DAPO's refills are
those of (seed, j, round)). At step u the delay line first samples, with the sampler's current weights v_{u-1},
every batch up to u + k not yet sampled (at step 1 batches 1 .. k+1, all with v_0; at each later step batch
u + k; none past the last step), then hands the update batch u, which it sampled at step max(1, u-k). Batches
are sampled in the order j = 1, 2, ..., so the sampler's request counter, and with it every seed, is that of
batch j at staleness 0: with weights that stand still, update u trains on the staleness-0 run's rollouts.

In flight between steps: the k sampled batches not yet trained on (this rank's share of each, with their
rewards, sampling metrics and, for the decomposition, stale log-probs). They are part of the checkpoint
(`state_dict`, in every rank's rankN.pt), so a resumed run trains on what the uninterrupted one would.

`train.decompose_staleness`: the trainer scores each batch right after it is sampled, when it holds exactly the
weights that sampled it (the sampler was synced to them at the end of the previous step, or both start from
the checkpoint), and the batch keeps those log-probs until its update splits its mismatch into a numerical and
a policy-lag part (rlmm/mismatch/metrics.py::staleness_decomposition). So no weight version is kept: the cost is one
no-grad scoring pass over each batch (`perf/stale_trainer_logprobs_seconds`) and, in memory, the log-probs of
the k+1 batches in flight at most ([rows, T] float32 each: 16 x 8 rows x 8 tokens x 4 bytes = 4 KiB at the
default), where scoring at training time would hold k copies of the weights (parameters x 4 bytes each in fp32:
12 MB for the built-in 3M-parameter model, 2 GB for a 0.5B one, per version and, unsharded, per rank).

`Overlapped` (`train.overlap`), issue 26's second way, has the same three calls: a sampler process of the rank's
own samples the same batches at the same points with the same weights while the trainer trains, and hands them
over as they arrive (rlmm/run/sampler_process.py), so the records are the delay line's. It cannot score at sampling
time (its trainer is past those weights by then), and keeping the weight versions to score later is not done:
with it the decomposition is refused (the delay line measures it for the same records). With partial rollouts the
process runs a `DelayLine` of its own over its engine, which holds the partial batches, and hands batch u over
between `sample_due` and `sample_ahead`: the delay line's generate calls, in its order, with its weights.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Protocol

import torch

from rlmm.policy.rollouts import pad_right
from rlmm.run.components import Components
from rlmm.run.partial_rollouts import PartialBatch, rollouts_from_state, rollouts_state
from rlmm.run.step import SampledBatch, rank_and_world, rank_share, rollout_rewards
from rlmm.runtime.timing import timed

__all__ = ["DelayLine", "Overlapped", "RolloutSource"]

# A batch's prompts: step j's own, and its refill(round) for an algorithm that drops groups (DAPO), or None.
PromptsOf = Callable[[int], tuple[list, Callable[[int], list] | None]]


class RolloutSource(Protocol):
    """What the train loop asks for each update's rollouts."""

    def take(self, step: int) -> SampledBatch:
        """The rollouts update `step` trains on (this rank's share), their staleness, and what sampling cost in
        this step (`SampledBatch.seconds`: the sampling of later batches done now included)."""
        ...

    def state_dict(self) -> dict:
        """This rank's rollouts in flight and its place in the prompt stream, for the checkpoint ({}: none)."""
        ...

    def load_state_dict(self, state: dict | None, first_step: int) -> None:
        """Continue from a checkpoint's `state_dict()` (None: the checkpoint holds none) at step `first_step`."""
        ...


@dataclass
class InFlight:
    """A sampled batch waiting for its update."""

    index: int  # the step whose prompts it holds, which is the update that trains on it
    version: int  # the updates in the weights that sampled it (v_version); partial: its first chunk
    batch: SampledBatch | None  # None: asked of the sampler process, not yet arrived (`Overlapped`), or partial
    partial: PartialBatch | None = None  # `train.partial_rollouts`: its responses so far (None: sampled whole)


class DelayLine:
    """`train.staleness` k: update u trains on the rollouts of step u's prompts, sampled with the weights of
    update max(0, u-1-k) (module docstring). `prompts_of(j)`: batch j's prompts and refill; `last_step`: the
    run's last step (nothing is sampled for later ones)."""

    def __init__(self, c: Components, prompts_of: PromptsOf, staleness: int, decompose: bool, last_step: int,
                 chunk: int | None = None):
        if staleness < 0:
            raise ValueError(f"train.staleness: must be >= 0, got {staleness}")
        self.c, self.prompts_of, self.staleness, self.decompose = c, prompts_of, staleness, decompose
        self.last_step, self.chunk = last_step, chunk  # chunk: `train.rollout_chunk` with partial rollouts
        self.tracked = staleness > 0 or decompose  # rollout/staleness is logged (not at plain staleness 0)
        self.in_flight: deque[InFlight] = deque()
        self.next_batch = 1  # the first batch not yet sampled

    def take(self, step: int) -> SampledBatch:
        seconds: dict[str, float] = {}
        if self.chunk:  # partial rollouts: what is in flight advances a chunk under v_{step-1}, batch `step` to its end
            self.sample_due(step, seconds)
            self.sample_ahead(step, seconds)
            if self.decompose:  # after all of this step's generate calls: vLLM's sleep level 2 drops their weights
                self.c.sampler.sleep()
                with timed(seconds, "stale_trainer_logprobs"):  # each batch's tokens sampled this step, at v_{step-1}
                    for waiting in self.in_flight:
                        waiting.partial.score_new_tokens(self.c)
            due = self.pop_due(step)
            batch = finished(self.c, due.partial, self.prompts_share(step), seconds)
            return with_versions(replace(batch, seconds=seconds), step, due.version, tracked=True)
        fresh = []
        while self.next_batch <= min(step + self.staleness, self.last_step):
            batch = SampledBatch.now(self.c, *self.prompts_of(self.next_batch))
            for stage, spent in batch.seconds.items():
                seconds[stage] = seconds.get(stage, 0.0) + spent
            fresh.append(InFlight(self.next_batch, step - 1, batch))
            self.next_batch += 1
        self.in_flight.extend(fresh)
        if self.decompose and fresh:
            # After all of this step's generate calls: vLLM's sleep level 2 would drop the weights they need.
            self.c.sampler.sleep()
            with timed(seconds, "stale_trainer_logprobs"):  # the trainer holds v_{step-1}: the sampling weights
                for waiting in fresh:
                    # routed as the update will score it (r3: the sampler's experts replayed)
                    waiting.batch.stale_logprobs = self.c.trainer.logprobs(self.c.routing.scored(waiting.batch.rollouts))
        due = self.pop_due(step)
        return with_versions(replace(due.batch, seconds=seconds), step, due.version, self.tracked)

    def sample_due(self, step: int, seconds: dict[str, float]) -> None:
        """Partial rollouts, step `step`'s first generate calls (the sampler holds v_{step-1}): batch `step` to its
        end (the oldest in flight), or at step 1 sampled whole. `pop_due` may hand it over before `sample_ahead`
        (`train.overlap`'s sampler process does: the generate calls are the same, in the same order)."""
        if self.in_flight and self.in_flight[0].index == step:
            self.in_flight[0].partial.advance(self.c, step - 1, None, seconds)
        elif not self.in_flight and self.next_batch == step:
            self.start(step, None, seconds)

    def sample_ahead(self, step: int, seconds: dict[str, float]) -> None:
        """Partial rollouts, the rest of step `step`'s generate calls, after `sample_due`'s: every later batch in
        flight a chunk more, in index order, then every batch up to step + k not yet started, its first chunk."""
        for waiting in self.in_flight:
            if waiting.index != step:
                waiting.partial.advance(self.c, step - 1, self.chunk, seconds)
        for index in range(self.next_batch, min(step + self.staleness, self.last_step) + 1):
            self.start(step, None if index == step else self.chunk, seconds)

    def start(self, step: int, tokens: int | None, seconds: dict[str, float]) -> None:
        """Partial rollouts: start the next batch (`next_batch`) at step `step` with its first `tokens` (None:
        whole)."""
        prompts = self.prompts_of(self.next_batch)[0]
        self.in_flight.append(InFlight(self.next_batch, step - 1, None, PartialBatch.start(
            self.c, rank_share(prompts, *rank_and_world()), rank_share(list(range(len(prompts))), *rank_and_world()),
            step - 1, tokens, self.decompose, seconds)))
        self.next_batch += 1

    def pop_due(self, step: int) -> InFlight:
        """Batch `step`, taken out of the line."""
        if not self.in_flight or self.in_flight[0].index != step:
            held = [waiting.index for waiting in self.in_flight]
            raise RuntimeError(f"train.staleness={self.staleness}: step {step} has no rollouts in flight (holding "
                               f"the batches of steps {held})")
        return self.in_flight.popleft()

    def prompts_share(self, step: int) -> list:
        """This rank's share of step `step`'s prompts (the rewards of a partial batch are of these)."""
        return rank_share(self.prompts_of(step)[0], *rank_and_world())

    def state_dict(self) -> dict:
        if not self.tracked:
            return {}  # staleness 0: nothing is ever in flight between steps
        return {"staleness": self.staleness, "next_batch": self.next_batch,
                "in_flight": [in_flight_state(waiting) for waiting in self.in_flight]}

    def load_state_dict(self, state: dict | None, first_step: int) -> None:
        self.in_flight, self.next_batch = loaded_in_flight(state, first_step, self.staleness, self.decompose,
                                                           partial=bool(self.chunk))


class Overlapped:
    """`train.overlap`: the delay line's batches, sampled by this rank's sampler process
    (rlmm/run/sampler_process.py) while the trainer trains. `take(u)` asks for the same batches at the same points
    as `DelayLine.take` (every batch up to u + k not yet asked for), but waits only for batch u: batch u + k is
    sampled while update u trains. The process answers requests in order, so each batch is sampled with the
    weights sent before it was asked for, v_{max(0, j-1-k)} for batch j, with the delay line's seeds: the same
    records (tests/test_overlap.py). k >= 1 (at 0 the update waits for its own batch: nothing overlaps) and no
    decomposition (the trainer has trained past a batch's weights by the time it arrives): rlmm/run/train.py's
    `check_options` refuses both. The checkpoint's state is the delay line's (so either mode can resume the
    other's run).

    Partial rollouts (`chunk`): the process runs the delay line's partial schedule itself (a `DelayLine` over its
    engine, holding the partial batches). `take(u)` asks once for step u's sampling, after the weights of v_{u-1}
    were sent: the process finishes batch u (`DelayLine.sample_due`), hands it over, then advances the later batches
    a chunk and starts the new ones (`sample_ahead`) while update u trains: the delay line's generate calls, in its
    order, with its weights. The checkpoint's batches in flight are the process's, sent back on `state_dict` and
    to it on `load_state_dict`."""

    def __init__(self, sampler, staleness: int, last_step: int, chunk: int | None = None):
        if staleness < 1:
            raise ValueError(f"train.overlap: needs train.staleness >= 1, got {staleness}")
        self.sampler, self.staleness, self.last_step, self.chunk = sampler, staleness, last_step, chunk
        # asked for; `batch` is None until it has arrived (partial rollouts: always, the process holds them)
        self.in_flight: deque[InFlight] = deque()
        self.next_batch = 1  # the first batch not yet asked for

    def take(self, step: int) -> SampledBatch:
        seconds: dict[str, float] = {}
        with timed(seconds, "rollout_wait"):  # what the trainer waited; the sampling itself ran beside it
            if self.chunk:
                self.sampler.request_partial_step(step)
            while self.next_batch <= min(step + self.staleness, self.last_step):
                if not self.chunk:
                    self.sampler.request_batch(self.next_batch)
                self.in_flight.append(InFlight(self.next_batch, step - 1, None))
                self.next_batch += 1
            if not self.in_flight or self.in_flight[0].index != step:
                held = [waiting.index for waiting in self.in_flight]
                raise RuntimeError(f"train.staleness={self.staleness}: step {step} has no rollouts in flight "
                                   f"(holding the batches of steps {held})")
            due = self.in_flight.popleft()
            batch = due.batch or self.sampler.receive_batch(due.index)
        return with_versions(replace(batch, seconds=seconds), step, due.version, tracked=True)

    def state_dict(self) -> dict:
        """The delay line's state: every batch asked for is waited for first (partial rollouts: the process's
        partial batches, once it has done every request sent before)."""
        if self.chunk:
            state = self.sampler.in_flight_state()
            held = [(waiting.index, waiting.version) for waiting in self.in_flight]
            sent = [(batch["index"], batch["version"]) for batch in state["in_flight"]]
            if (sent, state["next_batch"]) != (held, self.next_batch):
                raise RuntimeError(f"train.overlap: the sampler process holds the batches (index, version) {sent}, "
                                   f"next {state['next_batch']}; the trainer asked for {held}, next {self.next_batch}")
            return state
        for waiting in self.in_flight:
            waiting.batch = waiting.batch or self.sampler.receive_batch(waiting.index)
        return {"staleness": self.staleness, "next_batch": self.next_batch,
                "in_flight": [in_flight_state(waiting) for waiting in self.in_flight]}

    def load_state_dict(self, state: dict | None, first_step: int) -> None:
        self.in_flight, self.next_batch = loaded_in_flight(state, first_step, self.staleness, decompose=False,
                                                           partial=bool(self.chunk))
        if self.chunk:  # the process continues them; the trainer keeps their places
            self.sampler.load_in_flight(state, first_step)
            self.in_flight = deque(InFlight(waiting.index, waiting.version, None) for waiting in self.in_flight)


def loaded_in_flight(state: dict | None, first_step: int, staleness: int, decompose: bool,
                     partial: bool = False) -> tuple[deque[InFlight], int]:
    """A checkpoint's batches in flight and next batch, checked against the run's staleness, decomposition and
    partial rollouts."""
    state = state or {}
    saved = state.get("staleness", 0)
    if saved != staleness:
        raise ValueError(f"train.resume: the checkpoint was written with train.staleness={saved}, this run has "
                         f"{staleness} (resume with the run's own, or another hydra.run.dir)")
    in_flight = [from_in_flight_state(s) for s in state.get("in_flight", [])]
    if any((waiting.partial is not None) != partial for waiting in in_flight):
        raise ValueError(f"train.resume: the checkpoint's rollouts in flight were sampled with "
                         f"train.partial_rollouts={str(not partial).lower()}, this run has {str(partial).lower()} "
                         f"(resume with the run's own, or another hydra.run.dir)")
    if decompose and any((waiting.partial or waiting.batch).stale_logprobs is None for waiting in in_flight):
        raise ValueError("train.resume: the checkpoint's rollouts in flight were not scored at the weights that "
                         "sampled them (written with train.decompose_staleness=false): resume with it false, or "
                         "another hydra.run.dir")
    for waiting in in_flight:  # without the decomposition, log-probs scored for one are not used
        held = waiting.partial or waiting.batch
        held.stale_logprobs = held.stale_logprobs if decompose else None
    return deque(in_flight), state.get("next_batch", first_step)


def in_flight_state(waiting: InFlight) -> dict:
    """A batch in flight as tensors, ints, floats, strings, lists and dicts (what `torch.load(weights_only=True)`
    reads back): every field of its `Rollouts` (kept sets as dicts of their tensors), its rewards, sampling metrics
    and stale log-probs; a partial one's responses so far (`PartialBatch.state`)."""
    if waiting.partial is not None:
        return {"index": waiting.index, "version": waiting.version, "partial": waiting.partial.state()}
    batch = waiting.batch
    return {"index": waiting.index, "version": waiting.version, "rollouts": rollouts_state(batch.rollouts),
            "task_rewards": batch.task_rewards, "sampling_metrics": dict(batch.sampling_metrics),
            "stale_logprobs": batch.stale_logprobs}


def from_in_flight_state(state: dict) -> InFlight:
    if "partial" in state:
        return InFlight(state["index"], state["version"], None, PartialBatch.from_state(state["partial"]))
    batch = SampledBatch(rollouts_from_state(state["rollouts"]), state["task_rewards"],
                         dict(state["sampling_metrics"]), {}, stale_logprobs=state["stale_logprobs"])
    return InFlight(state["index"], state["version"], batch)


def finished(c: Components, partial: PartialBatch, prompts: list, seconds: dict[str, float]) -> SampledBatch:
    """A partial batch, complete, as the update takes it: its rewards (of this rank's `prompts`) and the trainer's
    log-probs at each token's version where they were kept."""
    if not partial.done:
        raise RuntimeError("train.partial_rollouts: a batch is due with responses still open")
    with timed(seconds, "reward"):
        rewards = rollout_rewards(c, prompts, partial.rollouts)
    return SampledBatch(partial.rollouts, rewards, {"sampled_reward_mean": rewards.mean().item()}, {},
                        stale_logprobs=partial.padded_stale_logprobs())


def with_versions(batch: SampledBatch, step: int, version: int, tracked: bool) -> SampledBatch:
    """The batch update `step` takes, with its staleness where it is tracked: the updates between the weights that
    sampled it (its first tokens, version `version`) and v_{step-1}, and each token's (`token_staleness`, from its
    `Rollouts.versions`, which a batch sampled whole gets here: every token `version`)."""
    if not tracked:
        return replace(batch, staleness=None)
    rollouts = batch.rollouts
    if rollouts.versions is None:
        rollouts.versions = [torch.full((len(r),), version, dtype=torch.int64) for r in rollouts.response_ids]
    behind, _ = pad_right([step - 1 - v for v in rollouts.versions])
    return replace(batch, staleness=step - 1 - version, token_staleness=behind.long())


def prompt_stream(examples: list, seed: int, count: int):
    """Batch j's prompts (step j's `count` of the run's training `examples`) and its refill (`refill_prompts`):
    a function of j alone, dealt alike in the train loop and in a sampler process (`train.overlap`)."""
    return lambda j: (examples[(j - 1) * count: j * count], partial(refill_prompts, examples, seed, j, count=count))


def refill_prompts(pool: list, seed: int, step: int, sampling_round: int, count: int) -> list:
    """`count` prompts drawn from the run's training prompts for a step's refill round (an algorithm that
    drops groups): a function of (seed, step, round) alone, so two arms of one seed that both refill
    draw the same prompts, and a resumed run draws what the uninterrupted one did."""
    import random

    return random.Random(f"{seed}/{step}/{sampling_round}").sample(pool, count)
