"""Worker: rlmm's real RL step (`rlmm.run.components.build_components` + `rlmm.run.step.rl_step`), stage by stage.

The config is composed from conf/train.yaml exactly as `rlmm train` composes it (Hydra, the same
overrides, validated by rlmm's schema); the loop below is `run_train`'s loop minus evaluation:
`rl_step` on the step's prompts, then the run record (steps.jsonl, fsynced) and the configured logger.

Stages, per step (seconds; the table shows the median over the measured steps):
  generate           rl_step's own timer: prompt tokenisation + sampler.generate
    generate.engine    of which the vLLM `LLM.generate` call itself (sampler=vllm only)
  reward             rl_step's timer: decode + task.reward
  trainer_logprobs   rl_step's timer: trainer.logprobs (no-grad forward of every rollout)
  train              rl_step's timer: the PPO/GRPO update, split into
    train.forward      model forward passes with grad
    train.backward     engine.backward (DeepSpeed) / loss.backward (torch)
    train.step         engine.step (DeepSpeed: after every micro-batch, optimizer at the boundary) / optimizer.step
    train.other        the rest: log-probs and entropy from the logits, the loss, grad-norm bookkeeping
  weight_sync        rl_step's timer: trainer.state_dict + sampler.load_weights (vLLM reload_weights)
  logging            RunRecord.log (steps.jsonl + fsync) + logger.log
  other              step wall time minus all of the above: mismatch metrics, advantages, correction,
                     metric dict (.item() calls)
  step               wall time of rl_step + logging
  *.cpu              the same stage's CPU time of this process (all threads; time.process_time), which
                     other jobs on the machine change less than its wall time; train.cpu: forward + backward
                     + optimizer step
"""
from __future__ import annotations

import time
from pathlib import Path

from benchmarks.common import Stopwatch, forced_lengths, read_job, set_runtime_env, summarize, sync_device, \
    workload_from, write_result

RL_STAGES = ("generate", "reward", "trainer_logprobs", "train", "weight_sync")


def compose_train_config(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import open_dict

    import rlmm.config.schema  # noqa: F401  (registers the schemas)
    from rlmm.config.options import CONF_DIR, validate

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    choices = dict(cfg.hydra.runtime.choices)
    with open_dict(cfg):
        del cfg["hydra"]
    GlobalHydra.instance().clear()
    validate(cfg, choices)
    return cfg, choices


def instrument(c, watch: Stopwatch) -> None:
    """Wrap the trainer's and sampler's methods with timers (instance attributes only; rlmm unchanged)."""
    import torch

    trainer = c.trainer
    training = torch.is_grad_enabled
    watch.wrap(trainer, "_forward", "train.forward", when=training)
    engine = getattr(trainer, "engine", None)
    if engine is not None:  # trainer=deepspeed
        watch.wrap(engine, "backward", "train.backward")
        watch.wrap(engine, "step", "train.step")
    else:  # trainer=torch: loss.backward is torch.Tensor.backward, looked up at every update()
        watch.wrap(trainer.optimizer, "step", "train.step")
        watch.wrap(torch.Tensor, "backward", "train.backward")
    watch.wrap(trainer, "state_dict", "weight_sync.state_dict")
    llm = getattr(c.sampler, "llm", None)
    if llm is not None:
        watch.wrap(llm, "generate", "generate.engine")


def force_lengths(sampler, lengths: list[int]) -> None:
    """Make every sampled (non-greedy) response of `sampler.generate` as long as `lengths` says (the step's
    rows, in order; the list is replaced in place each step), as if each had sampled eos there (the varlen
    workload; instance attributes only). vLLM: each of a request's n samples becomes its own request with
    its own max_tokens (seed + j, as vLLM seeds a request's n samples), so the engine generates no token
    past a row's length; then every response is cut to its length (token ids and log-probs alike)."""
    from rlmm.policy.rollouts import Rollouts

    llm = getattr(sampler, "llm", None)
    if llm is not None:
        engine_generate = llm.generate

        def engine_generate_forced(prompts, params, **kwargs):
            if not isinstance(params, list) or params[0].temperature == 0:  # greedy: untouched
                return engine_generate(prompts, params, **kwargs)
            rows_prompts, rows_params = [], []
            for prompt, request in zip(prompts, params):
                for j in range(request.n):
                    row = request.clone()
                    row.n, row.max_tokens = 1, lengths[len(rows_params) % len(lengths)]
                    row.seed = None if request.seed is None else request.seed + j
                    rows_prompts.append(prompt)
                    rows_params.append(row)
            outputs, merged = engine_generate(rows_prompts, rows_params, **kwargs), []
            for request in params:
                group, outputs = outputs[:request.n], outputs[request.n:]
                group[0].outputs = [out.outputs[0] for out in group]
                merged.append(group[0])
            return merged

        llm.generate = engine_generate_forced
    generate = sampler.generate

    def generate_forced(prompt_ids, *, n=1, greedy=False):
        out = generate(prompt_ids, n=n, greedy=greedy)
        if greedy:
            return out
        cut = [lengths[i % len(lengths)] for i in range(len(out))]
        return Rollouts(out.prompt_ids, [r[:k] for r, k in zip(out.response_ids, cut)],
                        [lp[:k] for lp, k in zip(out.sampler_logprobs, cut)], out.finish_reasons, out.info)

    sampler.generate = generate_forced


def main() -> None:
    job = read_job()
    set_runtime_env(job.get("device", "cpu"))
    import torch

    from rlmm.config.options import build, to_container
    from rlmm.run.components import build_components
    from rlmm.run.records import RunRecord
    from rlmm.run.step import rl_step

    w = workload_from(job)
    overrides = [f"precision={job['precision']}", f"train.prompts_per_step={w.prompts}",
                 f"algo.group_size={w.group_size}", f"sampling.max_new_tokens={w.max_new_tokens}",
                 f"trainer.micro_batch_size={w.micro_batch_size}", f"logger={job.get('logger', 'none')}",
                 f"train.steps={w.warmup + w.steps}"]
    if job.get("model_path") and (w.model != "tiny" or job.get("model_path_given")):
        overrides += ["model=hf", f"model.path={job['model_path']}"]
    overrides += job.get("overrides", [])
    cfg, choices = compose_train_config(overrides)
    run_dir = Path(job["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    torch.manual_seed(cfg.seed)
    c = build_components(cfg, lambda task: (task.examples("train", (w.warmup + w.steps) * w.prompts)
                                            + (task.examples("test", job["eval_prompts"]) if job.get("eval_prompts")
                                               else [])),
                         max_rows=max(w.prompts * cfg.algo.group_size, job.get("eval_prompts") or 0))
    precision_report = c.precision_report
    setup_seconds = time.perf_counter() - started
    record = RunRecord(run_dir, {"choices": choices, **to_container(cfg)})
    logger_error = None
    try:
        logger = build(cfg.logger, run_config={"choices": choices, **to_container(cfg)}, run_dir=str(run_dir),
                       sweep=None)
    except Exception as err:  # a broken logger should not sink the timing; say so in the result
        from rlmm.run.logging import NoOpLogger

        logger_error = f"logger={choices.get('logger')} failed ({type(err).__name__}: {err}); timed with no logger"
        print(f"warning: {logger_error}", flush=True)
        logger = NoOpLogger()
    examples = c.task.examples("train", (w.warmup + w.steps) * w.prompts)

    watch = Stopwatch()
    instrument(c, watch)
    step_lengths: list[int] = []
    if w.response_lengths:
        all_lengths = forced_lengths(w.response_lengths, (w.warmup + w.steps) * w.rollouts)
        force_lengths(c.sampler, step_lengths)
    per_step, lengths = [], []
    for step in range(1, w.warmup + w.steps + 1):
        prompts = examples[(step - 1) * w.prompts: step * w.prompts]
        if w.response_lengths:
            step_lengths[:] = all_lengths[(step - 1) * w.rollouts: step * w.rollouts]
        watch.take()
        sync_device()
        t0, cpu0 = time.perf_counter(), time.process_time()
        metrics = rl_step(c, prompts, cfg.train.ratio_cap, cfg.train.reuse_training_forward)
        sync_device()
        t1 = time.perf_counter()
        record.log(metrics, step)
        logger.log(metrics, step=step)
        t2 = time.perf_counter()
        inner = watch.take()
        stages = {k: metrics.get(f"perf/{k}_seconds", 0.0) for k in RL_STAGES}  # one pass: no trainer_logprobs
        train_parts = sum(inner.get(k, 0.0) for k in ("train.forward", "train.backward", "train.step"))
        row = {**stages, **inner, "train.other": stages["train"] - train_parts, "logging": t2 - t1,
               "step": t2 - t0, "step.cpu": time.process_time() - cpu0,
               "train.cpu": sum(inner.get(f"{k}.cpu", 0.0) for k in ("train.forward", "train.backward", "train.step"))}
        row["other"] = row["step"] - sum(stages.values()) - row["logging"]
        if step > w.warmup:
            per_step.append(row)
            lengths.append(metrics["rollout/response_length_mean"])
        print(f"rlmm step {step}/{w.warmup + w.steps}: {row['step']:.3f} s "
              f"({'warm-up' if step <= w.warmup else 'measured'})", flush=True)

    eval_seconds = None
    if job.get("eval_prompts"):
        from rlmm.run.evaluation import accuracy

        start = time.perf_counter()
        accuracy(c, c.sampler, c.task.examples("test", job["eval_prompts"]))  # the sampler's greedy eval
        eval_seconds = time.perf_counter() - start
    record.close()
    logger.finish()
    result = {
        "system": "rlmm", "precision": job["precision"], "choices": choices, "overrides": overrides,
        "precision_report": precision_report, "setup_seconds": setup_seconds, "logger_error": logger_error,
        "response_length_mean": sum(lengths) / len(lengths), "eval_seconds": eval_seconds,
        "eval_every": cfg.train.eval_every, "tokens_per_step": w.rollouts * sum(lengths) / len(lengths),
        **summarize(per_step),
    }
    c.trainer.close()
    c.sampler.close()
    write_result(result)


if __name__ == "__main__":
    main()
