"""The trainer's output projection: full logits when asked for them, or only what scoring needs, in chunks.

Scoring a sampled token needs log π(y_t) (and for the loss, the entropy H_t) at each response position,
not the [b, T, V] logits a causal LM returns: at a real vocabulary (V = 151,936) those are 2.5 GB in fp32
for 32 rows of 128 tokens, and every fp32 copy, log-softmax and softmax of them as much again, held for
the backward pass too. `OutputHead` takes the model's place as its `lm_head` (the same `weight`
Parameter, so names, tying, ZeRO partitioning and weight sync are untouched) and, while `aimed_at`
response positions and tokens, returns [b, T, 2] = (log π(y_t), H_t) instead of logits, computed
`chunk_size` positions at a time:

    z = W h_t  (fp32; for "processed" log-probs / temperature, and -inf outside the trainer's support:
               the sampler's kept set, the trainer's own top-k / top-p set, or nothing cut: rlmm/policy/support.py)
    log π(y_t) = z_y - logsumexp(z),     H_t = -Σ_v p_v log p_v = logsumexp(z) - Σ_v p_v z_v

Under autograd each chunk runs inside activation checkpointing, so its logits are recomputed in the
backward pass rather than kept: at most `chunk_size` x V logits (and their few fp32 temporaries) exist
at once, forward or backward. The cost is one more head projection per token in the backward.
Liger Kernel's fused linear cross-entropy and verl's chunked entropy do the same for the same reason;
TRL's `selective_log_softmax` gathers before the softmax but keeps the model's full logits.

With `fp32=True` it is the fp32 LM head of MiniMax-M1 (2025): its weight is a separate fp32 copy (which
unties a head tied to the input embedding) and the hidden state is upcast before the projection, so the
logits carry no 16-bit rounding from the head.

With `positions_alone` (the bitwise arm, `sampler=bitwise`: rlmm/samplers/bitwise.py) every position is projected
on its own from a fresh copy of its hidden state ([1, H], 64-byte aligned like any new tensor): a GEMM's result may
depend on its row count and its operands' alignment (MKL documents both), so a position's log-prob then has the
same bits whichever positions are scored beside it, and the sampler, which decodes one position at a time, computes
them with the same `score` on the same shapes.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rlmm.policy.logprobs import tempered
from rlmm.policy.rollouts import KeptTokens
from rlmm.policy.support import STATISTICS, SupportRecord, statistics


class OutputHead(nn.Module):
    """A bias-free output projection `logits = W h` that can also score chosen tokens in chunks.

    Args:
        weight: [V, H] the projection (kept as the same Parameter unless `fp32` asks for an fp32 copy).
        fp32: keep and apply the projection in fp32 whatever the body's dtype.
        chunk_size: positions whose full-vocabulary logits exist at once while scoring.
    """

    def __init__(self, weight: nn.Parameter, fp32: bool = False, chunk_size: int = 512):
        super().__init__()
        if chunk_size < 1:
            raise ValueError(f"trainer.logits_chunk_size: must be >= 1, got {chunk_size}")
        self.fp32 = fp32
        self.chunk_size = chunk_size
        if fp32:
            weight = nn.Parameter(weight.detach().to(torch.float32).clone(), requires_grad=weight.requires_grad)
        self.weight = weight
        self._aim = None
        self.positions_alone = False  # one position a projection, from its own copy (module docstring)
        self.support_record: SupportRecord | None = None  # set by rlmm/policy/support.py's `recorded`

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.fp32:
            hidden = hidden.to(torch.float32)
        return nn.functional.linear(hidden, self.weight)

    @contextmanager
    def aimed_at(self, index: torch.Tensor, tokens: torch.Tensor, options, entropy: bool,
                 kept: KeptTokens | None = None, rows: tuple[int, ...] | None = None):
        """While inside, a forward returns [b, T, 2] (log π(tokens), entropy; the entropy column is 0
        unless `entropy`) for the kept positions `index` [b, T] of each row instead of logits. `kept`: the
        sampler's kept sets of those positions (`KeptTokens.laid_out`, row-major over [b, T]) where it truncated;
        `rows`: the rollout rows the b rows are (for the support record)."""
        self._aim = (index, tokens, options, entropy, kept, rows)
        try:
            yield
        finally:
            self._aim = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._aim is None:
            return self.project(hidden)
        index, tokens, options, entropy, kept, batch_rows = self._aim
        index, tokens = index.to(hidden.device), tokens.to(hidden.device)
        rows, length = index.shape
        chosen = hidden.gather(1, index[..., None].expand(-1, -1, hidden.size(-1)))  # [b, T, H]
        flat_hidden, flat_tokens = chosen.reshape(rows * length, -1), tokens.reshape(-1)
        kept = kept if options.logprobs == "processed" else None  # raw log-probs: no support (rlmm/policy/support.py)
        chunks = []
        step = 1 if self.positions_alone else self.chunk_size
        for start in range(0, rows * length, step):
            end = min(start + step, rows * length)
            masks = kept.mask(start, end, self.weight.size(0), device=hidden.device) \
                if kept is not None and options.support.needs_kept_tokens else None
            chunk = flat_hidden[start:end].clone() if self.positions_alone else flat_hidden[start:end]
            args = (chunk, flat_tokens[start:end], masks)
            if torch.is_grad_enabled() and flat_hidden.requires_grad:
                chunks.append(checkpoint(self.score, *args, options, entropy, use_reentrant=False))
            else:
                chunks.append(self.score(*args, options, entropy))
        if self.support_record is not None and kept is not None and batch_rows is not None:
            self.support_record.add(batch_rows, self._statistics(flat_hidden, flat_tokens, kept, options)
                                    .view(rows, length, -1))
        if not chunks:
            return hidden.new_zeros(rows, length, 2, dtype=torch.float32)
        return torch.cat(chunks).view(rows, length, 2)

    @torch.no_grad()
    def _statistics(self, hidden: torch.Tensor, tokens: torch.Tensor, kept: KeptTokens, options) -> torch.Tensor:
        """rlmm/policy/support.py's per-position statistics of the trainer's distribution against the sampler's kept sets,
        chunk by chunk (no grad)."""
        parts = []
        for start in range(0, hidden.size(0), self.chunk_size):
            end = min(start + self.chunk_size, hidden.size(0))
            parts.append(statistics(tempered(self.project(hidden[start:end]), options), tokens[start:end],
                                    kept.mask(start, end, self.weight.size(0), device=hidden.device),
                                    kept.capped[start:end].to(hidden.device), options))
        return torch.cat(parts) if parts else hidden.new_zeros(0, len(STATISTICS), dtype=torch.float32)

    def score(self, hidden: torch.Tensor, tokens: torch.Tensor, kept: torch.Tensor | None, options,
              entropy: bool) -> torch.Tensor:
        """[n, 2] (log π(tokens), entropy or 0) of hidden states [n, H] and tokens [n], normalised over the
        support (`options.support.restrict`, given the sampler's kept sets `kept` [n, V] where the support needs
        them). What scoring computes of each chunk; the bitwise sampler's log-prob of its own draw, too."""
        logits = self.project(hidden)
        if options.logprobs == "processed":
            logits = options.support.restrict(tempered(logits, options), tokens, kept, options)
        else:
            logits = logits.float()
        normalizer = logits.logsumexp(-1)
        logprobs = logits.gather(-1, tokens[:, None])[:, 0] - normalizer
        if entropy:
            # H = logsumexp(z) - Σ_v p_v z_v over the support. Not Σ entr(p): where the support sets
            # z_v = -inf, p_v = 0 and entr'(0) = inf, so its gradient is inf x 0 = NaN.
            finite = torch.where(torch.isfinite(logits), logits, 0.0)
            ent = normalizer - ((logits - normalizer[:, None]).exp() * finite).sum(-1)
        else:
            ent = torch.zeros_like(logprobs)
        return torch.stack([logprobs, ent], -1)


def install_output_head(model: nn.Module, fp32: bool = False, chunk_size: int = 512,
                        fp32_weight: torch.Tensor | None = None, untie: bool = False) -> OutputHead:
    """Make `model`'s LM head an OutputHead (same weight Parameter; with `fp32`, an fp32 copy made from
    `fp32_weight` when given: the checkpoint's own fp32 values, not a 16-bit copy cast back up; with
    `untie`, a copy of its own in the body's dtype, so that a head trained apart from the input embedding
    can be loaded into it)."""
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("model: LM heads with a bias are not supported")
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError("model: final-logit soft-capping (e.g. Gemma 2) is not supported by rlmm's scoring")
    weight = head.weight
    if fp32 and fp32_weight is not None:
        weight = nn.Parameter(fp32_weight, requires_grad=weight.requires_grad)
    elif untie and not fp32 and weight is model.get_input_embeddings().weight:
        weight = nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
    new = OutputHead(weight, fp32=fp32, chunk_size=chunk_size)
    model.set_output_embeddings(new)
    if fp32 or untie:
        model.config.tie_word_embeddings = False
    return new
