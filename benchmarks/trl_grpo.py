"""Worker (runs in benchmarks/.venv-trl): TRL's GRPOTrainer on the same model, prompts and step shape.

Matched to rlmm's defaults (conf/train.yaml, algo=grpo, correction=tis, trainer=deepspeed):
  prompts per step, group size (num_generations), response length (max_completion_length), micro-batch
  (per_device_train_batch_size) with gradient accumulation so that one optimizer step = one generation
  batch = rlmm's step; temperature 1, top_p 1, top_k 0; GRPO advantages with the group std
  (scale_rewards="group"); token-level loss (loss_type="dapo"); clip 0.2 / 0.28; no KL (beta=0), so no
  reference model; one iteration; AdamW (torch) lr 3e-5, weight decay 0, grad-norm clip 1.0, constant LR;
  the arithmetic reward of rlmm's task; prompts in rlmm's order (shuffle_dataset=False).
  With vLLM (colocate, in-process): token-level truncated IS at cap 2 (rlmm's TIS) on the trainer's
  recomputed log-probs. Without vLLM (transformers generate), TRL skips that recomputation.
Precision: fp32 = fp32 checkpoint, bf16=False. bf16 = bf16 checkpoint (weights, and the engine's dtype),
  bf16=True: bf16 weights and AdamW states (rlmm's DeepSpeed bf16 keeps an fp32 master copy instead).

Stages (timers wrapped around TRL's own methods; per optimizer step):
  generate (minus weight_sync), weight_sync (TRL's sync_weights before generation), reward
  (_calculate_rewards), trainer_logprobs (no-grad _get_per_token_logps_and_entropies), train.forward
  (model forward with grad), train.backward (accelerator.backward), train.step (optimizer.step),
  logging (Trainer.log), other (the rest of the step's wall time), step (wall time between two
  on_step_end callbacks); *.cpu: the same stages' CPU time of this process (time.process_time).
Forced lengths (the varlen workload): `_generate_single_turn`'s completions cut to the run's k-th drawn
  length for row k, as rlmm's (benchmarks/common.py forced_lengths). TRL's GRPO has no padding-free
  option (GRPOConfig 1.16 has no `padding_free`; SFTConfig and DPOConfig do): it trains on padded rows.
"""
from __future__ import annotations

import time

from benchmarks.common import Stopwatch, forced_lengths, read_job, set_runtime_env, summarize, workload_from, \
    write_result

GENERATION = ("vllm", "transformers")


def force_lengths(trainer, lengths: list[int]) -> None:
    """Make the completions of each `_generate_single_turn` call as long as the next rows of `lengths`, as
    if each had sampled eos there: transformers generate runs until the batch's longest row (max_new_tokens
    set to it for the call, as a batch stops when its last row ends), then each completion (and its
    log-probs when vLLM returned them) is cut to its length."""
    generate, taken = trainer._generate_single_turn, [0]

    def generate_forced(prompt_ids, *args, **kwargs):
        longest = max(lengths[taken[0]: taken[0] + len(prompt_ids)])  # a prompt per row (TRL repeats them)
        trainer.generation_config.max_new_tokens = trainer.generation_kwargs["max_new_tokens"] = longest
        completion_ids, logprobs = generate(prompt_ids, *args, **kwargs)
        cut = lengths[taken[0]: taken[0] + len(completion_ids)]
        taken[0] += len(completion_ids)
        return ([c[:k] for c, k in zip(completion_ids, cut)],
                None if logprobs is None else [lp[:k] for lp, k in zip(logprobs, cut)])

    trainer._generate_single_turn = generate_forced


def main() -> None:
    job = read_job()
    device = job.get("device", "cpu")
    set_runtime_env(device)
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlmm.config.options import from_yaml
    from rlmm.tasks import Example

    w = workload_from(job)
    generation = job.get("generation", "vllm")
    if generation not in GENERATION:
        raise ValueError(f"generation: {generation} (allowed: {', '.join(GENERATION)})")
    precision = job["precision"]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    task = from_yaml("task", "arithmetic", seed=0)
    total_steps = w.warmup + w.steps
    examples = task.examples("train", total_steps * w.prompts)
    dataset = Dataset.from_dict({"prompt": [e.prompt for e in examples], "answer": [e.answer for e in examples]})

    def arithmetic_reward(prompts, completions, answer, **_):
        return [task.reward(Example(p, a), c) for p, c, a in zip(prompts, completions, answer)]

    if w.rollouts % w.micro_batch_size:
        raise ValueError(f"{w.rollouts} rollouts do not split into micro-batches of {w.micro_batch_size}")
    args = GRPOConfig(
        output_dir=job["run_dir"], max_steps=total_steps, per_device_train_batch_size=w.micro_batch_size,
        gradient_accumulation_steps=w.rollouts // w.micro_batch_size, num_generations=w.group_size,
        max_completion_length=w.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=3e-5, weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch", lr_scheduler_type="constant",
        warmup_steps=0, beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="group",
        num_iterations=1, shuffle_dataset=False, seed=0, bf16=precision == "bf16", fp16=False,
        use_cpu=device == "cpu", model_init_kwargs={"dtype": dtype}, logging_steps=1, report_to="none",
        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        use_vllm=generation == "vllm", vllm_mode="colocate", vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=2.0,
        vllm_gpu_memory_utilization=job.get("gpu_memory_utilization", 0.3),
        vllm_max_model_length=job.get("max_model_len"))

    watch = Stopwatch()
    times: list[float] = []
    cpu_times: list[float] = []
    per_step: list[dict] = []

    class StepClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            watch.wrap(trainer.optimizer, "step", "train.step")
            watch.take()
            times.append(time.perf_counter())
            cpu_times.append(time.process_time())

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter())
            cpu_times.append(time.process_time())
            row = watch.take()
            row["step"] = times[-1] - times[-2]
            row["step.cpu"] = cpu_times[-1] - cpu_times[-2]
            row["train.cpu"] = sum(row.get(f"{k}.cpu", 0.0) for k in ("train.forward", "train.backward", "train.step"))
            row["generate"] = row.get("generate", 0.0) - row.get("weight_sync", 0.0)
            row["other"] = row["step"] - sum(v for k, v in row.items()
                                             if k in ("generate", "weight_sync", "reward", "trainer_logprobs",
                                                      "train.forward", "train.backward", "train.step", "logging"))
            row["train"] = sum(row.get(k, 0.0) for k in ("train.forward", "train.backward", "train.step"))
            print(f"trl step {state.global_step}/{total_steps}: {row['step']:.3f} s", flush=True)
            if state.global_step > w.warmup:
                per_step.append(row)

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(job["model_path"])
    trainer = GRPOTrainer(model=job["model_path"], reward_funcs=arithmetic_reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepClock()])
    setup_seconds = time.perf_counter() - started
    if generation == "vllm":
        watch.wrap(trainer.vllm_generation, "sync_weights", "weight_sync")
    if w.response_lengths:
        force_lengths(trainer, forced_lengths(w.response_lengths, total_steps * w.rollouts))
    watch.wrap(trainer, "_generate_single_turn", "generate")
    watch.wrap(trainer, "_calculate_rewards", "reward")
    watch.wrap(trainer, "_get_per_token_logps_and_entropies", "trainer_logprobs", when=lambda: not torch.is_grad_enabled())
    watch.wrap(trainer.model, "forward", "train.forward", when=torch.is_grad_enabled)
    watch.wrap(trainer.accelerator, "backward", "train.backward")
    watch.wrap(trainer, "log", "logging")
    trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    result = {"system": f"trl[{generation}]", "precision": precision, "generation": generation,
              "setup_seconds": setup_seconds,
              "model_dtype": str(next(trainer.model.parameters()).dtype),
              "response_length_mean": sum(lengths[w.warmup:]) / max(len(lengths[w.warmup:]), 1) if lengths else None,
              **summarize(per_step)}
    if generation == "vllm":
        trainer.vllm_generation.llm.llm_engine.engine_core.shutdown()
    write_result(result)


if __name__ == "__main__":
    main()
