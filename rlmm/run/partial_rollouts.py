"""Partial rollouts (`train.partial_rollouts`): a batch's responses sampled chunk by chunk across weight syncs, each
token carrying the weight version that sampled it (AReaL's, slime's and verl's interrupted generation).

The delay line (rlmm/run/rollout_source.py) starts batch j at step max(1, j - k), as with whole responses, but
samples only its first `train.rollout_chunk` tokens there. At every later step, after the sync of v_{s-1}, every
unfinished response of every batch in flight advances by one more chunk under v_{s-1}, continued from its prompt and
its tokens so far (the engine prefills them with the new weights: vLLM's prefix cache was emptied by the sync); at
step j, when the update needs it, the rest of each response is sampled under v_{j-1}. So batch j's tokens are
sampled by v_{j-k-1}, v_{j-k}, ..., v_{j-1}, a chunk each and the rest by the last: token staleness k down to 0,
where whole responses are all k old. A response that stops early (end of sequence) holds fewer versions.

A response's sampler log-prob of each token is its own version's (the behaviour policy of a mixed response is the
sequence of those policies, and its probability the product of theirs); its `Rollouts.versions` says which. With
`train.decompose_staleness` the trainer scores each chunk right after it is sampled, holding the weights that sampled
it, and keeps those log-probs for the chunk's tokens: the numerical part of the mismatch, token by token at its own
version.

Seeds: each continuation is one request per row (n = 1) seeded from (seed, sampling call, the row's place in the
step), a function of the run alone: a resumed run draws what the uninterrupted one did. At k = 0 nothing is in flight
across a sync, so nothing is cut: `check_options` refuses partial rollouts there (the synchronous step is unchanged).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from rlmm.policy.rollouts import KeptTokens, Rollouts
from rlmm.runtime.collectives import any_rank
from rlmm.runtime.timing import timed

__all__ = ["PartialBatch", "rollouts_from_state", "rollouts_state"]


@dataclass
class PartialBatch:
    """One batch's responses while they are being sampled: this rank's rows, grouped as `sample_groups` groups them
    (`algo.group_size` responses per prompt, in prompt order)."""

    rollouts: Rollouts  # the prompts, the tokens so far, their sampler log-probs, kept sets and versions
    places: list[int]  # each row's place in the step's requests (prompt place x group size + sample): its seed
    open: list[bool]  # rows still to be continued (stopped by a chunk, not by end of sequence or max_new_tokens)
    stale_logprobs: list[torch.Tensor] | None  # with the decomposition: the trainer's log-probs at each token's version
    scored: list[int]  # with the decomposition: how many of each row's tokens are scored so far

    @classmethod
    def start(cls, c, prompts: list, places: list[int], version: int, tokens: int | None,
              decompose: bool, seconds: dict[str, float]) -> PartialBatch:
        """Sample the first `tokens` of `algo.group_size` responses to each of this rank's `prompts` (at their
        `places` in the step) under the sampler's weights, version `version` (None: to the end)."""
        group = c.algo.group_size
        with timed(seconds, "generate"):
            first = c.sampler.generate([c.prompts.ids(e) for e in prompts], n=group,
                                       request_ids=places, max_new_tokens=tokens)
        without_uncontinuable_records(first)
        rows = len(first)
        first.versions = [torch.full((len(r),), version, dtype=torch.int64) for r in first.response_ids]
        batch = cls(first, [p * group + s for p in places for s in range(group)], [False] * rows,
                    [torch.zeros(0) for _ in range(rows)] if decompose else None, [0] * rows)
        batch.open = [batch.continues(row, c.sampling.max_new_tokens) for row in range(rows)]
        return batch

    def continues(self, row: int, max_new_tokens: int) -> bool:
        return self.rollouts.finish_reasons[row] == "length" and len(self.rollouts.response_ids[row]) < max_new_tokens

    def advance(self, c, version: int, tokens: int | None, seconds: dict[str, float]) -> None:
        """Continue every open row by `tokens` more (None: to the end) under the sampler's weights, version
        `version`. Every rank calls the engine while any rank has an open row (the engines of several ranks
        step together), a rank with none with no request."""
        rows = [row for row, open_ in enumerate(self.open) if open_]
        if not any_rank(bool(rows)):
            return
        r = self.rollouts
        # An open row never stopped early: every one holds the same tokens so far, a whole number of chunks.
        left = {c.sampling.max_new_tokens - len(r.response_ids[row]) for row in rows}
        if len(left) > 1:
            raise RuntimeError(f"train.partial_rollouts: open responses with different lengths ({sorted(left)} left)")
        left = left.pop() if left else c.sampling.max_new_tokens
        with timed(seconds, "generate"):
            more = c.sampler.generate([list(r.prompt_ids[row]) + list(r.response_ids[row]) for row in rows], n=1,
                                      request_ids=[self.places[row] for row in rows],
                                      max_new_tokens=left if tokens is None else min(tokens, left))
        without_uncontinuable_records(more)
        for i, row in enumerate(rows):
            r.response_ids[row] = list(r.response_ids[row]) + list(more.response_ids[i])
            r.sampler_logprobs[row] = torch.cat([r.sampler_logprobs[row], more.sampler_logprobs[i]])
            r.versions[row] = torch.cat([r.versions[row], torch.full((len(more.response_ids[i]),), version,
                                                                      dtype=torch.int64)])
            r.finish_reasons[row] = more.finish_reasons[i]
            if r.kept_tokens is not None:
                r.kept_tokens[row] = KeptTokens.joined([r.kept_tokens[row], more.kept_tokens[i]])
            self.open[row] = self.continues(row, c.sampling.max_new_tokens)

    def score_new_tokens(self, c) -> None:
        """With the decomposition: the trainer's log-probs of the tokens sampled since the last call, at the weights
        it holds now (those that sampled them: the caller's promise). Every row is scored, so every rank scores
        alike (a token-budget trainer scores collectively)."""
        logprobs = c.trainer.logprobs(self.rollouts)
        for row, response in enumerate(self.rollouts.response_ids):
            done, now = self.scored[row], len(response)
            self.stale_logprobs[row] = torch.cat([self.stale_logprobs[row], logprobs[row, done:now].float()])
            self.scored[row] = now

    @property
    def done(self) -> bool:
        return not any(self.open)

    def padded_stale_logprobs(self) -> torch.Tensor | None:
        """[B, T] the trainer's log-probs at each token's own version, right-padded (None: not decomposed)."""
        if self.stale_logprobs is None:
            return None
        width = max((len(r) for r in self.rollouts.response_ids), default=0)
        out = torch.zeros(len(self.stale_logprobs), width)
        for row, values in enumerate(self.stale_logprobs):
            out[row, :len(values)] = values
        return out

    def state(self) -> dict:
        """As tensors, ints, lists and dicts (a checkpoint's `torch.load(weights_only=True)` reads them back)."""
        return {"rollouts": rollouts_state(self.rollouts), "places": list(self.places), "open": list(self.open),
                "stale_logprobs": self.stale_logprobs, "scored": list(self.scored)}

    @classmethod
    def from_state(cls, state: dict) -> PartialBatch:
        return cls(rollouts_from_state(state["rollouts"]), list(state["places"]), list(state["open"]),
                   state["stale_logprobs"], list(state["scored"]))


def without_uncontinuable_records(rollouts: Rollouts) -> None:
    """What a continuation cannot extend, laid out over prompt + response and recomputed for the old tokens by the
    next chunk's prefill: an MoE sampler's routed experts are dropped (its routing/ metrics are not measured under
    partial rollouts; `check_partial_rollouts` refuses replaying or comparing them before any engine starts), and
    captured layer states refused."""
    rollouts.routed_experts = None
    if rollouts.layer_states is not None:
        raise ValueError("train.partial_rollouts: the sampler returned layer_states, which a continued response "
                         "cannot carry over a weight sync")


def rollouts_state(rollouts: Rollouts) -> dict:
    """Every field of `rollouts` as tensors, lists and dicts (kept sets as dicts of their tensors)."""
    state = {f.name: getattr(rollouts, f.name) for f in fields(Rollouts)}
    if state["kept_tokens"] is not None:
        state["kept_tokens"] = [vars(kept) for kept in state["kept_tokens"]]
    return state


def rollouts_from_state(state: dict) -> Rollouts:
    state = dict(state)
    if state.get("kept_tokens") is not None:
        state["kept_tokens"] = [KeptTokens(**kept) for kept in state["kept_tokens"]]
    return Rollouts(**state)


def check_partial_rollouts(train, sampling, routing, algo) -> None:
    """One line for what partial rollouts cannot do, before any engine starts (`train`: the `train:` node, None for
    an app without one): a chunk outside 1 .. sampling.max_new_tokens, an MoE sampler's routing replayed or compared
    (its experts cannot be carried over a sync), dropped groups refilled (DAPO: the rewards of a whole batch decide which
    prompts to sample more)."""
    if train is None or not train.partial_rollouts:
        return
    if not 1 <= train.rollout_chunk <= sampling.max_new_tokens:
        raise ValueError(f"train.rollout_chunk: must be 1 .. sampling.max_new_tokens ({sampling.max_new_tokens}) "
                         f"with train.partial_rollouts=true, got {train.rollout_chunk}")
    if routing.replays or routing.compare:
        raise ValueError(f"train.partial_rollouts=true with routing={routing.name}"
                         f"{' compare=true' if routing.compare else ''}: a continued response's experts are "
                         "recomputed with the new weights, so the sampler's cannot be carried over a sync to replay "
                         "(allowed: routing=none with compare=false)")
    if algo is not None and algo.max_sampling_rounds:
        raise ValueError(f"train.partial_rollouts=true with algo.max_sampling_rounds={algo.max_sampling_rounds}: "
                         "refilling dropped groups needs each batch's rewards when it is sampled, which a partial batch "
                         "has only when it is due (allowed: algo.max_sampling_rounds=0)")
