"""What every app builds from its config, in one place: the task, the model checkpoint, the precision
policy, the sampler (given its `quantization=` mode) and the trainer (and, for `rlmm train`, the correction and
the algorithm).

Order matters and is the same for every app: each rank's device and the process group first (in-process
vLLM joins a group that exists instead of making its own), then the sampler, then the trainer; a trainer
that fails to build closes the sampler (one engine per process).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hydra.utils import instantiate
from omegaconf import DictConfig

from rlmm.config.options import build, from_yaml, to_container
from rlmm.mismatch.routing import RoutingReplay
from rlmm.models.loading import checkpoint_vocab_size
from rlmm.policy.precision import SidePrecision, check_precision
from rlmm.policy.rollouts import SamplingOptions
from rlmm.run.critic import NoCritic, ValueCritic
from rlmm.run.interfaces import Algorithm, Correction, Critic, Sampler, Trainer
from rlmm.runtime.devices import init_process_group, select_device
from rlmm.runtime.timing import timed
from rlmm.corrections.base import check_versions
from rlmm.run.partial_rollouts import check_partial_rollouts
from rlmm.samplers.bitwise import bitwise_row_width, check_bitwise_arm


@dataclass
class Components:
    task: object
    tokenizer: object
    sampler: Sampler
    trainer: Trainer
    correction: Correction | None  # None in apps that do not train (`rlmm probe`)
    algo: Algorithm | None
    sampling: SamplingOptions
    critic: Critic = field(default_factory=NoCritic)  # an algorithm's value model (PPO), else NoCritic
    model_path: str = ""
    trainer_precision: SidePrecision | None = None  # what the trainer side computes in (asked for): the
    # precision of eval/accuracy_trained's copy of the trainer's weights (rlmm/run/evaluation.py::TrainedCopyEngine)
    precision_report: dict = field(default_factory=dict)  # asked for vs what each engine really runs
    routing: RoutingReplay = field(default_factory=lambda: from_yaml("routing", "none"))  # conf/routing/none.yaml
    engine_args: dict = field(default_factory=dict)  # what the sampler was built with beside its YAML (another
    # engine of the same kind, e.g. the probe's `sampler.perturb` stand-ins, is built with the same)
    bitwise: bool = False  # the sampler and the trainer promise log-probs equal to the bit (`sampler=bitwise`): a step
    # where they are not is an error (rlmm/run/step.py)

    def close(self) -> None:
        self.critic.close()
        self.trainer.close()
        self.sampler.close()


def build_components(cfg: DictConfig, prompts: Callable[[object], list], max_rows: int,
                     seconds: dict[str, float] | None = None,
                     sampler_factory: Callable[[DictConfig, dict], Sampler] | None = None) -> Components:
    """Build the app's components from `cfg`. `prompts(task)`: every example the app will sample from (its
    longest prompt sizes the sampler's context); `max_rows`: the most sequences one of its generate calls
    asks for (with the context, the sampler's KV cache). `seconds`: when given, the model, sampler and
    trainer build times are added to it. `sampler_factory(cfg, engine_args)`: what stands in for the
    sampler instead of building it here (`train.overlap`: rlmm/run/sampler_process.py's `SamplerProcess`, its engine
    built in that process with the same arguments)."""
    from transformers import AutoTokenizer

    seconds = {} if seconds is None else seconds
    select_device()
    init_process_group()
    task = instantiate(cfg.task)
    with timed(seconds, "model"):
        model_path = instantiate(cfg.model).resolve(task, to_container(cfg.task))
    precision = instantiate(cfg.precision)
    precision.apply()
    sampling = SamplingOptions(**cfg.sampling, support=instantiate(cfg.support))
    sampling.check_vocabulary(checkpoint_vocab_size(model_path))  # a hub model's, known once it is fetched
    algo = instantiate(cfg.algo) if "algo" in cfg else None
    correction = instantiate(cfg.correction) if "correction" in cfg else None
    routing = instantiate(cfg.routing)
    routing.check_checkpoint(model_path)  # a routing the model cannot take, refused before any engine starts
    quantization = instantiate(cfg.quantization)
    check_bitwise_arm(cfg, precision, quantization, sampling, routing)
    check_partial_rollouts(cfg.get("train"), sampling, routing, algo)
    if correction is not None and cfg.get("train") is not None:  # per-token versions: the delay line's, k >= 1
        check_versions(correction, tracked=cfg.train.staleness >= 1)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompt_tokens = longest_prompt(tokenizer, prompts(task))
    # sampler=bitwise: the trainer lays every row out alone at the width the sampler decodes at
    row_width = bitwise_row_width(cfg.sampler, prompt_tokens, sampling.max_new_tokens)
    with timed(seconds, "sampler_init"):
        # A trainer with an fp32 head trains it apart from a tied input embedding: the sampler must hold both.
        engine_args = dict(model_path=model_path, precision=precision.sampler, sampling=sampling, seed=cfg.seed,
                           prompt_tokens=prompt_tokens, max_rows=max_rows,
                           untie_head=precision.trainer.fp32_head, capture_routing=routing.capture,
                           quantization=quantization)
        if "kv_scales" in cfg.sampler:  # sampler=vllm's FP8 KV cache scales: calibrated on the run's first prompts
            first = prompts(task)[:cfg.sampler.kv_calibration_prompts]
            engine_args["calibration_prompts"] = tokenizer([e.prompt for e in first]).input_ids
        if sampler_factory is not None:  # e.g. the engine built in a process of its own while the trainer is here
            sampler = sampler_factory(cfg, engine_args)
        else:
            sampler = build(cfg.sampler, **engine_args)
    with timed(seconds, "trainer_init"):
        try:
            trainer = build(cfg.trainer, model_path=model_path, precision=precision.trainer, sampling=sampling,
                            row_width=row_width,
                            quantization=engine_args["quantization"])  # the sampler's mode: `trainer.fake_quantize`
        except BaseException:
            sampler.close()  # one engine per process: never leave one behind
            raise
    try:
        routing.bind(trainer.model)
    except BaseException:
        trainer.close()
        sampler.close()
        raise
    critic = NoCritic()
    if algo is not None and algo.critic:
        with timed(seconds, "critic_init"):
            try:  # the trainer side's body dtype; its head is a new scalar one
                critic = ValueCritic(build(cfg.trainer, model_path=model_path, sampling=sampling, value_head=True,
                                           precision=SidePrecision(precision.trainer.dtype, False),
                                           lr=algo.critic["lr"], row_width=row_width),
                                     algo.critic["warmup_steps"])
            except BaseException:
                trainer.close()
                sampler.close()
                raise
    return Components(task=task, tokenizer=tokenizer, sampler=sampler, trainer=trainer, correction=correction,
                      algo=algo, sampling=sampling, model_path=model_path, critic=critic,
                      trainer_precision=precision.trainer, routing=routing, engine_args=engine_args,
                      bitwise=row_width is not None,
                      precision_report=check_precision(precision, sampler.actual_precision, trainer.actual_precision))


def longest_prompt(tokenizer, examples: list) -> int:
    """The longest of the examples' prompts in tokens (sizes the sampler's max_model_len)."""
    return max(len(ids) for ids in tokenizer([e.prompt for e in examples]).input_ids)
