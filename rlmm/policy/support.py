"""The trainer's support (`support=`): which tokens π_old and π_θ are normalised over when the sampler truncates.

A sampler with top-k or top-p draws y from its kept set K_S and reports its processed log-prob

    log μ(y) = z_S(y) - logsumexp_{v in K_S} z_S(v),    z = logits / T,

so μ renormalises over K_S. The trainer's log-prob of the same token depends on the set it normalises over:

    sampler   (Keep Sampling Mask, DeepSeek-V3.2 §3.1): K_S itself, sent with the rollout (`Rollouts.kept_tokens`):
              log π(y) = z(y) - logsumexp_{K_S} z. π_old, π_θ, the entropy and every term built from them share
              the sampler's support, so the ratio carries the kernels' mismatch alone.
    trainer   its own top-k / top-p set K_T from its own logits, with y added where it fell outside (the sampler's
              boundary and the trainer's differ by the kernels' rounding): log π(y) = z(y) - logsumexp_{K_T ∪ {y}} z.
              Before this module, a y outside K_T got -inf and the whole step was skipped (issue 48).
    full      the whole vocabulary: log π(y) = z(y) - logsumexp_V z = log π_sampler-set(y) + log S, with
              S = Σ_{v in K_S} softmax(z)_v the trainer's mass on the sampler's kept set: the ratio π/μ carries
              the bias S < 1 on every token, as frameworks that score the full vocabulary after a truncated
              sampler have it (TRL #6789, verl #6240, prime-rl #2600).

With `sampling.logprobs=raw` both sides report untempered, untruncated log-probs and the support has no part: the
sampler and trainer modes refuse a truncating sampler there (`check`), `full` is what raw means.

A kept set larger than `max_kept` is capped by the sampler (its most likely `max_kept` tokens and the sampled one:
vLLM lists top-K processed log-probs, prime-rl PR #3235 caps at 512); the trainer then normalises over a subset of
K_S, biasing that token's ratio by log(S_capped / S) <= 0. Capped positions are counted (`support/frac_capped`).
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from rlmm.policy.logprobs import kept_by_truncation
from rlmm.runtime.collectives import rows_of_every_rank

# The columns of `statistics`, one row per scored position.
STATISTICS = ("position", "capped", "kept_size_sampler", "kept_size_trainer", "kept_mass_sampler_set",
              "kept_mass_trainer_set", "outside_trainer_set", "jaccard", "logprob_sampler_set", "logprob_trainer_set",
              "logprob_full")


class TokenSupport:
    """What every support option shares: the cap on the sampler's kept set, and the refusal of raw log-probs
    where the option would have no part. An option is a subclass with `restrict`."""

    needs_kept_tokens = False  # the trainer normalises over the sampler's kept set

    def __init__(self, max_kept: int):
        if not (isinstance(max_kept, int) and max_kept >= 1):
            raise ValueError(f"support.max_kept: a count of tokens >= 1, got {max_kept!r}")
        self.max_kept = max_kept

    @property
    def name(self) -> str:
        return type(self).__name__.removesuffix("Support").lower()

    def check(self, sampling) -> None:
        """One line for a combination with `sampling:` this option cannot mean anything in."""
        if sampling.logprobs == "raw" and sampling.truncates:
            raise ValueError(f"support={self.name}: it sets the tokens the trainer's processed log-probs are "
                             f"normalised over, but sampling.logprobs=raw scores the untruncated distribution on both "
                             f"sides (with raw: support=full; or sampling.logprobs=processed)")

    def restrict(self, z: torch.Tensor, tokens: torch.Tensor, kept: torch.Tensor | None, options) -> torch.Tensor:
        """The trainer's tempered logits `z` [n, V] with -inf outside its support, for the sampled `tokens` [n]
        and, where the sampler truncated, its kept sets `kept` [n, V] (bool; None where it did not)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"support={self.name} (max_kept {self.max_kept})"


class SamplerSupport(TokenSupport):
    """Keep Sampling Mask (DeepSeek-V3.2, §3.1): the trainer normalises over the sampler's kept set. Rollouts that
    carry none though sampling truncates (greedy answers, which `train.attribution` scores) are normalised over the
    trainer's own set and the token, as `support=trainer`."""

    needs_kept_tokens = True

    def restrict(self, z, tokens, kept, options):
        if kept is None:
            return own_set(z, tokens, options)
        return z.masked_fill(~with_sampled(kept, tokens), float("-inf"))


class TrainerSupport(TokenSupport):
    """The trainer's own top-k / top-p set from its own logits, and the sampled token."""

    def restrict(self, z, tokens, kept, options):
        return own_set(z, tokens, options)


class FullSupport(TokenSupport):
    """The whole vocabulary, whatever the sampler kept."""

    def check(self, sampling) -> None:
        return None

    def restrict(self, z, tokens, kept, options):
        return z


def own_set(z: torch.Tensor, tokens: torch.Tensor, options) -> torch.Tensor:
    """`z` with -inf outside the trainer's own top-k / top-p set and the sampled `tokens`."""
    if not options.truncates:
        return z
    return z.masked_fill(~with_sampled(kept_by_truncation(z, options), tokens), float("-inf"))


def with_sampled(kept: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[n, V] `kept` with each position's sampled token added."""
    kept = kept.clone()
    kept[torch.arange(kept.size(0), device=kept.device), tokens] = True
    return kept


@torch.no_grad()
def statistics(z: torch.Tensor, tokens: torch.Tensor, kept: torch.Tensor, capped: torch.Tensor,
               options) -> torch.Tensor:
    """[n, len(STATISTICS)] per position of the trainer's tempered logits `z`, the sampled `tokens` and the sampler's
    kept sets `kept` (a position with an empty set is padding: its `position` column 0, every other 0). With
    p = softmax(z) over the vocabulary, K_S the sampler's set (with y), K_T the trainer's own (top-k/top-p of z):
    |K_S|, |K_T|, S = Σ_{K_S} p, Σ_{K_T} p, [y ∉ K_T], |K_S ∩ K_T| / |K_S ∪ K_T|, and log π(y) normalised over K_S,
    over K_T ∪ {y} and over the vocabulary."""
    valid = kept.any(-1)
    sampler_set = with_sampled(kept, tokens) & valid[:, None]
    trainer_set = kept_by_truncation(z, options)
    log_p = z.log_softmax(-1)
    p = log_p.exp()
    rows = torch.arange(z.size(0), device=z.device)
    log_p_y = log_p[rows, tokens]
    own = with_sampled(trainer_set, tokens)
    columns = torch.stack([
        valid.float(), capped.float(), sampler_set.sum(-1).float(), trainer_set.sum(-1).float(),
        (p * sampler_set).sum(-1), (p * trainer_set).sum(-1), (~trainer_set[rows, tokens]).float(),
        (sampler_set & trainer_set).sum(-1) / (sampler_set | trainer_set).sum(-1).clamp(min=1),
        log_p_y - log_p.masked_fill(~sampler_set, float("-inf")).logsumexp(-1),
        log_p_y - log_p.masked_fill(~own, float("-inf")).logsumexp(-1),
        log_p_y], -1)
    return torch.where(valid[:, None], columns, torch.zeros_like(columns))


class SupportRecord:
    """The statistics of every scored position of the rows a trainer scored while recording (`recording`), by
    rollout row: `rows()` gives each row's [its response tokens, len(STATISTICS)]."""

    def __init__(self):
        self.by_row: dict[int, torch.Tensor] = {}

    def add(self, rows: tuple[int, ...], columns: torch.Tensor) -> None:
        """`columns` [b, T, C] of a micro-batch holding rollout rows `rows` in that order."""
        for row, values in zip(rows, columns.detach().float().cpu()):
            self.by_row[row] = values[values[:, 0] > 0]

    def padded(self, num_rows: int) -> torch.Tensor | None:
        """[num_rows, T, C] right-padded with zeros (a position column of 0 is padding), or None when nothing was
        recorded (the sampler did not truncate)."""
        if not self.by_row:
            return None
        width = max(len(v) for v in self.by_row.values())
        out = torch.zeros(num_rows, width, len(STATISTICS))
        for row, values in self.by_row.items():
            out[row, :len(values)] = values
        return out


@contextmanager
def recorded(model: torch.nn.Module):
    """Inside, every scoring forward of `model`'s output head (rlmm/models/head.py's OutputHead) over rollouts that
    carry kept sets files its per-position statistics into the `SupportRecord` this yields."""
    record, head = SupportRecord(), model.get_output_embeddings()
    head.support_record = record
    try:
        yield record
    finally:
        head.support_record = None


def support_metrics(record: SupportRecord, sampler_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """support/* of a step or a probe (docs/metrics.md#the-trainers-support-support) from what the trainer recorded
    while scoring this rank's rows (`recorded`): token means over every rank's response tokens (`mask` [B, T]) against
    the sampler's log-probs [B, T]; {} where the sampler did not truncate (a collective where it did)."""
    padded = record.padded(mask.size(0))
    if padded is None:
        return {}
    width = mask.size(1)
    padded = torch.nn.functional.pad(padded[:, :width], (0, 0, 0, width - min(width, padded.size(1))))
    sampler_logprobs, mask, *columns = rows_of_every_rank(sampler_logprobs, mask,
                                                          *(padded[..., i] for i in range(len(STATISTICS))))
    return statistics_means(torch.stack(columns, -1), sampler_logprobs, mask)


def statistics_means(record: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The token means of `record` [B, T, C] over `mask` [B, T] (and the positions recorded), against the sampler's
    log-probs [B, T]."""
    keep = mask & (record[..., STATISTICS.index("position")] > 0)
    if not keep.any():
        return {}
    column = {name: record[..., i][keep] for i, name in enumerate(STATISTICS)}
    mu = sampler_logprobs[keep]
    out = {name: column[name].mean().item() for name in ("kept_size_sampler", "kept_size_trainer",
                                                         "kept_mass_sampler_set", "kept_mass_trainer_set",
                                                         "jaccard")}
    out["log_kept_mass_sampler_set"] = column["kept_mass_sampler_set"].clamp(min=1e-30).log().mean().item()
    out["frac_outside_trainer_set"] = column["outside_trainer_set"].mean().item()
    out["frac_capped"] = column["capped"].mean().item()
    for normalised in ("sampler_set", "trainer_set", "full"):
        delta = column[f"logprob_{normalised}"] - mu
        out[f"{normalised}/logprob_diff_mean"] = delta.mean().item()
        out[f"{normalised}/logprob_abs_diff_mean"] = delta.abs().mean().item()
    return {k: v if math.isfinite(v) else math.nan for k, v in out.items()}
