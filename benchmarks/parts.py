"""Worker: the work of one RL step done by each library alone, outside rlmm, as plainly as each allows.

  generate       vLLM `LLM.generate` with the SamplingParams rlmm builds (n=group_size, temperature,
                 top_p, top_k, max_tokens, logprobs=0, a seed per request, detokenize=False), engine
                 built with rlmm's engine arguments (dtype, enforce_eager, logprobs_mode, max_logprobs=1)
  generate.unseeded  the same call without per-request seeds (what seeding costs the engine)
  logprobs       one no-grad transformers forward over the step's rollouts (prompt + response, right
                 padded, micro-batches of micro_batch_size, logits_to_keep), log_softmax, gather
  train          one forward/backward per micro-batch (a policy-gradient surrogate with the step's
                 advantages) + clip_grad_norm_ + one torch.optim.AdamW step, plain PyTorch, weights in
                 the trainer's dtype (bf16: bf16 weights and AdamW states, no fp32 master copy)
  weight_sync    one `model_runner.reload_weights(weights_iterator=...)` from the trained state dict
  sum            generate + logprobs + train + weight_sync (the reference for rlmm's step)

The rollouts fed to logprobs/train are the ones `generate` produced in the same iteration.
"""
from __future__ import annotations

import os
import time

from benchmarks.common import read_job, set_runtime_env, summarize, sync_device, workload_from, write_result


def main() -> None:
    job = read_job()
    set_runtime_env(job.get("device", "cpu"))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from rlmm.config.options import from_yaml

    w = workload_from(job)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[job["precision"]]
    device = "cuda" if job.get("device") == "cuda" else "cpu"
    path = job["model_path"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    examples = from_yaml("task", "arithmetic", seed=0).examples("train", (w.warmup + w.steps) * w.prompts)

    started = time.perf_counter()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    engine_args = dict(model=path, dtype=str(dtype).removeprefix("torch."), seed=0, enforce_eager=True,
                       logprobs_mode="processed_logprobs", max_logprobs=1,
                       max_model_len=None, enable_prefix_caching=False)
    if device == "cuda":
        engine_args["gpu_memory_utilization"] = job.get("gpu_memory_utilization", 0.5)
    llm = LLM(**engine_args)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    model.eval()  # no dropout, as rlmm's trainers
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-5, weight_decay=0.0)
    setup_seconds = time.perf_counter() - started
    pad = tokenizer.pad_token_id

    def sampling_params(i: int, seeded: bool):
        return SamplingParams(n=w.group_size, temperature=1.0, top_p=1.0, top_k=0, max_tokens=w.max_new_tokens,
                              logprobs=0, seed=(1_000_003 + i) * 65_537 + i * w.group_size if seeded else None,
                              detokenize=False)

    def batches(rows):
        for start in range(0, len(rows), w.micro_batch_size):
            chunk = rows[start:start + w.micro_batch_size]
            width = max(len(p) + len(r) for p, r in chunk)
            ids = torch.tensor([p + r + [pad] * (width - len(p) - len(r)) for p, r in chunk], device=device)
            attention = (torch.arange(width, device=device)[None] < torch.tensor(
                [len(p) + len(r) for p, r in chunk], device=device)[:, None]).long()
            keep = width - min(len(p) for p, _ in chunk) + 1
            # position of response token j of row i among the kept logits: len(p) - 1 + j - (width - keep)
            index = torch.zeros(len(chunk), max(len(r) for _, r in chunk), dtype=torch.long)
            tokens = torch.zeros_like(index)
            mask = torch.zeros_like(index, dtype=torch.bool)
            for i, (p, r) in enumerate(chunk):
                index[i, :len(r)] = torch.arange(len(r)) + len(p) - 1 - (width - keep)
                tokens[i, :len(r)] = torch.tensor(r)
                mask[i, :len(r)] = True
            yield ids, attention, keep, index.to(device), tokens.to(device), mask.to(device)

    def token_logprobs(ids, attention, keep, index, tokens):
        logits = model(input_ids=ids, attention_mask=attention, logits_to_keep=keep, use_cache=False).logits
        logits = logits.gather(1, index[..., None].expand(-1, -1, logits.size(-1)))
        return logits.float().log_softmax(-1).gather(-1, tokens[..., None])[..., 0]

    per_step, lengths = [], []
    for step in range(w.warmup + w.steps):
        prompts = [tokenizer(e.prompt).input_ids for e in examples[step * w.prompts:(step + 1) * w.prompts]]
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        row = {}

        sync_device()
        t = time.perf_counter()
        outputs = llm.generate(inputs, [sampling_params(i, True) for i in range(len(prompts))], use_tqdm=False)
        row["generate"] = time.perf_counter() - t
        t = time.perf_counter()
        llm.generate(inputs, [sampling_params(i, False) for i in range(len(prompts))], use_tqdm=False)
        row["generate.unseeded"] = time.perf_counter() - t
        rollouts = [(p, list(c.token_ids)) for p, o in zip(prompts, outputs) for c in o.outputs]
        lengths.append(sum(len(r) for _, r in rollouts) / len(rollouts))

        sync_device()
        t = time.perf_counter()
        with torch.no_grad():
            old = [token_logprobs(ids, att, keep, index, tokens) for ids, att, keep, index, tokens, _ in batches(rollouts)]
        sync_device()
        row["logprobs"] = time.perf_counter() - t

        advantages = torch.randn(len(rollouts), device=device)
        total_tokens = sum(len(r) for _, r in rollouts)
        t = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        for k, (ids, att, keep, index, tokens, mask) in enumerate(batches(rollouts)):
            logp = token_logprobs(ids, att, keep, index, tokens)
            adv = advantages[k * w.micro_batch_size:(k + 1) * w.micro_batch_size, None]
            ratio = (logp - old[k]).exp()
            loss = -(torch.where(mask, ratio * adv, 0.0)).sum() / total_tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        sync_device()
        row["train"] = time.perf_counter() - t

        t = time.perf_counter()
        runner.reload_weights(weights_iterator=iter({k: v.detach() for k, v in model.state_dict().items()}.items()))
        sync_device()
        row["weight_sync"] = time.perf_counter() - t
        row["sum"] = row["generate"] + row["logprobs"] + row["train"] + row["weight_sync"]
        if step >= w.warmup:
            per_step.append(row)
        print(f"parts step {step + 1}/{w.warmup + w.steps}: {row['sum']:.3f} s", flush=True)

    llm.llm_engine.engine_core.shutdown()
    result = {"system": "parts", "precision": job["precision"], "setup_seconds": setup_seconds,
              "response_length_mean": sum(lengths[w.warmup:]) / len(per_step), **summarize(per_step, "sum")}
    write_result(result)


if __name__ == "__main__":
    main()
