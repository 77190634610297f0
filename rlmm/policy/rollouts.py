"""The records the sampler and the trainer share: how tokens are drawn (`SamplingOptions`), what a sampler hands
the trainer (`Rollouts`, with a truncating sampler's kept sets, `KeptTokens`) and the padding of its ragged rows.
Both sides import them from here; neither imports the other for them.

Every engine reports log-probs under one definition, chosen by `SamplingOptions.logprobs`:

- ``processed``: log-prob under the distribution tokens were actually drawn from: logits / T, then
  the top-k and top-p masks, renormalised. This is the behaviour policy PPO's importance ratio needs.
- ``raw``: log_softmax of the unmodified logits (no temperature, no truncation), which is what
  vLLM returns by default (``logprobs_mode=raw_logprobs``).

The trainer-side scorer (rlmm.scoring) applies the same definition, so the two sides compare like
with like; mixing them biases every ratio when T != 1 or a truncation is active.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

LOGPROB_MODES = ("processed", "raw")
# A (token, layer) whose routing was not captured: the trainer routes it itself (rlmm/mismatch/routing.py).
NO_ROUTE = -1


@dataclass
class SamplingOptions:
    """How tokens are drawn (the `sampling:` node of the config; its values live in conf/).

    Args:
        temperature: softmax temperature T (> 0; greedy decoding is a separate call option).
        top_p: nucleus mass kept (1.0: off).
        top_k: number of most likely tokens kept (0: off).
        max_new_tokens: response length cap.
        logprobs: "processed" or "raw" (see module docstring).
        support: (built by the app from `support=`, not a key of `sampling:`) which tokens the trainer normalises
            π_old and π_θ over when the sampler truncates (rlmm/policy/support.py: the sampler's kept set, the trainer's
            own, or the full vocabulary); its `max_kept` caps the kept set a truncating sampler returns per token.
    """

    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    logprobs: str
    support: object  # a rlmm/policy/support.py TokenSupport

    def __post_init__(self):
        if self.logprobs not in LOGPROB_MODES:
            raise ValueError(f"sampling.logprobs: unknown mode '{self.logprobs}' (allowed: {', '.join(LOGPROB_MODES)})")
        if not self.temperature > 0:
            raise ValueError(f"sampling.temperature: must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k: must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        self.support.check(self)

    def check_vocabulary(self, vocab: int | None) -> None:
        """A top-k above the model's vocabulary keeps every token: refused in one line (None: not known yet)."""
        if vocab is not None and self.top_k > vocab:
            raise ValueError(f"sampling.top_k: {self.top_k} is more than the model's vocabulary of {vocab} tokens "
                             f"(allowed: 0 = off, or 1 to {vocab})")

    @property
    def truncates(self) -> bool:
        """Whether sampling keeps fewer tokens than the vocabulary (top-k or top-p on)."""
        return self.top_p < 1.0 or self.top_k > 0

    @property
    def returns_kept_tokens(self) -> bool:
        """Whether a sampling (not greedy) call returns the kept set of each token (`Rollouts.kept_tokens`): where
        it truncates and reports processed log-probs (which are -inf outside it: how vLLM's listing shows it)."""
        return self.truncates and self.logprobs == "processed"


@dataclass
class KeptTokens:
    """The tokens a truncating sampler kept (its top-k / top-p set, the support it drew from) at each position of
    one response: position t's set is `ids[offsets[t]:offsets[t + 1]]`, always holding the sampled token. Indices,
    not a vocabulary-wide mask: 4 bytes a kept token (a bitmap would be V / 8 = 19 KB a token at 152k).
    `capped[t]`: the sampler listed at most `support.max_kept` tokens there and the set may be larger (its most
    likely `max_kept` tokens and the sampled one are kept)."""

    ids: torch.Tensor  # int32 [Σ sizes]
    offsets: torch.Tensor  # int64 [T + 1]
    capped: torch.Tensor  # bool [T]

    def __len__(self) -> int:
        return self.capped.numel()

    def sizes(self) -> torch.Tensor:
        return self.offsets.diff()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ids, self.offsets, self.capped))

    @classmethod
    def of_sets(cls, sets: list[list[int]], capped: list[bool]) -> KeptTokens:
        sizes = torch.tensor([len(s) for s in sets], dtype=torch.int64)
        return cls(ids=torch.tensor([t for s in sets for t in s], dtype=torch.int32),
                   offsets=torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)]),
                   capped=torch.tensor(capped, dtype=torch.bool))

    @classmethod
    def of_masks(cls, kept: torch.Tensor, tokens: torch.Tensor, logits: torch.Tensor, max_kept: int) -> KeptTokens:
        """From a [T, V] bool mask of each position's kept tokens, with each position's sampled token and the
        logits that rank them: a set larger than `max_kept` keeps its `max_kept` most likely tokens and the
        sampled one, and is marked capped."""
        kept = kept.clone()
        kept[torch.arange(kept.size(0)), tokens] = True  # the sampled token, whatever the sampler's set
        sizes = kept.sum(-1)
        capped = sizes > max_kept
        if capped.any():
            top = logits[capped].masked_fill(~kept[capped], float("-inf")).topk(max_kept, dim=-1).indices
            cut = torch.zeros_like(kept[capped]).scatter_(-1, top, True)
            cut[torch.arange(cut.size(0)), tokens[capped]] = True
            kept[capped] = cut
        rows, ids = kept.nonzero(as_tuple=True)
        counts = torch.bincount(rows, minlength=kept.size(0))
        return cls(ids=ids.to(torch.int32), offsets=torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]),
                   capped=capped)

    @staticmethod
    def joined(parts: list[KeptTokens]) -> KeptTokens:
        """One response's sets from its consecutive pieces (a partial rollout's chunks), in order."""
        sizes = torch.cat([part.sizes() for part in parts])
        return KeptTokens(ids=torch.cat([part.ids for part in parts]),
                          offsets=torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)]),
                          capped=torch.cat([part.capped for part in parts]))

    @staticmethod
    def laid_out(rows: list[KeptTokens], width: int) -> KeptTokens:
        """Rows' sets as one [len(rows) * width] layout, row-major (position t of row i at i * width + t; a
        position past a row's response holds an empty set): the positions of a micro-batch's [b, T] index."""
        ids, sizes, capped = [], [], []
        for row in rows:
            pad = width - len(row)
            ids.append(row.ids)
            sizes.append(torch.cat([row.sizes(), torch.zeros(pad, dtype=torch.int64)]))
            capped.append(torch.cat([row.capped, torch.zeros(pad, dtype=torch.bool)]))
        sizes = torch.cat(sizes) if sizes else torch.zeros(0, dtype=torch.int64)
        return KeptTokens(ids=torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int32),
                          offsets=torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)]),
                          capped=torch.cat(capped) if capped else torch.zeros(0, dtype=torch.bool))

    def mask(self, start: int, end: int, vocab: int, device=None) -> torch.Tensor:
        """[end - start, vocab] bool: the kept tokens of positions start..end-1."""
        lo, hi = int(self.offsets[start]), int(self.offsets[end])
        rows = torch.repeat_interleave(torch.arange(end - start), self.offsets[start + 1:end + 1] - self.offsets[start:end])
        out = torch.zeros(end - start, vocab, dtype=torch.bool, device=device)
        out[rows.to(device), self.ids[lo:hi].long().to(device)] = True
        return out


@dataclass
class Rollouts:
    """Sampled responses, one entry per (prompt, sample); ragged lists, not padded."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    sampler_logprobs: list[torch.Tensor]  # float32, one value per response token
    finish_reasons: list[str]  # "stop" (end-of-sequence sampled) or "length" (hit max_new_tokens)
    info: dict = field(default_factory=dict)
    # The experts a mixture-of-experts sampler routed each token to (None: not captured, or a dense model):
    # one int16 tensor per row, [len(prompt) + len(response), MoE layers, top-k], entry p the experts of the
    # forward whose *input* was token p (so the last response token, never fed back, and prompt tokens an
    # engine did not compute, e.g. prefix-cached ones, are NO_ROUTE: the trainer's own routing there).
    routed_experts: list[torch.Tensor] | None = None
    # The experts the trainer's forwards are to send each token to, laid out like `routed_experts` (None: the
    # trainer routes itself). Only `routing=` sets it (rlmm/mismatch/routing.py: r3 the sampler's, r2 π_old's own), so
    # rollouts straight from a sampler are never replayed by accident.
    replayed_experts: list[torch.Tensor] | None = None
    # The residual stream at every site (the embedding's output, each decoder layer's, the final norm's) as the
    # sampler computed it while sampling (None: not captured; `rlmm probe probe.layers=true` asks for it through
    # the engine's `capturing_layers`, rlmm/mismatch/layer_attribution.py): one [len(prompt) + len(response), sites, hidden]
    # tensor per row in the engine's dtype, laid out like `routed_experts`, NaN where the engine computed nothing.
    layer_states: list[torch.Tensor] | None = None
    # The tokens a truncating sampler kept at each response position (None: it did not truncate, or the rollouts
    # are greedy): one KeptTokens per row. The trainer's support (rlmm/policy/support.py) normalises over them.
    kept_tokens: list[KeptTokens] | None = None
    # The weight version that sampled each response token (None: not tracked, the synchronous run): one int64
    # tensor per row, [len(response)], version v being the weights after v updates. One value per row under
    # whole-response staleness; with `train.partial_rollouts` a response continued after a weight sync holds
    # several (rlmm/run/rollout_source.py).
    versions: list[torch.Tensor] | None = None
    # Which response tokens the policy sampled (None: all of them, a single-turn response): one bool tensor per row,
    # [len(response)]. A multi-turn conversation's response holds the environment's tokens between the policy's turns
    # (a tool's answer, the template's turn markers), which it did not sample: they are scored as context, never
    # trained on, never in the mismatch (their `sampler_logprobs` are 0). rlmm/conversation/.
    sampled: list[torch.Tensor] | None = None
    # A multi-turn conversation's record (None: single-turn): one dict per row, its messages, each turn's ids as the
    # sampler saw and produced them, the environment's replies and the token path's drift (rlmm/conversation/).
    conversations: list[dict] | None = None

    def __len__(self) -> int:
        return len(self.response_ids)

    def padded_sampler_logprobs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T] float32 log-probs and [B, T] bool mask of the tokens the policy sampled, right-padded (a
        multi-turn response's environment tokens are outside the mask, like padding)."""
        logprobs, mask = pad_right(self.sampler_logprobs)
        if self.sampled is not None:
            mask &= pad_right(self.sampled)[0].bool()
        return logprobs, mask

    def select(self, rows: list[int]) -> Rollouts:
        """The rollouts of `rows`, in that order."""
        return Rollouts(*([getattr(self, name)[i] for i in rows] for name in ROW_FIELDS),
                        **{name: None if getattr(self, name) is None else [getattr(self, name)[i] for i in rows]
                           for name in OPTIONAL_ROW_FIELDS})

    @staticmethod
    def concat(parts: list[Rollouts]) -> Rollouts:
        optional = {}
        for name in OPTIONAL_ROW_FIELDS:
            values = [getattr(p, name) for p in parts]
            if any(v is None for v in values) and not all(v is None for v in values):
                raise ValueError(f"Rollouts.concat: some parts carry {name} and some do not")
            optional[name] = None if not parts or values[0] is None else sum(values, [])
        return Rollouts(*(sum((getattr(p, name) for p in parts), []) for name in ROW_FIELDS), **optional)


ROW_FIELDS = ("prompt_ids", "response_ids", "sampler_logprobs", "finish_reasons")
# None, or one entry per row
OPTIONAL_ROW_FIELDS = ("routed_experts", "replayed_experts", "layer_states", "kept_tokens", "versions", "sampled",
                       "conversations")


def pad_right(rows: list[torch.Tensor], value: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), value, dtype=torch.float32)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r.float()
        mask[i, :len(r)] = True
    return out, mask
