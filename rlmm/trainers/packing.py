"""How a minibatch's rows become micro-batches, and how one micro-batch becomes the model's input.

Micro-batches (`MicroBatching.split`):

- fixed size (`trainer.micro_batch_tokens: null`, the default): consecutive runs of
  `trainer.micro_batch_size` rows;
- token budget (`trainer.micro_batch_tokens: N`): the rows longest first (prompt + response tokens), cut
  into consecutive runs of at most N tokens (a row longer than N is a micro-batch of its own). Rows of
  similar length share a micro-batch (little padding), and a micro-batch's activations are bounded by N
  tokens rather than by its row count times its longest row.

How many micro-batches an optimizer step has is decided here and only here, per minibatch: the length of
`MicroBatching.split`'s answer (ceil(rows / micro_batch_size), or however many the token budget cuts).
Every trainer's update (`MinibatchUpdate.micro_batches`, rlmm/trainers/scoring.py) runs that many
backwards and steps after the last; no trainer is told a count beforehand (DeepSpeed's own
`gradient_accumulation_steps` is 1 and `DeepSpeedUpdate` marks the boundary itself).

The loss of each micro-batch is divided by the whole minibatch's normaliser (rlmm/run/step.py), so the
accumulated gradient is the minibatch's whatever the grouping: a token budget changes the update only by
the rounding of a different summation order.

Several ranks under a token budget: ZeRO-2/3 and FSDP run collectives inside every forward or backward,
so every rank must run the same number of micro-batches. The ranks agree on the largest count any of
them needs (one all-reduce, `agreed_count`); a rank that needs fewer splits its largest micro-batch (by
tokens) in two until it has as many, and halves of a micro-batch within the budget are within it too. A
micro-batch cannot be empty (every loss needs a row), so the count is capped at the fewest rows any rank
holds; where that cap binds (one rank's rows need more micro-batches than another rank has rows, e.g.
shares that differ by a group under a budget below two rows), that rank merges its smallest neighbours
and exceeds the budget, and says so once.

Padding-free forward (`trainer.padding_free: true`): the micro-batch's sequences concatenated into one row
[1, Σ L_i], position ids restarting at 0 at each sequence, and no attention mask. transformers reads the
restarts as packed sequences (`masking_utils.find_packed_sequence_indices`): sdpa and eager attention get a
block-diagonal causal mask (no token attends to another sequence), and flash-attention 2 (CUDA, 16-bit;
chosen by `use_varlen_attention`) its varlen kernel with `cu_seqlens` taken from the same position ids, so
no [Σ L, Σ L] mask exists. No position is padding, so none is computed.

Rows alone at one width (`row_width`, set by the app for the bitwise arm, `sampler=bitwise`:
rlmm/samplers/bitwise.py): every micro-batch is one row right-padded to the run's fixed width, whatever
`micro_batch_size` says, so the forward of a sequence has the same shapes whatever the rows beside it, their
lengths or the number of rows a step holds; the sampler decodes in that same layout. Padding-free packing and a
token budget change the shapes by design and are refused with it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from rlmm.models.hybrid import padding_free_refusal
from rlmm.models.transformers_internals import attention_implementation
from rlmm.policy.rollouts import NO_ROUTE, KeptTokens
from rlmm.runtime.collectives import all_reduce_max

log = logging.getLogger(__name__)
_warned: set[str] = set()  # warnings already given in this process


def micro_batches(rows: list[int], size: int) -> list[list[int]]:
    """Consecutive runs of `size` rows (the last may be shorter)."""
    if size < 1:
        raise ValueError(f"trainer.micro_batch_size: must be >= 1, got {size}")
    return [rows[i:i + size] for i in range(0, len(rows), size)]


class Batch(NamedTuple):
    """One micro-batch as the model takes it, and where its response tokens' outputs sit.

    Padded: `ids` [b, L] right-padded, `attention` [b, L], `positions` None, and only the trailing `keep`
    positions reach the head. Packed (padding-free): `ids` [1, Σ L_i], `attention` None, `positions`
    [1, Σ L_i] restarting at 0 at each sequence, `keep` 0 (every position). `index` [b, T]: where response
    token t of row i is predicted among the kept positions (packed: in the one row); `tokens` [b, T] the
    response tokens (0 past a row's response, as its index). `routing`: the experts an MoE model's forward is
    to send each position to, laid out like `ids` with [MoE layers, top-k] per position (NO_ROUTE at padding and
    where a row's routing was not captured: the model's own choice there; rlmm/mismatch/routing.py), or None."""

    ids: torch.Tensor
    attention: torch.Tensor | None
    positions: torch.Tensor | None
    keep: int
    index: torch.Tensor
    tokens: torch.Tensor
    routing: torch.Tensor | None = None
    rows: tuple[int, ...] | None = None  # the rollout rows the batch holds, in its row order (when known)
    kept: KeptTokens | None = None  # the sampler's kept sets of the [b, T] response positions (`KeptTokens.laid_out`)

    def row_lengths(self) -> list[int]:
        """Tokens (prompt + response) of each row, in the batch's row order."""
        if self.positions is None:
            return self.attention.sum(1).tolist()
        starts = (self.positions[0] == 0).nonzero().flatten().tolist() + [self.positions.size(1)]
        return [b - a for a, b in zip(starts, starts[1:])]

    def per_row(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """A [ids.numel(), ...] tensor of one value per input position (a router's choices) cut into each
        row's [its tokens, ...] (padding dropped)."""
        lengths = self.row_lengths()
        if self.positions is None:
            rows = flat.view(*self.ids.shape, *flat.shape[1:])
            return [rows[i, :n] for i, n in enumerate(lengths)]
        return list(flat.split(lengths))


def laid_out_routing(routing: list[torch.Tensor] | None, width: int | None) -> torch.Tensor | None:
    """Rows' [tokens, layers, k] expert ids as one model input: right-padded with NO_ROUTE to [rows, width,
    layers, k], or (width None: packed) concatenated to [1, Σ tokens, layers, k]."""
    if routing is None:
        return None
    if width is None:
        return torch.cat(routing)[None]
    out = torch.full((len(routing), width, *routing[0].shape[1:]), NO_ROUTE, dtype=routing[0].dtype)
    for i, row in enumerate(routing):
        out[i, :len(row)] = row
    return out


def padded_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int,
                 routing: list[torch.Tensor] | None = None, width: int | None = None) -> Batch:
    """`prompt + response` rows right-padded to the longest (or to `width`), so position ids are the plain 0..L-1
    the sampler used and padding only follows real tokens (causal attention never looks at it). `routing`: each
    row's experts to replay ([its tokens, layers, k]), or None."""
    full = [p + r for p, r in zip(prompts, responses)]
    longest = max(map(len, full))
    if width is not None and longest > width:
        raise ValueError(f"a row of {longest} tokens does not fit the fixed width of {width}")
    width = longest if width is None else width
    ids = torch.tensor([row + [pad_id] * (width - len(row)) for row in full])
    attention = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in full])
    # Logits at position t predict token t+1: response token j of row i is predicted at
    # len(prompt_i) - 1 + j. Keep enough trailing positions to cover the earliest of them.
    keep = width - min(len(p) for p in prompts) + 1
    first = [len(p) - 1 - (width - keep) for p in prompts]
    index, tokens = _response_index(first, responses)
    return Batch(ids, attention, None, keep, index, tokens, laid_out_routing(routing, width))


def packed_batch(prompts: list[list[int]], responses: list[list[int]],
                 routing: list[torch.Tensor] | None = None) -> Batch:
    """The rows concatenated into one row [1, Σ L_i] with per-sequence position ids (padding-free)."""
    full = [p + r for p, r in zip(prompts, responses)]
    ids = torch.tensor([[token for row in full for token in row]])
    positions = torch.cat([torch.arange(len(row)) for row in full])[None]
    starts = [0]
    for row in full[:-1]:
        starts.append(starts[-1] + len(row))
    index, tokens = _response_index([s + len(p) - 1 for s, p in zip(starts, prompts)], responses)
    return Batch(ids, None, positions, 0, index, tokens, laid_out_routing(routing, None))


def _response_index(first: list[int], responses: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, T] positions first_i, first_i + 1, ... of each response's tokens, and the tokens (0-padded)."""
    length = max(len(r) for r in responses)
    index = torch.zeros(len(responses), length, dtype=torch.long)
    tokens = torch.zeros(len(responses), length, dtype=torch.long)
    for i, (start, response) in enumerate(zip(first, responses)):
        index[i, :len(response)] = torch.arange(start, start + len(response))
        tokens[i, :len(response)] = torch.tensor(response, dtype=torch.long)
    return index, tokens


def token_budget_groups(lengths: list[int], budget: int) -> list[list[int]]:
    """Positions into `lengths`, longest first (ties in order), cut into consecutive runs of at most
    `budget` tokens; a length above the budget is a run of its own."""
    groups: list[list[int]] = []
    total = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups and total + lengths[i] <= budget:
            groups[-1].append(i)
            total += lengths[i]
        else:
            groups.append([i])
            total = lengths[i]
    return groups


def resized_groups(groups: list[list[int]], lengths: list[int], count: int) -> list[list[int]]:
    """`groups` made `count` long (1 <= count <= number of positions): the group with the most tokens (of
    two or more positions) split where its two halves' tokens are closest, or the adjacent pair with the
    fewest tokens together merged, until there are `count`. A split never exceeds a budget the groups kept."""
    groups = [list(g) for g in groups]

    def tokens(group: list[int]) -> int:
        return sum(lengths[i] for i in group)

    while len(groups) < count:
        at = max((i for i, g in enumerate(groups) if len(g) > 1), key=lambda i: tokens(groups[i]))
        group = groups[at]
        prefix = [tokens(group[:k]) for k in range(1, len(group))]
        cut = 1 + min(range(len(prefix)), key=lambda k: abs(2 * prefix[k] - tokens(group)))
        groups[at:at + 1] = [group[:cut], group[cut:]]
    while len(groups) > count:
        at = min(range(len(groups) - 1), key=lambda i: tokens(groups[i]) + tokens(groups[i + 1]))
        groups[at:at + 2] = [groups[at] + groups[at + 1]]
    return groups


def agreed_count(count: int, rows: int) -> int:
    """The micro-batch count every rank runs: the largest `count` of any rank, at most the fewest `rows` any
    rank holds (one all-reduce; `count` itself with one rank)."""
    values = all_reduce_max(torch.tensor([count, -rows], dtype=torch.long))
    return min(int(values[0]), -int(values[1]))


def use_varlen_attention(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> str:
    """For the padding-free forward: flash-attention 2 (its varlen kernel, sequences from the position ids)
    on CUDA in 16 bits when the `flash_attn` package is installed; otherwise the model's attention as it is
    (sdpa on CPU: a block-diagonal causal mask built from the position ids). Returns the one in use.
    Not run on this project's CPU machines (no GPU): the flash path is as transformers documents it. A hybrid model's
    recurrent layers cannot be packed: a one-line ValueError (rlmm/models/hybrid.py `padding_free_refusal`)."""
    from transformers.utils import is_flash_attn_2_available

    refusal = padding_free_refusal(model.config)
    if refusal:
        raise ValueError(refusal)

    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and is_flash_attn_2_available():
        model.set_attn_implementation("flash_attention_2")
    return attention_implementation(model)


@dataclass(frozen=True)
class MicroBatching:
    """How a trainer cuts rows into micro-batches and lays each out for the forward (module docstring).

    Args:
        size: rows per micro-batch (`trainer.micro_batch_size`), when `tokens` is None.
        tokens: the token budget of a micro-batch (`trainer.micro_batch_tokens`; None: fixed size).
        padding_free: one packed row per micro-batch instead of padded rows (`trainer.padding_free`).
        row_width: every micro-batch one row right-padded to this many tokens (the bitwise arm; module
            docstring), or None.
    """

    size: int
    tokens: int | None
    padding_free: bool
    row_width: int | None = None

    def __post_init__(self):
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"trainer.micro_batch_size: must be >= 1, got {self.size}")
        if self.tokens is not None and (isinstance(self.tokens, bool) or not isinstance(self.tokens, int)
                                        or self.tokens < 1):
            raise ValueError(f"trainer.micro_batch_tokens: must be null (off) or a token count >= 1, "
                             f"got {self.tokens!r}")
        if not isinstance(self.padding_free, bool):
            raise ValueError(f"trainer.padding_free: must be true or false, got {self.padding_free!r}")
        if self.row_width is not None:
            for key, value, off in (("padding_free", self.padding_free, False), ("micro_batch_tokens", self.tokens, None)):
                if value != off:
                    raise ValueError(f"trainer.{key}={value}: sampler=bitwise scores each row alone at one width, so "
                                     f"the layout is not the trainer's to choose (allowed: "
                                     f"trainer.{key}={'false' if off is False else 'null'})")

    def sized(self, size: int | None) -> MicroBatching:
        """Fixed micro-batches of `size` rows (no token budget), or these settings when `size` is None (or the rows
        are laid out alone at `row_width`)."""
        return self if size is None or self.row_width is not None else replace(self, size=size, tokens=None)

    def split(self, lengths: list[int], rows: list[int]) -> list[list[int]]:
        """`rows` (of tokens `lengths`, one per row) as micro-batches: the one answer to how many
        micro-batches an update has (module docstring). Under a token budget a collective: every rank calls
        it together and gets the same count."""
        if self.row_width is not None:
            return [[row] for row in rows]
        if self.tokens is None:
            return micro_batches(rows, self.size)
        groups = token_budget_groups(lengths, self.tokens)
        count = agreed_count(len(groups), len(rows))
        if count < len(groups) and "cap" not in _warned:
            _warned.add("cap")
            log.warning("trainer.micro_batch_tokens: this rank's %d rows need %d micro-batches of %d tokens, but "
                        "another rank holds only %d rows, so the ranks run %d and some exceed the budget",
                        len(rows), len(groups), self.tokens, count, count)
        return [[rows[i] for i in group] for group in resized_groups(groups, lengths, count)]

    def batch(self, prompts: list[list[int]], responses: list[list[int]], pad_id: int,
              routing: list[torch.Tensor] | None = None) -> Batch:
        if self.padding_free:
            return packed_batch(prompts, responses, routing)
        return padded_batch(prompts, responses, pad_id, routing, width=self.row_width)

    def positions(self, lengths: list[int]) -> int:
        """Positions the forward of a micro-batch of rows of `lengths` tokens computes (padding included)."""
        if self.padding_free:
            return sum(lengths)
        return len(lengths) * (self.row_width or max(lengths))
