"""The sampler interface: prompts (token ids) in; response ids, sampled-token log-probs, finish reasons out
(`Rollouts`, rlmm/policy/rollouts.py, which also defines the log-probs every engine reports).
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from rlmm.policy.rollouts import Rollouts


class Sampler(Protocol):
    """What every engine provides. `actual_precision` records what the engine really runs in; `calls`
    counts sampling (non-greedy) generate calls (their seeds derive from it; a checkpoint saves and
    restores it; greedy calls draw nothing and are not counted, so ranks that evaluate and ranks that do
    not stay in step); `needs_weights`: the engine dropped its weights (vLLM's sleep level 2) and the
    next generate needs a weight sync even when the trainer's weights did not change."""

    actual_precision: dict[str, str]
    calls: int
    needs_weights: bool

    def generate(self, prompt_ids: list[list[int]], *, n: int = 1, greedy: bool = False,
                 request_ids: list[int] | None = None, max_new_tokens: int | None = None) -> Rollouts:
        """n samples per prompt (grouped: all samples of prompt 0 first). Greedy ignores temperature.
        `max_new_tokens`: this call's cap on each response (None: `sampling.max_new_tokens`), for a partial rollout's
        chunk (rlmm/run/partial_rollouts.py): a response stopped by it reports "length".
        `request_ids`: each prompt's place in the step (its index before the step's prompts were split over
        the ranks; default 0, 1, ...): an engine that seeds each request draws from (seed, call, place), so
        no two requests of a step share their random numbers and the split over ranks changes nothing."""
        ...

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Replace the engine's weights in place with a Hugging Face-named state dict."""
        ...

    def prefill_logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[torch.Tensor]:
        """The engine's log-prob of each response token given its prompt and the response before it, all
        positions in one forward (prefill) instead of one decode step each: the engine against its own decoding
        (`rlmm probe`'s decode_vs_prefill). Untempered (raw logits): equal to the decode's processed log-probs
        only when sampling is untempered too."""
        ...

    @staticmethod
    def unsupported(precision) -> str | None:
        """Why this machine cannot run `precision` (a SidePrecision) on this engine, or None: asked by the CLI
        before a run or a sweep starts."""
        ...

    @staticmethod
    def refused_model(config: dict, dtype: torch.dtype) -> str | None:
        """What of the model (its config.json values, `known_config` of the model option) this engine cannot sample
        in `dtype` on this machine, in one line naming the value and what runs, or None: asked before a run starts
        (a built-in model before it is built) and again when the engine starts."""
        ...

    @staticmethod
    def refused_here(quantization, kv_cache_dtype: str) -> str | None:
        """What of `quantization` (a rlmm/policy/quantization.py mode) and a KV cache of `kv_cache_dtype` ("auto":
        the sampler's dtype) this engine cannot run on this machine whatever the model, in one line naming the
        value, the machine's reason and what runs, or None: asked before a run or a sweep starts (on the node a
        SLURM job runs on, when it starts)."""
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


def request_seed(seed: int, call: int, request: int) -> int:
    """The seed of one request: a 56-bit hash of (run seed, sampling call, the request's place in the step),
    so requests of one step, of two steps or of two ranks never share a stream (an engine seeds the n
    samples of a request with seed, seed + 1, ..., which stays below 2^63)."""
    digest = hashlib.blake2b(f"rlmm/{seed}/{call}/{request}".encode(), digest_size=7).digest()
    return int.from_bytes(digest, "big")


def engine_seed(seed: int, rank: int) -> int:
    """An engine's own seed on `rank` (its generator for unseeded requests; vLLM also reseeds the
    process's torch, numpy and random generators with it): the run's seed on rank 0, another on every
    other rank, so ranks never draw the same engine-wide stream."""
    return seed if rank == 0 else request_seed(seed, -1, rank) % 2**31


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{alias: canonical} for every parameter name of `model` that shares its Parameter with an earlier name
    (a tied LM head: {"lm_head.weight": "model.embed_tokens.weight"})."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        canonical = first.setdefault(id(param), name)
        if canonical != name:
            aliases[name] = canonical
    return aliases


def refuse_dropped_ties(named: Iterable[tuple[str, torch.Tensor]], aliases: dict[str, str],
                        engine: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights as they come, checking that each pair of names the engine ties (`aliases`) arrives
    with equal values: an engine holds one tensor for both, so a trainer that trains them apart (an fp32
    head unties a tied one) would see one of them dropped, silently (vLLM skips a tied alias at debug log
    level). Holds the first of a pair until its twin arrives (one extra tensor, the size of the embedding)."""
    partner = {**aliases, **{canonical: alias for alias, canonical in aliases.items()}}
    waiting: dict[str, torch.Tensor] = {}
    for name, tensor in named:
        twin = partner.get(name)
        if twin is not None:
            if twin in waiting:
                first = waiting.pop(twin)
                if first is not tensor and not torch.equal(first, tensor.to(first.device)):
                    raise ValueError(f"{engine}: the trainer sent '{name}' and '{twin}' with different values, "
                                     f"but the engine ties them and would keep only one (an fp32 LM head unties a "
                                     f"tied one: build the sampler with untie_head)")
            else:
                waiting[name] = tensor
        yield name, tensor
