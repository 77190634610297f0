"""A minibatch update's loss statistics as typed records, each field annotated with how it combines over
micro-batches (after torchtune's `GRPOStats`, a typed record of a step's loss statistics).

A minibatch's loss is accumulated over micro-batches, so its statistics must be combined from theirs to
equal those of the whole minibatch in one piece, whatever the micro-batch size
(tests/test_update.py::test_logged_loss_metrics_do_not_depend_on_the_micro_batch_size). A field's
annotation says how (`Annotated[float, Combine.SUM]`), so the reduction is declared beside the name, not
chosen from the name's suffix:

- `SUM`: each micro-batch's share that adds up: the loss terms (already divided by the whole minibatch's
  normaliser);
- `COUNT`: a count that adds up: `num_tokens`;
- `TOKEN_MEAN`: a mean over tokens, weighted by each micro-batch's `num_tokens`; micro-batches with no
  kept token (NaN, or a weight of 0) are left out, and NaN is what remains when all are;
- `MIN` / `MAX`: the smallest / largest over micro-batches, NaN ones left out (NaN when all are).

With several ranks each rank's minibatch statistics are combined again over the ranks (`combine_ranks`), so
the logged ones are those of the whole minibatch, every rank's rows, as one rank would log them
(tests/test_update.py::test_two_ranks_take_the_one_rank_step_on_the_same_rows): `COUNT` adds up, `TOKEN_MEAN`,
`MIN` and `MAX` as over micro-batches, and `SUM` is averaged: each rank divides its loss by the normaliser agreed
over the ranks, (all kept tokens) / ranks, so the minibatch's loss is the ranks' mean, as the averaged gradient
is its gradient (docs/training.md). A plain mean over ranks had logged half the tokens on 2 ranks and the mean
of the ranks' `ratio_max`.

A field that may be absent (`kl` without a reference, `entropy` without an entropy) is `None` in every
micro-batch and is left out of the logged metrics. The RL step (rlmm/run/step.py) logs the combined
`PolicyLossStats` as loss/<name> and `ValueLossStats` as critic/<name>, averaged over the step's
minibatches. The algorithms (rlmm/algos/) return their statistics as a plain dict of these names;
`combined_metrics` makes the record of each (an unknown or a missing name is a TypeError there).
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import math
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, TypeVar

from rlmm.runtime.collectives import gathered_over_ranks

__all__ = ["Combine", "PolicyLossStats", "ValueLossStats", "combine_micro_batches", "combine_ranks",
           "combined_metrics", "metrics_of", "reductions"]


class Combine(enum.Enum):
    """How a field combines over micro-batches (see the module docstring)."""

    SUM = "sum"
    COUNT = "count"
    TOKEN_MEAN = "token_mean"
    MIN = "min"
    MAX = "max"


@dataclass(frozen=True, kw_only=True)
class PolicyLossStats:
    """`Algorithm.policy_loss`'s statistics (GRPO and its family, PPO's policy), logged as loss/<name>; the
    formulas are docs/algorithms.md's. Means are over kept tokens; with none, they are NaN and
    `num_tokens` 0."""

    loss: Annotated[float, Combine.SUM]  # the value minimised
    pg_loss: Annotated[float, Combine.SUM]  # its policy-gradient part
    kl: Annotated[float | None, Combine.TOKEN_MEAN] = None  # only with reference log-probs
    entropy: Annotated[float | None, Combine.TOKEN_MEAN] = None  # only with the entropy
    approx_kl: Annotated[float, Combine.TOKEN_MEAN]
    ppo_kl: Annotated[float, Combine.TOKEN_MEAN]  # k1 of KL(pi_old || pi_theta), verl's actor/ppo_kl
    clipfrac: Annotated[float, Combine.TOKEN_MEAN]
    clipfrac_low: Annotated[float, Combine.TOKEN_MEAN]
    clipfrac_high: Annotated[float, Combine.TOKEN_MEAN]
    clipfrac_dual: Annotated[float | None, Combine.TOKEN_MEAN] = None  # only with PPO's dual clip
    penalty: Annotated[float | None, Combine.SUM] = None  # only with a correction's in-update penalty (tv_trust)
    ratio_mean: Annotated[float, Combine.TOKEN_MEAN]
    ratio_min: Annotated[float, Combine.MIN]
    ratio_max: Annotated[float, Combine.MAX]
    num_tokens: Annotated[int, Combine.COUNT]  # kept tokens: the token means' weight


@dataclass(frozen=True, kw_only=True)
class ValueLossStats:
    """`Algorithm.value_loss`'s statistics (PPO's critic), logged as critic/<name>."""

    loss: Annotated[float, Combine.SUM]  # the critic's clipped value loss
    value_clipfrac: Annotated[float, Combine.TOKEN_MEAN]
    num_tokens: Annotated[int, Combine.COUNT]


Stats = TypeVar("Stats", PolicyLossStats, ValueLossStats)


@functools.cache
def reductions(record: type) -> dict[str, Combine]:
    """Each field of the record type and how it combines, in the record's order."""
    hints = typing.get_type_hints(record, include_extras=True)
    declared = {}
    for field in dataclasses.fields(record):
        combine = [m for m in getattr(hints[field.name], "__metadata__", ()) if isinstance(m, Combine)]
        if len(combine) != 1:
            raise TypeError(f"{record.__name__}.{field.name}: declare how it combines: Annotated[..., Combine.X]")
        declared[field.name] = combine[0]
    return declared


def combine_micro_batches(parts: Sequence[Stats]) -> Stats:
    """One minibatch's statistics from its micro-batches' (one record or more, of one type), each field
    combined as the record declares."""
    return _combine(parts, ranks=False)


def combine_ranks(parts: Sequence[Stats]) -> Stats:
    """The whole minibatch's statistics from each rank's (its micro-batches combined), in rank order: as
    `combine_micro_batches`, but each `SUM` field is the ranks' mean (see the module docstring)."""
    return _combine(parts, ranks=True)


def _combine(parts: Sequence[Stats], ranks: bool) -> Stats:
    record = type(parts[0])
    weights = [part.num_tokens for part in parts]
    combined = {}
    for name, combine in reductions(record).items():
        values = [getattr(part, name) for part in parts]
        if all(v is None for v in values):
            combined[name] = None
            continue
        if any(v is None for v in values):
            raise ValueError(f"{record.__name__}.{name}: given by some micro-batches only")
        if combine is Combine.COUNT:
            combined[name] = sum(values)
        elif combine is Combine.SUM:
            combined[name] = sum(values) / len(values) if ranks else sum(values)
        elif combine is Combine.TOKEN_MEAN:
            kept = [(v, w) for v, w in zip(values, weights) if w and not math.isnan(v)]
            total = sum(w for _, w in kept)
            combined[name] = sum(v * w for v, w in kept) / total if total else math.nan
        else:
            finite = [v for v in values if not math.isnan(v)]
            combined[name] = (min if combine is Combine.MIN else max)(finite) if finite else math.nan
    return record(**combined)


def metrics_of(stats: PolicyLossStats | ValueLossStats) -> dict[str, float]:
    """The record as the metrics the step logs: its fields in order, absent (None) ones left out."""
    return {name: value for name, value in dataclasses.asdict(stats).items() if value is not None}


def combined_metrics(record: type[Stats], parts: Sequence[Mapping[str, float] | Stats]) -> dict[str, float]:
    """The metrics of one minibatch from its micro-batches' statistics (the algorithm's dicts, or records of
    `record`), combined as `record` declares, then over the ranks (`combine_ranks`); none without
    micro-batches (the ranks agree on their count: rlmm/trainers/packing.py)."""
    if not parts:
        return {}
    records = [record(**part) if isinstance(part, Mapping) else part for part in parts]
    minibatch = combine_micro_batches(records)
    every_rank = gathered_over_ranks(dataclasses.asdict(minibatch))  # a collective: every rank calls it
    return metrics_of(combine_ranks([record(**part) for part in every_rank]) if len(every_rank) > 1 else minibatch)
