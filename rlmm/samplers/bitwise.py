"""`sampler=bitwise`: the zero-mismatch control arm. The sampler's log-probs equal the trainer's to the bit on every
machine, whatever the rows' lengths, their padding or how either side groups them, because both sides compute every
log-prob with the same code on the same shapes.

Why shapes decide: a kernel's result is fixed by its inputs and its shapes (and alignment), not by the other rows'
values. What makes transformers' `generate` and the trainer differ is that they see a token in different shapes: the
sampler's prefill pads prompts to the batch's longest and decodes with a KV cache (a query of 1), the trainer scores
prompt + response padded to its micro-batch's longest, and a reduction over keys or over a GEMM's rows then runs in
another order (docs/precision.md, "Bitwise on-policy": ATen's CPU flash attention sums in 8- or 16-lane vectors with a
scalar tail; MKL's GEMMs depend on row count and alignment). The field removes that on GPUs with batch-invariant
kernels (Thinking Machines 2025; vLLM's `VLLM_BATCH_INVARIANT`, TorchTitan's RL mode). This arm removes it with
shapes instead, which any kernel honours:

- every forward of a sequence, on either side, is one row of W = (the run's longest prompt) + max_new_tokens + 1
  tokens, right-padded (W leaves one padding position, so transformers always builds the same kind of mask). The
  trainer lays each row out alone at W (rlmm/trainers/packing.py, `row_width`); this sampler decodes without a KV
  cache: token t is drawn from the forward of prompt + tokens < t padded to W. Causal attention makes position p's
  hidden state a function of positions <= p only, computed in the same shapes on both sides, so it has the same bits
  whatever follows it (the sampler's padding, the trainer's later tokens);
- the LM head projects each position alone from a fresh [1, H] copy (`OutputHead.positions_alone`), and the
  reported log-prob is `OutputHead.score` of that projection: the trainer's own computation of log π(y).

The token is drawn from softmax of the same processed logits (temperature, top-k, top-p: rlmm/policy/logprobs.py),
each request's samples from their own seeded generator (seed, call, the request's place, the sample), so a row's
draws do not depend on the batch it came in. The cost is compute: a response of T tokens takes T forwards of W
positions instead of one prefill and T single-token steps (README's figures, `benchmarks/bitwise.py`).

A step that is not bitwise is an error naming the first differing token (rlmm/run/step.py), never a silent mismatch.
What the arm cannot keep bitwise is refused before any engine starts (`check_bitwise_arm`).
"""
from __future__ import annotations

import torch

from rlmm.mismatch.routing import RoutingReplay
from rlmm.policy.logprobs import kept_by_truncation, tempered
from rlmm.policy.precision import SidePrecision
from rlmm.policy.quantization import NoQuantization, QuantizationMode
from rlmm.policy.rollouts import KeptTokens, Rollouts, SamplingOptions
from rlmm.samplers.base import request_seed, truncate_at_eos
from rlmm.samplers.hf import HFSampler

def row_width(prompt_tokens: int, max_new_tokens: int) -> int:
    """W: the longest prompt, the longest response and one padding position (module docstring)."""
    return prompt_tokens + max_new_tokens + 1


def bitwise_row_width(sampler_cfg, prompt_tokens: int, max_new_tokens: int) -> int | None:
    """The width the trainer lays every row out at when the sampler is this arm's (`trainer`'s `row_width`), else
    None."""
    return row_width(prompt_tokens, max_new_tokens) if is_bitwise(sampler_cfg) else None


def is_bitwise(sampler_cfg) -> bool:
    """Whether the sampler config builds this arm (its `_target_`'s class, wherever the class is named from)."""
    from hydra.utils import get_class

    return issubclass(get_class(sampler_cfg._target_), BitwiseSampler)


class BitwiseSampler:
    """Decode one row at a time at the run's fixed width W, no KV cache, with the trainer's head computation
    (module docstring). The model, its precision, the weight syncs and the tokenizer are transformers', as
    `sampler=hf` holds them (an `HFSampler` this one decodes with).

    Args:
        prompt_tokens: (set by the app) the run's longest prompt, which sizes W; a longer prompt is refused.
        untie_head, quantization, max_rows: (set by the app) as for `sampler=hf`: a quantized mode is emulated in
            transformers' forward (rlmm/samplers/quantize.py), which the trainer shares with `trainer.fake_quantize`
            (rlmm/trainers/fake_quantization.py): both sides then multiply with the same dequantize(quantize(W)) and
            round the same inputs; without it, refused by `check_bitwise_arm` before this is built.
        capture_routing: (set by the app) ignored: an MoE model's experts are the trainer's own to the bit, so none
            are returned and the run logs no routing/ keys; a replay (r2, r3) is refused by `check_bitwise_arm`.
    """

    needs_weights = False

    def __init__(self, model_path: str, precision: SidePrecision, sampling: SamplingOptions, seed: int,
                 prompt_tokens: int, max_rows: int | None = None, untie_head: bool = False,
                 capture_routing: bool = False, quantization: QuantizationMode = NoQuantization()):
        self.engine = HFSampler(model_path, precision, sampling, seed, batch_size=1, perturb=0.0,
                                untie_head=untie_head, quantization=quantization)
        self.sampling, self.seed, self.calls = sampling, seed, 0
        self.width = row_width(prompt_tokens, sampling.max_new_tokens)
        self.model = self.engine.model
        self.head = self.model.get_output_embeddings()
        self.head.positions_alone = True
        self.actual_precision = dict(self.engine.actual_precision,
                                     layout=f"one row of {self.width} tokens a forward, no KV cache (sampler=bitwise)")

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], *, n: int = 1, greedy: bool = False,
                 request_ids: list[int] | None = None, max_new_tokens: int | None = None) -> Rollouts:
        places = list(range(len(prompt_ids))) if request_ids is None else request_ids
        call = self.calls
        if not greedy:
            self.calls += 1
        kept = self.sampling.returns_kept_tokens and not greedy
        out = Rollouts([], [], [], [], kept_tokens=[] if kept else None)
        for prompt, place in zip(prompt_ids, places):
            # a partial rollout's continuation (prompt + its tokens so far) fits as its whole response did
            if len(prompt) + (max_new_tokens or self.sampling.max_new_tokens) >= self.width:
                raise ValueError(f"sampler=bitwise: a prompt of {len(prompt)} tokens is longer than the run's longest "
                                 f"({self.width - self.sampling.max_new_tokens - 1}), which fixed the row width")
            for sample in range(n):
                generator = None if greedy else \
                    torch.Generator().manual_seed(request_seed(self.seed, call, place) + sample)
                self._decode(list(prompt), generator, out, max_new_tokens or self.sampling.max_new_tokens)
        return out

    def _decode(self, prompt: list[int], generator: torch.Generator | None, out: Rollouts, max_new_tokens: int) -> None:
        """One response of at most `max_new_tokens`: each token drawn from the forward of the row so far at width W
        (None: greedy)."""
        options = self.sampling
        tokens, logprobs, masks, tempered_logits = [], [], [], []
        while len(tokens) < max_new_tokens:
            hidden = self._last_hidden(prompt + tokens)
            logits = self.head.project(hidden)
            if generator is None:  # greedy: the untempered distribution's log-prob, as sampler=hf reports
                token = logits.argmax(-1)
                logprobs.append(logits.float().log_softmax(-1)[0, token[0]])
            else:
                z = tempered(logits, options)
                kept = kept_by_truncation(z, options) if options.truncates else None
                masked = z if kept is None else z.masked_fill(~kept, float("-inf"))
                token = torch.multinomial((masked - masked.logsumexp(-1, keepdim=True)).exp(), 1,
                                          generator=generator)[:, 0]
                support = kept if kept is not None and options.logprobs == "processed" and \
                    options.support.needs_kept_tokens else None
                logprobs.append(self.head.score(hidden, token, support, options, entropy=False)[0, 0])
                if out.kept_tokens is not None:
                    masks.append(kept[0])
                    tempered_logits.append(z[0])
            tokens.append(int(token[0]))
            if tokens[-1] in self.engine.eos_ids:
                break
        response, reason = truncate_at_eos(tokens, self.engine.eos_ids)
        out.prompt_ids.append(prompt)
        out.response_ids.append(response)
        out.sampler_logprobs.append(torch.stack(logprobs).float() if logprobs else torch.zeros(0))
        out.finish_reasons.append(reason)
        if out.kept_tokens is not None:
            out.kept_tokens.append(KeptTokens.of_masks(torch.stack(masks), torch.tensor(tokens), torch.stack(
                tempered_logits), options.support.max_kept))

    def _forward(self, row: list[int]) -> torch.Tensor:
        """The final hidden states [1, W, H] of `row` right-padded to W, as the trainer's forward computes them
        (the decoder as the causal LM calls it, no cache; the padding masked)."""
        device = self.engine.device
        ids = torch.full((1, self.width), self.engine.pad_id, dtype=torch.long)
        ids[0, :len(row)] = torch.tensor(row)
        attention = torch.zeros(1, self.width, dtype=torch.long)
        attention[0, :len(row)] = 1
        return self.model.get_decoder()(input_ids=ids.to(device), attention_mask=attention.to(device),
                                        use_cache=False).last_hidden_state

    def _last_hidden(self, row: list[int]) -> torch.Tensor:
        """[1, H]: a fresh copy of the hidden state that predicts the token after `row`."""
        return self._forward(row)[:, len(row) - 1].clone()

    @torch.no_grad()
    def prefill_logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[torch.Tensor]:
        """Raw log-softmax of each response token, all positions from one forward of the whole row at W."""
        scored = []
        for prompt, response in zip(prompt_ids, response_ids):
            hidden = self._forward(list(prompt) + list(response))
            rows = [self.head.project(hidden[:, len(prompt) - 1 + t].clone()).float().log_softmax(-1)[0, token]
                    for t, token in enumerate(response)]
            scored.append(torch.stack(rows) if rows else torch.zeros(0))
        return scored

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.engine.load_weights(state_dict)

    # what transformers runs here, it runs (what the arm cannot keep bitwise is `check_bitwise_arm`'s)
    unsupported = staticmethod(HFSampler.unsupported)
    refused_here = staticmethod(HFSampler.refused_here)
    refused_model = staticmethod(HFSampler.refused_model)

    def sleep(self) -> None:
        """Nothing to release: no cache is held between calls."""

    def close(self) -> None:
        self.engine.close()
        del self.model, self.head


def check_bitwise_arm(cfg, precision, quantization: QuantizationMode, sampling: SamplingOptions,
                      routing: RoutingReplay) -> None:
    """One line for what would keep `sampler=bitwise` from being bitwise, before any engine starts: two precisions,
    a quantized sampler the trainer does not share, a support the sampler does not sample from (the vocabulary under
    top-k / top-p), routing replay, a trainer layout of its own, staleness without the trainer's log-probs at the
    sampling weights. Nothing for another sampler."""
    from rlmm.config.options import from_yaml, group_options
    from rlmm.trainers.packing import MicroBatching

    if not is_bitwise(cfg.sampler):
        return
    sides = (precision.sampler.dtype, precision.sampler.fp32_head), (precision.trainer.dtype, precision.trainer.fp32_head)
    if sides[0] != sides[1]:
        matched = [name for name in group_options("precision") if _one_precision(from_yaml("precision", name))]
        raise ValueError(f"sampler=bitwise: the sampler computes in {_side(precision.sampler)} and the trainer in "
                         f"{_side(precision.trainer)}; both sides must compute in one precision (allowed: precision="
                         f"{', '.join(matched)})")
    if quantization.quantizes_weights and not cfg.trainer.fake_quantize:
        raise ValueError(f"sampler=bitwise: quantization={quantization.name} quantizes the sampler's weights only, "
                         f"which the trainer does not (allowed: quantization=none, or trainer.fake_quantize=true: "
                         f"both sides quantized alike)")
    if sampling.truncates and sampling.logprobs == "processed" and not _normalises_over_kept_set(sampling.support):
        raise ValueError(f"sampler=bitwise: support={sampling.support.name} normalises the trainer's log-probs over the "
                         f"vocabulary while the sampler draws from its top-k / top-p set (allowed: support=sampler, "
                         f"trainer)")
    if routing.replays:
        raise ValueError("sampler=bitwise: the trainer routes every token as the sampler did, so there is no routing "
                         "to replay (allowed: routing=none)")
    MicroBatching(cfg.trainer.micro_batch_size, cfg.trainer.micro_batch_tokens, cfg.trainer.padding_free, row_width=1)
    train = cfg.get("train")
    if train is not None and train.staleness and (train.overlap or not train.decompose_staleness):
        raise ValueError(f"sampler=bitwise: with train.staleness={train.staleness} the check of every step needs the "
                         f"trainer's log-probs at the weights that sampled (allowed: train.decompose_staleness=true, "
                         f"train.overlap=false)")


def _one_precision(policy) -> bool:
    return (policy.sampler.dtype, policy.sampler.fp32_head) == (policy.trainer.dtype, policy.trainer.fp32_head)


def _side(side: SidePrecision) -> str:
    from rlmm.policy.precision import dtype_name

    return dtype_name(side.dtype) + (" with an fp32 head" if side.fp32_head else "")


def _normalises_over_kept_set(support) -> bool:
    from rlmm.policy.support import SamplerSupport, TrainerSupport

    return isinstance(support, (SamplerSupport, TrainerSupport))
