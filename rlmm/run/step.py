"""One RL step, top to bottom (`rl_step`: `SampledBatch.now`, then `rl_update`), over the interfaces of
rlmm/run/interfaces.py:

    sample -> reward -> score (π_old by the trainer) -> mismatch -> correct (and its step size) -> advantages
    -> for epoch, minibatch: for micro-batch: forward, loss, backward; step (at the corrected rate)
    -> weight sync trainer -> sampler -> metrics

Each stage hands the next a typed value (`SampledBatch`, then `OldPolicy`), not a dict filled by callbacks,
and the step never asks which engine, backend, correction or algorithm it holds. With `train.staleness` k >= 1
the train loop's delay line (rlmm/run/rollout_source.py) samples and hands `rl_update` a batch sampled k updates
earlier instead.

The one-pass step: with one epoch over one minibatch (`train.reuse_training_forward`, the default) the
policy being updated is the one that scores the rollouts, so the update's own forwards give π_old's
log-probs when every micro-batch's graph fits in memory (`update.holds_graphs`): one forward per token
instead of two. Otherwise π_old comes from a no-grad scoring pass first.

Departures from the papers, on purpose: the old-policy log-probs come from the correction (the trainer's
recomputation for most methods, the sampler's for `bypass`), and with one epoch of one minibatch the
policy that is updated is the one that scored the rollouts, so PPO's ratio starts at 1 and only the
correction's weights carry the mismatch.

Several ranks: each samples, scores and trains on its own share of the step's prompts (whole groups, so
advantages need no communication; `rank_share`), each prompt's requests seeded by its place in the whole
step, so the split changes no draw; the trainer averages gradients; a fault on any rank skips the step on
every rank; the loss normaliser is agreed over ranks (`loss_normalizer_over_ranks`).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlmm.corrections.base import BatchView, CorrectionOutput, MicroBatchView, drop_split
from rlmm.mismatch.loss_stats import PolicyLossStats, combined_metrics
from rlmm.mismatch.metrics import mismatch_metrics, staleness_decomposition
from rlmm.policy.precision import nonfinite_cause
from rlmm.policy.rollouts import Rollouts
from rlmm.policy.support import recorded as support_recorded
from rlmm.policy.support import support_metrics
from rlmm.run.components import Components
from rlmm.runtime.collectives import (all_reduce_min, any_rank, divisor_over_ranks, gathered_over_ranks, own_rows,
                               rows_of_every_rank)
from rlmm.runtime.timing import timed
from rlmm.trainers.scoring import padded_rows
from rlmm.trainers.weight_sync import send_weights

log = logging.getLogger(__name__)

# What an update reports of fp16's dynamic loss scaler (rlmm/trainers/loss_scale.py), logged under train/: the
# scale its backward used and the fraction of the step's optimizer steps it skipped as normal overflows.
LOSS_SCALER_KEYS = ("loss_scale", "loss_scale_skipped")


@dataclass
class OldPolicy:
    """π_old as the trainer scores the step's rollouts, checked and corrected: what every update of the
    step trains against. Tensors are [B, T] (this rank's rows), right-padded like
    `rollouts.padded_sampler_logprobs()`."""

    logprobs: torch.Tensor  # log π_old in PPO's ratio (the correction's choice of side)
    weights: torch.Tensor  # the correction's detached per-token weights
    mask: torch.Tensor  # the tokens that count (the response mask minus what the correction rejected)
    trainer_logprobs: torch.Tensor  # the trainer's recomputation, and the sampler's: what the correction sees in
    sampler_logprobs: torch.Tensor  # each micro-batch of the update (`in_update`), with the advantages
    advantages: torch.Tensor
    mismatch: dict[str, float]  # sampler vs trainer (rlmm/mismatch/metrics.py), logged under mismatch/
    correction_metrics: dict[str, float]  # logged under correction/
    lr_scale: float  # the correction's factor on this step's learning rate (`step_size`), the same on every rank
    nonfinite: dict[str, float]  # fraction of each side's response log-probs that are NaN/Inf
    fault: str | None  # why the step must be skipped (NaN/Inf rewards or log-probs on any rank), or None

    @classmethod
    def score(cls, trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor,
              advantages: torch.Tensor, rewards: torch.Tensor, correction, ratio_cap: float,
              also_checked: dict[str, torch.Tensor]) -> OldPolicy:
        """`also_checked`: more tensors the NaN/Inf check covers, after these (the critic's values)."""
        checked = {"rewards": rewards, "trainer_logprobs": trainer_logprobs[mask],
                   "sampler_logprobs": sampler_logprobs[mask]}
        fault = fault_on_any_rank(first_fault(**checked, **also_checked))
        # The correction's batch stage and the metrics see the step's whole batch, every rank's rows (the same on
        # every rank): a mean over ranks of each rank's maximum or token mean would not be the batch's, nor would a
        # rank's own self-normalisation or second-moment cut (rlmm/runtime/collectives.py::rows_of_every_rank). Each rank
        # trains on its own rows of the result.
        every = rows_of_every_rank(trainer_logprobs, sampler_logprobs, mask, advantages)
        batch = BatchView(*every)
        corrected: CorrectionOutput = correction.before_update(batch)
        # Its factor on this step's learning rate, from the same batch; the ranks step with their smallest (one).
        size = correction.step_size(batch)
        lr_scale = all_reduce_min(torch.tensor([size.scale], dtype=torch.float64)).item()
        mine = own_rows(*mask.shape)
        nonfinite = {side: 1 - torch.isfinite(lp[every[2]]).float().mean().item()
                     for side, lp in (("trainer", every[0]), ("sampler", every[1]))}
        mismatch = mismatch_metrics(*every[:3], ratio_cap=ratio_cap)
        return cls(logprobs=mine(corrected.old_logprobs), weights=mine(corrected.weights), mask=mine(corrected.mask),
                   trainer_logprobs=trainer_logprobs, sampler_logprobs=sampler_logprobs, advantages=advantages,
                   mismatch=mismatch, correction_metrics=corrected.metrics | size.metrics, lr_scale=lr_scale,
                   nonfinite=nonfinite, fault=fault)

    def micro_batch(self, rows: list[int], logprobs: torch.Tensor) -> MicroBatchView:
        """What the correction sees of one micro-batch inside the update: its rows cut to the width of the
        forward's `logprobs` (log π_θ, detached here)."""
        width = logprobs.size(1)
        return MicroBatchView(logprobs=logprobs.detach(), old_logprobs=self.logprobs[rows, :width],
                              trainer_logprobs=self.trainer_logprobs[rows, :width],
                              sampler_logprobs=self.sampler_logprobs[rows, :width],
                              advantages=self.advantages[rows, :width], mask=self.mask[rows, :width],
                              weights=self.weights[rows, :width])


@dataclass
class SampledBatch:
    """The rollouts one update trains on, as they were sampled (the sample stage's value): `now` samples them
    with the sampler's current weights (staleness 0); with `train.staleness` k the train loop's delay line
    (rlmm/run/rollout_source.py) hands in a batch it sampled k updates earlier."""

    rollouts: Rollouts
    task_rewards: torch.Tensor  # [B] the task's rewards, grouped (`sample_groups`)
    sampling_metrics: dict[str, float]  # `sample_groups`' (sampled_reward_mean; DAPO's refill counts)
    seconds: dict[str, float]  # what sampling cost in the step that trains on it (generate, reward, ...)
    staleness: int | None = None  # updates between the weights that sampled it and those it updates (None: untracked)
    stale_logprobs: torch.Tensor | None = None  # [B, T] the trainer's log-probs at the weights that sampled them

    @classmethod
    def now(cls, c: Components, prompts: list, refill: Callable[[int], list] | None) -> SampledBatch:
        """The rollouts of `prompts` (and refills) sampled now with the sampler's weights, and what that cost."""
        seconds = {}
        return cls(*sample_groups(c, prompts, refill, seconds), seconds)

    def staleness_metrics(self, trainer_logprobs: torch.Tensor, mask: torch.Tensor,
                          ratio_cap: float) -> dict[str, float]:
        """rollout/staleness where it is tracked, and with `stale_logprobs` the mismatch split into its
        numerical and policy-lag parts (mismatch/numerical/, mismatch/policy_lag/: rlmm/mismatch/metrics.py::
        staleness_decomposition); {} for a batch sampled now without the split."""
        metrics = {} if self.staleness is None else {"rollout/staleness": float(self.staleness)}
        if self.stale_logprobs is not None:
            sampler_logprobs, _ = self.rollouts.padded_sampler_logprobs()
            parts = staleness_decomposition(*rows_of_every_rank(trainer_logprobs, self.stale_logprobs,
                                                                sampler_logprobs, mask), ratio_cap=ratio_cap)
            metrics.update({f"mismatch/{k}": v for k, v in parts.items()})
        return metrics


def rl_step(c: Components, prompts: list, ratio_cap: float, reuse_training_forward: bool,
            refill: Callable[[int], list] | None = None) -> dict[str, float]:
    """One RL step on the step's `prompts` (every rank's: this rank takes its `rank_share`), sampled now with the
    sampler's weights; returns this rank's metrics (`rl_update`). `refill(round)`: more prompts, as many as
    `prompts`, for an algorithm that drops groups (DAPO's dynamic sampling); round 1, 2, ... up to
    `algo.max_sampling_rounds`."""
    return rl_update(c, SampledBatch.now(c, prompts, refill), ratio_cap, reuse_training_forward)


def rl_update(c: Components, batch: SampledBatch, ratio_cap: float, reuse_training_forward: bool) -> dict[str, float]:
    """The RL step after sampling: one update of the trainer on `batch` (this rank's share of the step's rollouts)
    and the weight sync; returns this rank's metrics (rollout/, mismatch/, correction/, loss/, perf/,
    train/skipped)."""
    algo, trainer, seconds = c.algo, c.trainer, dict(batch.seconds)
    max_length = c.sampling.max_new_tokens
    rollouts, task_rewards, sampling_metrics = batch.rollouts, batch.task_rewards, dict(batch.sampling_metrics)
    # The step's own prompts' mean reward (before any group is dropped): the same statistic for every algorithm.
    sampled_reward = sampling_metrics.pop("sampled_reward_mean")
    c.sampler.sleep()  # the trainer has the accelerator until the weight sync
    sampler_logprobs, response_mask = rollouts.padded_sampler_logprobs()
    lengths = response_mask.sum(1)
    rewards = algo.shape_rewards(task_rewards, lengths, max_length)  # e.g. DAPO's overlong punishment

    # π_old. With one epoch over one minibatch the first update's forwards can score the rollouts.
    # PPO's critic warm-up: the first steps train the critic alone (`NoCritic` never warms up).
    # An MoE model's routing (rlmm/mismatch/routing.py): π_old is scored on `routing.scored(rollouts)` (r3: the sampler's
    # experts replayed), recording the trainer's own experts; the updates train on `routing.trained(...)`.
    routing, scored = c.routing, c.routing.scored(rollouts)
    train_policy = not c.critic.warming_up
    one_pass = reuse_training_forward and algo.epochs == 1 and algo.minibatches == 1 and train_policy
    first_update = trainer.begin_update(scored, list(range(len(rollouts)))) if one_pass else None
    held = []  # the first update's forwards (logprobs, entropy), graphs kept, when they scored π_old
    # With a truncating sampler, the trainer's support against its kept sets is recorded where π_old is scored.
    with routing.recorded(trainer.model) as own_routing, support_recorded(trainer.model) as support:
        if first_update is not None and first_update.holds_graphs:
            with timed(seconds, "train"):  # the update's own forwards: timed as training, not as a scoring pass
                held = [first_update.forward(micro) for micro in first_update.micro_batches]
                trainer_logprobs = padded_rows(rollouts, first_update.micro_batches, [lp for lp, _ in held])
        else:
            with timed(seconds, "trainer_logprobs"):
                trainer_logprobs = trainer.logprobs(scored)
            if routing.replays_own_routing:  # r2: this update did not score π_old, so it replays what did
                first_update = None
    trained = routing.trained(rollouts, own_routing)
    critic = c.critic.begin_step(algo, rollouts, rewards, response_mask, seconds)  # V(s_t) and targets, or none
    advantages = per_token(algo.advantages(rewards, response_mask, critic.values), response_mask)
    old = OldPolicy.score(trainer_logprobs, sampler_logprobs, response_mask, advantages, task_rewards, c.correction,
                          ratio_cap, critic.checked())
    routing_metrics = routing.metrics(rollouts.routed_experts, own_routing)
    truncation_metrics = support_metrics(support, sampler_logprobs, response_mask)
    if routing.compare:
        with timed(seconds, "routing_compare"):
            routing_metrics.update(routing.compared(trainer, rollouts, trainer_logprobs, sampler_logprobs,
                                                    response_mask, ratio_cap))

    losses = []  # one entry per optimizer step
    in_update = InUpdateCounts()  # what the correction did inside the update, summed over its micro-batches
    with timed(seconds, "train"):
        for _ in range(0 if old.fault else algo.epochs):  # a fault skips the update on every rank
            for rows in minibatch_rows(len(rollouts), algo.minibatches):
                critic.train(rows)
                if not train_policy:
                    continue
                update = first_update or trainer.begin_update(trained, rows)
                update.scale_lr(old.lr_scale)  # before any backward: DeepSpeed steps inside the last one
                normalizer = loss_normalizer_over_ranks(algo, old.mask[rows], response_mask[rows], max_length)
                parts = []
                for i, micro in enumerate(update.micro_batches):
                    logprobs, entropy = held[i] if held else update.forward(micro)
                    view = old.micro_batch(micro, logprobs)  # π_θ in view: OPSM, tv_trust act here
                    fix = c.correction.in_update(view)
                    in_update.add(fix.counts)
                    in_update.add(drop_split(view, response_mask[micro, :logprobs.size(1)], fix.mask))
                    loss, metrics = algo.policy_loss(logprobs, view.old_logprobs, view.advantages, view.mask & fix.mask,
                                                     view.weights * fix.weights, entropy=entropy, max_length=max_length,
                                                     normalizer=normalizer, penalty=fix.penalty)
                    update.backward(loss)
                    parts.append(metrics)
                losses.append({**combined_metrics(PolicyLossStats, parts), **update.step()})
                first_update, held = None, []

    fault = old.fault
    if fault and fault.startswith("non-finite") and "logprobs" in fault:
        fault += nonfinite_hint(old.nonfinite, c)
    if not fault and any(m["skipped"] for m in losses):
        fault = "non-finite gradient (optimizer step skipped)"
    c.critic.step_done()  # counts the warm-up
    fault = fault or critic.fault()
    # fp16's loss scaler skipping an optimizer step (an overflow while it lowers its scale) is not a fault, but
    # moves no weights either: a step whose every optimizer step it skipped leaves the sampler's weights current.
    moved = not fault and train_policy and not all(m.get("loss_scale_skipped") for m in losses)
    with timed(seconds, "weight_sync"):
        # Unmoved weights are as the sampler has them, unless it dropped its copy to sleep (vLLM's level 2).
        if moved or c.sampler.needs_weights:
            send_weights(trainer.state_dict(), c.sampler)  # raises NonFiniteWeights, sending nothing
    if fault:
        log.warning("bad step skipped: %s", fault)

    lengths = lengths.float()
    return {
        "train/skipped": float(fault is not None),
        **{f"rollout/{k}": v for k, v in {
            "reward_mean": sampled_reward, "trained_reward_mean": task_rewards.mean().item(),
            "shaped_reward_mean": rewards.mean().item(),
            "response_length_mean": lengths.mean().item(),
            "frac_truncated": rollouts.finish_reasons.count("length") / len(rollouts), **sampling_metrics}.items()},
        **{f"mismatch/{k}": v for k, v in old.mismatch.items()},
        **batch.staleness_metrics(trainer_logprobs, response_mask, ratio_cap),  # with train.staleness or its split
        **{f"correction/{k}": v for k, v in old.correction_metrics.items()},
        **{f"correction/{k}": v for k, v in in_update.over_ranks().items()},
        **routing_metrics,
        **{f"support/{k}": v for k, v in truncation_metrics.items()},
        **{f"{'train' if k in LOSS_SCALER_KEYS else 'loss'}/{k}": sum(m[k] for m in losses) / len(losses)
           for k in (losses[0] if losses else ())},
        **{f"perf/{k}_seconds": v for k, v in seconds.items()},
        "perf/tokens_per_second": lengths.sum().item() / max(sum(seconds.values()), 1e-9),
        **{f"rollout/frac_nonfinite_{side}_logprobs": v for side, v in old.nonfinite.items()},
        **critic.metrics(),
    }


def per_token(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] advantages: a sequence's one advantage on each of its tokens ([B] in), or as they are."""
    return advantages[:, None].expand(mask.shape).clone() if advantages.dim() == 1 else advantages


def sample_groups(c: Components, prompts: list, refill: Callable[[int], list] | None,
                  seconds: dict[str, float]) -> tuple[Rollouts, torch.Tensor, dict[str, float]]:
    """`algo.group_size` responses to each prompt of this rank's share of `prompts` (the step's, every rank's)
    and their task rewards, grouped in prompt order; each prompt's requests are seeded by its place in the
    step (`request_ids`), so a prompt draws what it would draw with any number of ranks.

    An algorithm that keeps only some groups (`algo.keep_groups`: DAPO drops groups whose rewards are all
    equal, which carry no gradient) gets the kept groups first and groups of `refill(round)` prompts in the
    place of the dropped ones, for at most `algo.max_sampling_rounds` more rounds; a batch still short after
    them is filled with dropped groups, so every step has the same shape. Metrics: the mean reward of the
    step's own prompts (the first round, all groups), and with dynamic sampling the groups dropped, the
    rounds taken and the dropped groups used as filler."""
    rank, world = rank_and_world()
    places = rank_share(list(range(len(prompts))), rank, world)  # this rank's prompts' places in the step
    algo, size = c.algo, len(places)
    kept, dropped = [], []  # (rollouts of one group, its rewards)
    rounds, candidates, sampled_reward = 0, rank_share(prompts, rank, world), None
    while True:
        with timed(seconds, "generate"):
            rollouts = c.sampler.generate([c.tokenizer(e.prompt).input_ids for e in candidates], n=algo.group_size,
                                          request_ids=places)
        with timed(seconds, "reward"):
            rewards = rollout_rewards(c, candidates, rollouts)
        sampled_reward = rewards.mean().item() if sampled_reward is None else sampled_reward
        keep = algo.keep_groups(rewards)
        for g in range(len(candidates)):
            rows = list(range(g * algo.group_size, (g + 1) * algo.group_size))
            (kept if keep[g] else dropped).append((rollouts.select(rows), rewards[rows]))
        # Every rank takes the same rounds (the engines of several ranks step together): any short rank goes on.
        if refill is None or rounds >= algo.max_sampling_rounds or not any_rank(len(kept) < size):
            break
        rounds += 1
        candidates = rank_share(refill(rounds), rank, world)
    groups = kept[:size] + dropped[:max(0, size - len(kept))]
    metrics = {"groups_dropped": float(len(dropped)), "sampling_rounds": float(rounds),
               "groups_filled_with_dropped": float(max(0, size - len(kept)))} if algo.max_sampling_rounds else {}
    metrics["sampled_reward_mean"] = sampled_reward
    return (Rollouts.concat([r for r, _ in groups]), torch.cat([w for _, w in groups]), metrics)


def rollout_rewards(c: Components, prompts: list, rollouts: Rollouts) -> torch.Tensor:
    """[B] rewards of the rollouts (grouped: `algo.group_size` responses per prompt, in prompt order)."""
    texts = c.tokenizer.batch_decode(rollouts.response_ids, skip_special_tokens=True)
    return torch.tensor([reward(c.task, prompts[i // c.algo.group_size], t) for i, t in enumerate(texts)])


def reward(task, example, completion: str) -> float:
    """The task's reward; when the task's function raises, a one-line error naming the prompt."""
    try:
        return float(task.reward(example, completion))
    except Exception as err:
        raise ValueError(f"task.reward raised {type(err).__name__} ({err}) on prompt {example.prompt!r} with "
                         f"completion {completion!r}") from None


def minibatch_rows(num_rows: int, minibatches: int) -> list[list[int]]:
    """Split rollout rows into shuffled minibatches (one minibatch: all rows, in order). The shuffle
    draws from torch's global generator, seeded once per run."""
    if minibatches == 1:
        return [list(range(num_rows))]
    order = torch.randperm(num_rows).tolist()
    size = num_rows // minibatches
    return [order[i * size:(i + 1) * size] for i in range(minibatches)]


def loss_normalizer_over_ranks(algo, mask: torch.Tensor, response_mask: torch.Tensor, max_length: int) -> float:
    """The algorithm's loss divisor of one rank's share of a minibatch (the kept tokens' `mask`, and the sampled
    ones' for an algorithm that counts rejected tokens), agreed over ranks (`divisor_over_ranks`)."""
    return divisor_over_ranks(algo.loss_normalizer(mask, max_length=max_length, response_mask=response_mask))


class InUpdateCounts:
    """A correction's in-update counts (rlmm/corrections/base.py's `InUpdate.counts`: numerator, denominator)
    summed over the step's micro-batches and then over the ranks: each logged as the ratio of its sums, so the
    figure is the step's whole batch's whatever the micro-batching and the number of ranks."""

    def __init__(self):
        self.sums: dict[str, list[float]] = {}

    def add(self, counts: dict[str, tuple[float, float]]) -> None:
        for key, (numerator, denominator) in counts.items():
            total = self.sums.setdefault(key, [0.0, 0.0])
            total[0] += float(numerator)
            total[1] += float(denominator)

    def over_ranks(self) -> dict[str, float]:
        """Each key's ratio of sums over every rank (a collective: every rank calls it, with or without counts)."""
        totals: dict[str, list[float]] = {}
        for sums in gathered_over_ranks(self.sums):
            for key, (numerator, denominator) in sums.items():
                total = totals.setdefault(key, [0.0, 0.0])
                total[0] += numerator
                total[1] += denominator
        return {key: numerator / denominator if denominator else math.nan
                for key, (numerator, denominator) in totals.items()}


def nonfinite_hint(fractions: dict[str, float], c: Components) -> str:
    """Which side's log-probs are non-finite, how many, and the known cause when it is fp16."""
    sides = ", ".join(f"{frac:.1%} of the {side}'s" for side, frac in fractions.items() if frac > 0)
    dtypes = {c.sampler.actual_precision.get("dtype"), c.trainer.actual_precision.get("dtype")}
    return f" ({sides}){nonfinite_cause(dtypes)}"


def first_fault(**tensors: torch.Tensor) -> str | None:
    """Name the first input holding NaN/Inf, or None when all are finite."""
    for name, tensor in tensors.items():
        if not torch.isfinite(tensor).all():
            return f"non-finite {name.replace('_', ' ')}"
    return None


def fault_on_any_rank(fault: str | None) -> str | None:
    """A fault seen on any rank is a fault on every rank (they must skip the update together)."""
    if any_rank(fault is not None):
        return fault or "a fault on another rank"
    return None


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of ranks (0 and 1 without torch.distributed)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_share(prompts: list, rank: int, world: int) -> list:
    """The prompts rank `rank` of `world` samples and trains on: every world-th one from its own index,
    so the ranks' shares are disjoint, cover the step's prompts, and differ in size by at most one."""
    return prompts[rank::world]

