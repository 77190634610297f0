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
from rlmm.mismatch.metrics import first_difference, mismatch_metrics, staleness_decomposition, token_agreement
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
    token_staleness: torch.Tensor | None = None  # [B, T] int64: each token's updates behind π_old (None: untracked)

    @classmethod
    def score(cls, trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor,
              advantages: torch.Tensor, rewards: torch.Tensor, correction, ratio_cap: float,
              also_checked: dict[str, torch.Tensor], token_staleness: torch.Tensor | None = None) -> OldPolicy:
        """`also_checked`: more tensors the NaN/Inf check covers, after these (the critic's values).
        `token_staleness`: each token's updates behind π_old, which the correction sees (None: untracked)."""
        checked = {"rewards": rewards, "trainer_logprobs": trainer_logprobs[mask],
                   "sampler_logprobs": sampler_logprobs[mask]}
        fault = fault_on_any_rank(first_fault(**checked, **also_checked))
        # The correction's batch stage and the metrics see the step's whole batch, every rank's rows (the same on
        # every rank): a mean over ranks of each rank's maximum or token mean would not be the batch's, nor would a
        # rank's own self-normalisation or second-moment cut (rlmm/runtime/collectives.py::rows_of_every_rank). Each
        # rank trains on its own rows of the result.
        every = rows_of_every_rank(trainer_logprobs, sampler_logprobs, mask, advantages)
        every_staleness = None if token_staleness is None else rows_of_every_rank(token_staleness)[0]
        batch = BatchView(*every, token_staleness=every_staleness)
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
                   nonfinite=nonfinite, fault=fault, token_staleness=token_staleness)

    def mismatch_metrics(self) -> dict[str, float]:
        return {f"mismatch/{k}": v for k, v in self.mismatch.items()}

    def batch_correction_metrics(self) -> dict[str, float]:
        """The correction's batch stage and step size, under correction/."""
        return {f"correction/{k}": v for k, v in self.correction_metrics.items()}

    def nonfinite_metrics(self) -> dict[str, float]:
        return {f"rollout/frac_nonfinite_{side}_logprobs": v for side, v in self.nonfinite.items()}

    def fault_explained(self, c: Components) -> str | None:
        """The fault, with which side's log-probs are non-finite and the known cause where that is the fault."""
        if self.fault and self.fault.startswith("non-finite") and "logprobs" in self.fault:
            return self.fault + nonfinite_hint(self.nonfinite, c)
        return self.fault

    def micro_batch(self, rows: list[int], logprobs: torch.Tensor) -> MicroBatchView:
        """What the correction sees of one micro-batch inside the update: its rows cut to the width of the
        forward's `logprobs` (log π_θ, detached here)."""
        width = logprobs.size(1)
        return MicroBatchView(logprobs=logprobs.detach(), old_logprobs=self.logprobs[rows, :width],
                              trainer_logprobs=self.trainer_logprobs[rows, :width],
                              sampler_logprobs=self.sampler_logprobs[rows, :width],
                              advantages=self.advantages[rows, :width], mask=self.mask[rows, :width],
                              weights=self.weights[rows, :width],
                              token_staleness=None if self.token_staleness is None
                              else self.token_staleness[rows, :width])


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
    # [B, T] int64, right-padded with 0: each token's updates between the weights that sampled it (its
    # `Rollouts.versions`) and those it updates; `staleness` is its oldest token's (None: untracked)
    token_staleness: torch.Tensor | None = None
    stale_logprobs: torch.Tensor | None = None  # [B, T] the trainer's log-probs at the weights that sampled them

    @classmethod
    def now(cls, c: Components, prompts: list, refill: Callable[[int], list] | None) -> SampledBatch:
        """The rollouts of `prompts` (and refills) sampled now with the sampler's weights, and what that cost."""
        seconds = {}
        return cls(*sample_groups(c, prompts, refill, seconds), seconds)

    def rollout_metrics(self, shaped_rewards: torch.Tensor, lengths: torch.Tensor) -> dict[str, float]:
        """rollout/: the step's own prompts' mean reward (before any group was dropped: the same statistic for
        every algorithm), the trained, shaped rewards, the lengths, and what sampling reported."""
        sampling = dict(self.sampling_metrics)
        lengths = lengths.float()
        return {f"rollout/{k}": v for k, v in {
            "reward_mean": sampling.pop("sampled_reward_mean"), "trained_reward_mean": self.task_rewards.mean().item(),
            "shaped_reward_mean": shaped_rewards.mean().item(), "response_length_mean": lengths.mean().item(),
            "frac_truncated": self.rollouts.finish_reasons.count("length") / len(self.rollouts), **sampling}.items()}

    def staleness_metrics(self, trainer_logprobs: torch.Tensor, mask: torch.Tensor,
                          ratio_cap: float) -> dict[str, float]:
        """rollout/staleness where it is tracked, and with `stale_logprobs` the mismatch split into its
        numerical and policy-lag parts (mismatch/numerical/, mismatch/policy_lag/: rlmm/mismatch/metrics.py::
        staleness_decomposition); {} for a batch sampled now without the split."""
        metrics = {} if self.staleness is None else {"rollout/staleness": float(self.staleness)}
        if self.token_staleness is not None:
            metrics.update({f"rollout/{k}": v for k, v in token_staleness_metrics(
                *rows_of_every_rank(self.token_staleness, mask)).items()})
        if self.stale_logprobs is not None:
            sampler_logprobs, _ = self.rollouts.padded_sampler_logprobs()
            parts = staleness_decomposition(*rows_of_every_rank(trainer_logprobs, self.stale_logprobs,
                                                                sampler_logprobs, mask), ratio_cap=ratio_cap)
            metrics.update({f"mismatch/{k}": v for k, v in parts.items()})
        return metrics


    def agreement_metrics(self, trainer_logprobs: torch.Tensor, mask: torch.Tensor, bitwise: bool) -> dict[str, float]:
        """agreement/: the share of the step's response tokens (every rank's) whose log-prob the sampler and the trainer
        at the weights that sampled them give to the same bits, and whether that is all of them; {} where the trainer
        did not score them at those weights (staleness without `stale_logprobs`: the gap is then also policy lag).
        With `bitwise` (`sampler=bitwise`, whose promise it is) a step that is not bitwise raises `NotBitwise`
        naming the first token that differs, before the update trains on it."""
        if self.stale_logprobs is not None:
            reference = self.stale_logprobs
        elif not self.staleness:
            reference = trainer_logprobs
        else:
            return {}
        sampler_logprobs, _ = self.rollouts.padded_sampler_logprobs()
        agreement = token_agreement(*rows_of_every_rank(reference, sampler_logprobs, mask))
        if bitwise and not agreement["bitwise_identical"]:
            raise NotBitwise(self.rollouts, reference, sampler_logprobs, mask, agreement)
        return {"agreement/frac_tokens_identical": agreement["frac_tokens_identical"],
                "agreement/bitwise": float(agreement["bitwise_identical"])}


def token_staleness_metrics(token_staleness: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Per-token staleness over a batch's response tokens ([B, T] each token's updates behind π_old, and the mask):
    its mean and worst (verl's trajectory_staleness and _worst), the share of non-empty responses whose tokens come
    from more than one weight version (they straddle a sync: partial rollouts), and the mean number of version spans
    per non-empty response (1 for a response sampled whole; verl's trajectory_spans)."""
    rows = mask.any(1)
    if not rows.any():
        return {}
    values = token_staleness[mask].double()
    changes = (token_staleness[:, 1:] != token_staleness[:, :-1]) & mask[:, 1:]
    spans = 1 + changes.sum(1)
    return {"token_staleness_mean": values.mean().item(), "token_staleness_max": values.max().item(),
            "frac_responses_mixed": (spans[rows] > 1).double().mean().item(),
            "version_spans_mean": spans[rows].double().mean().item()}


class NotBitwise(RuntimeError):
    """`sampler=bitwise` promised log-probs equal to the trainer's to the bit and a step's are not."""

    def __init__(self, rollouts: Rollouts, trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                 mask: torch.Tensor, agreement: dict):
        where = first_difference(trainer_logprobs, sampler_logprobs, mask)  # this rank's rows
        if where is None:
            first = "the first token that differs is another rank's"
        else:
            row, t = where
            ours, theirs = float(sampler_logprobs[row, t]), float(trainer_logprobs[row, t])
            first = (f"first at response token {t} of row {row} (token id {rollouts.response_ids[row][t]}): sampler "
                     f"{ours!r} ({ours.hex()}), trainer {theirs!r} ({theirs.hex()})")
        super().__init__(f"sampler=bitwise: the sampler's and the trainer's log-probs are not bitwise identical "
                         f"({agreement['frac_tokens_identical']:.2%} of {agreement['num_tokens']} tokens agree), {first}")


def rl_step(c: Components, prompts: list, ratio_cap: float, reuse_training_forward: bool,
            refill: Callable[[int], list] | None = None) -> dict[str, float]:
    """One RL step on the step's `prompts` (every rank's: this rank takes its `rank_share`), sampled now with the
    sampler's weights; returns this rank's metrics (`rl_update`). `refill(round)`: more prompts, as many as
    `prompts`, for an algorithm that drops groups (DAPO's dynamic sampling); round 1, 2, ... up to
    `algo.max_sampling_rounds`."""
    return rl_update(c, SampledBatch.now(c, prompts, refill), ratio_cap, reuse_training_forward)


def rl_update(c: Components, batch: SampledBatch, ratio_cap: float, reuse_training_forward: bool) -> dict[str, float]:
    """The RL step after sampling: one update of the trainer on `batch` (this rank's share of the step's rollouts)
    and the weight sync; returns this rank's metrics, each family from the stage that owns it (rollout/,
    mismatch/, correction/, routing/, support/, loss/, perf/, train/skipped, the critic's)."""
    algo, seconds = c.algo, dict(batch.seconds)
    rollouts = batch.rollouts
    c.sampler.sleep()  # the trainer has the accelerator until the weight sync
    sampler_logprobs, response_mask = rollouts.padded_sampler_logprobs()
    lengths = response_mask.sum(1)
    rewards = algo.shape_rewards(batch.task_rewards, lengths, c.episodes.max_sampled_tokens)  # e.g. DAPO's overlong one

    train_policy = not c.critic.warming_up  # PPO's critic warm-up: its first steps train the critic alone
    scores = TrainerScores.of(c, rollouts, reuse_training_forward and train_policy, seconds)  # π_old
    critic = c.critic.begin_step(algo, rollouts, rewards, response_mask, seconds)  # V(s_t) and targets, or none
    advantages = per_token(algo.advantages(rewards, response_mask, critic.values), response_mask)
    old = OldPolicy.score(scores.logprobs, sampler_logprobs, response_mask, advantages, batch.task_rewards,
                          c.correction, ratio_cap, critic.checked(), batch.token_staleness)
    measured = scores.metrics(c, rollouts, sampler_logprobs, response_mask, ratio_cap, seconds)  # routing/, support/
    agreement = batch.agreement_metrics(scores.logprobs, response_mask, bitwise=c.bitwise)  # raises if not, bitwise

    with timed(seconds, "train"):
        update = update_policy(c, old, critic, scores, rollouts, response_mask, train_policy)

    fault = old.fault_explained(c) or update.fault()
    c.critic.step_done()  # counts the warm-up
    fault = fault or critic.fault()
    # fp16's loss scaler skipping an optimizer step (an overflow while it lowers its scale) is not a fault, but
    # moves no weights either: a step whose every optimizer step it skipped leaves the sampler's weights current.
    moved = not fault and train_policy and not update.all_skipped_by_loss_scaler()
    with timed(seconds, "weight_sync"):
        # Unmoved weights are as the sampler has them, unless it dropped its copy to sleep (vLLM's level 2).
        if moved or c.sampler.needs_weights:
            send_weights(c.trainer.state_dict(), c.sampler)  # raises NonFiniteWeights, sending nothing
    if fault:
        log.warning("bad step skipped: %s", fault)

    return {
        "train/skipped": float(fault is not None),
        **batch.rollout_metrics(rewards, lengths),
        **old.mismatch_metrics(),
        **c.episodes.metrics(rollouts, scores.logprobs, sampler_logprobs, response_mask),  # a conversation's turns
        **agreement,
        **batch.staleness_metrics(scores.logprobs, response_mask, ratio_cap),  # with train.staleness or its split
        **old.batch_correction_metrics(),
        **update.in_update.metrics(),
        **measured,
        **update.metrics(),
        **perf_metrics(seconds, lengths),
        **old.nonfinite_metrics(),
        **critic.metrics(),
    }


@dataclass
class TrainerScores:
    """π_old as the trainer scored the step's rollouts, with what it recorded while scoring: its own MoE routing
    (rlmm/mismatch/routing.py) and its support against the sampler's kept sets (rlmm/policy/support.py).

    An MoE model's rollouts are scored on `routing.scored(rollouts)` (r3: the sampler's experts replayed). With one
    epoch over one minibatch the first update's forwards can score them (`first_update`, its forwards `held` with
    their graphs, timed as training, not as a scoring pass); otherwise a no-grad scoring pass does."""

    logprobs: torch.Tensor  # [B, T] log π_old as the trainer computes it
    own_routing: object  # the trainer's own experts, recorded while scoring
    support: object  # the trainer's support against the kept sets, recorded while scoring
    first_update: object | None  # the update begun to score (one pass), or None
    held: list  # the first update's forwards (logprobs, entropy), graphs kept, when they scored π_old

    @classmethod
    def of(cls, c: Components, rollouts: Rollouts, may_reuse_forward: bool, seconds: dict[str, float]) -> TrainerScores:
        routing, scored = c.routing, c.routing.scored(rollouts)
        one_pass = may_reuse_forward and c.algo.epochs == 1 and c.algo.minibatches == 1
        first_update = c.trainer.begin_update(scored, list(range(len(rollouts)))) if one_pass else None
        held = []
        with routing.recorded(c.trainer.model) as own_routing, support_recorded(c.trainer.model) as support:
            if first_update is not None and first_update.holds_graphs:
                with timed(seconds, "train"):
                    held = [first_update.forward(micro) for micro in first_update.micro_batches]
                    logprobs = padded_rows(rollouts, first_update.micro_batches, [lp for lp, _ in held])
            else:
                with timed(seconds, "trainer_logprobs"):
                    logprobs = c.trainer.logprobs(scored)
                if routing.replays_own_routing:  # r2: this update did not score π_old, so it replays what did
                    first_update = None
        return cls(logprobs, own_routing, support, first_update, held)

    def metrics(self, c: Components, rollouts: Rollouts, sampler_logprobs: torch.Tensor, mask: torch.Tensor,
                ratio_cap: float, seconds: dict[str, float]) -> dict[str, float]:
        """What the scoring pass recorded: routing/ (and with `routing.compare` the mismatch both ways, timed as
        routing_compare) and support/."""
        routing = c.routing.metrics(rollouts.routed_experts, self.own_routing)
        support = {f"support/{k}": v for k, v in support_metrics(self.support, sampler_logprobs, mask).items()}
        if c.routing.compare:
            with timed(seconds, "routing_compare"):
                routing.update(c.routing.compared(c.trainer, rollouts, self.logprobs, sampler_logprobs, mask,
                                                  ratio_cap))
        return {**routing, **support}


@dataclass
class PolicyUpdate:
    """What the update did: each optimizer step's loss metrics (`losses`) and the correction's counts inside it."""

    losses: list[dict[str, float]]
    in_update: InUpdateCounts

    def fault(self) -> str | None:
        return "non-finite gradient (optimizer step skipped)" if any(m["skipped"] for m in self.losses) else None

    def all_skipped_by_loss_scaler(self) -> bool:
        return all(m.get("loss_scale_skipped") for m in self.losses)

    def metrics(self) -> dict[str, float]:
        """loss/ (the loss scaler's keys under train/): each the mean over the step's optimizer steps."""
        return {f"{'train' if k in LOSS_SCALER_KEYS else 'loss'}/{k}": sum(m[k] for m in self.losses) / len(self.losses)
                for k in (self.losses[0] if self.losses else ())}


def update_policy(c: Components, old: OldPolicy, critic, scores: TrainerScores, rollouts: Rollouts,
                  response_mask: torch.Tensor, train_policy: bool) -> PolicyUpdate:
    """PPO's update: for each epoch and minibatch the critic's step, then per micro-batch the forward, the correction
    inside the update (OPSM, tv_trust act here, on π_θ), the loss and its backward, and the optimizer step at the
    correction's rate. An MoE model trains on `routing.trained(...)`. A fault skips it on every rank."""
    algo, max_length = c.algo, c.episodes.max_response_tokens
    trained = c.routing.trained(rollouts, scores.own_routing)
    first_update, held = scores.first_update, scores.held
    losses, in_update = [], InUpdateCounts()  # one loss entry per optimizer step; the correction's counts summed
    for _ in range(0 if old.fault else algo.epochs):
        for rows in minibatch_rows(len(rollouts), algo.minibatches):
            critic.train(rows)
            if not train_policy:
                continue
            update = first_update or c.trainer.begin_update(trained, rows)
            update.scale_lr(old.lr_scale)  # before any backward: DeepSpeed steps inside the last one
            normalizer = loss_normalizer_over_ranks(algo, old.mask[rows], response_mask[rows], max_length)
            parts = []
            for i, micro in enumerate(update.micro_batches):
                logprobs, entropy = held[i] if held else update.forward(micro)
                view = old.micro_batch(micro, logprobs)
                fix = c.correction.in_update(view)
                in_update.add(fix.counts)
                in_update.add(drop_split(view, response_mask[micro, :logprobs.size(1)], fix.mask))
                old_logprobs = fix.old_logprobs if fix.old_logprobs is not None else view.old_logprobs  # prox_loglinear
                loss, metrics = algo.policy_loss(logprobs, old_logprobs, view.advantages, view.mask & fix.mask,
                                                 view.weights * fix.weights, entropy=entropy, max_length=max_length,
                                                 normalizer=normalizer, penalty=fix.penalty)
                update.backward(loss)
                parts.append(metrics)
            losses.append({**combined_metrics(PolicyLossStats, parts), **update.step()})
            first_update, held = None, []
    return PolicyUpdate(losses, in_update)


def perf_metrics(seconds: dict[str, float], lengths: torch.Tensor) -> dict[str, float]:
    """perf/: each stage's seconds and the step's sampled tokens per second of them all."""
    return {**{f"perf/{k}_seconds": v for k, v in seconds.items()},
            "perf/tokens_per_second": lengths.float().sum().item() / max(sum(seconds.values()), 1e-9)}


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
        with timed(seconds, "generate"):  # a multi-turn task's conversations, its environment's turns included
            rollouts = c.episodes.sample(c.sampler, candidates, n=algo.group_size, request_ids=places)
        with timed(seconds, "reward"):
            rewards = c.episodes.rewards(candidates, rollouts, algo.group_size)
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
    return c.episodes.rewards(prompts, rollouts, c.algo.group_size)


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

    def metrics(self) -> dict[str, float]:
        """The counts over ranks, under correction/ (a collective, as `over_ranks`)."""
        return {f"correction/{k}": v for k, v in self.over_ranks().items()}


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

