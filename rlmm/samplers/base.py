"""The sampler interface: prompts (token ids) in; response ids, sampled-token log-probs, finish reasons out.

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
from typing import Protocol

import torch

LOGPROB_MODES = ("processed", "raw")


@dataclass
class SamplingOptions:
    """How tokens are drawn (the `sampling:` node of the config; its values live in conf/).

    Args:
        temperature: softmax temperature T (> 0; greedy decoding is a separate call option).
        top_p: nucleus mass kept (1.0: off).
        top_k: number of most likely tokens kept (0: off).
        max_new_tokens: response length cap.
        logprobs: "processed" or "raw" (see module docstring).
    """

    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    logprobs: str

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


@dataclass
class Rollouts:
    """Sampled responses, one entry per (prompt, sample); ragged lists, not padded."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    sampler_logprobs: list[torch.Tensor]  # float32, one value per response token
    finish_reasons: list[str]  # "stop" (end-of-sequence sampled) or "length" (hit max_new_tokens)
    info: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.response_ids)

    def padded_sampler_logprobs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T] float32 log-probs and [B, T] bool mask, right-padded."""
        return pad_right(self.sampler_logprobs)

    def select(self, rows: list[int]) -> Rollouts:
        """The rollouts of `rows`, in that order."""
        return Rollouts([self.prompt_ids[i] for i in rows], [self.response_ids[i] for i in rows],
                        [self.sampler_logprobs[i] for i in rows], [self.finish_reasons[i] for i in rows])

    @staticmethod
    def concat(parts: list[Rollouts]) -> Rollouts:
        return Rollouts(*(sum((getattr(p, name) for p in parts), []) for name in
                          ("prompt_ids", "response_ids", "sampler_logprobs", "finish_reasons")))


def pad_right(rows: list[torch.Tensor], value: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), value, dtype=torch.float32)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r.float()
        mask[i, :len(r)] = True
    return out, mask


class Sampler(Protocol):
    """What every engine provides. `actual_precision` records what the engine really runs in; `calls`
    counts generate calls (their seeds derive from it; a checkpoint saves and restores it)."""

    actual_precision: dict[str, str]
    calls: int

    def generate(self, prompt_ids: list[list[int]], *, n: int = 1, greedy: bool = False) -> Rollouts:
        """n samples per prompt (grouped: all samples of prompt 0 first). Greedy ignores temperature."""
        ...

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Replace the engine's weights in place with a Hugging Face-named state dict."""
        ...

    @staticmethod
    def unsupported(precision) -> str | None:
        """Why this machine cannot run `precision` (a SidePrecision) on this engine, or None: asked by the CLI
        before a run or a sweep starts."""
        ...

    def sleep(self) -> None:
        """Release accelerator memory the trainer needs until the next generate or load_weights (vLLM's
        sleep mode on CUDA; a no-op where there is nothing to release)."""
        ...

    def close(self) -> None:
        """Release the engine (memory, process groups) so another can start in this process."""
        ...


def truncate_at_eos(token_ids: list[int], eos_ids: set[int]) -> tuple[list[int], str]:
    """Cut a generated sequence after its first end-of-sequence token (kept: it was sampled)."""
    for i, tok in enumerate(token_ids):
        if tok in eos_ids:
            return token_ids[:i + 1], "stop"
    return token_ids, "length"
