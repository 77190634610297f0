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
from rlmm.conversation.chat import NoChatTemplate, RawPrompts
from rlmm.run.episodes import SingleTurn, build_episodes, check_token_path
from rlmm.tasks.environment import is_multi_turn
from rlmm.mismatch.routing import RoutingReplay
from rlmm.models.loading import checkpoint_positions, checkpoint_vocab_size, load_tokenizer
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
    prompts: object = None  # the bound prompt format (`chat_template=`, rlmm/conversation/chat.py): `prompts.ids(example)`
    episodes: object = None  # one response or a conversation per example (rlmm/run/episodes.py) along the token path

    def __post_init__(self):
        """Components built by hand (tests, notebooks) without a prompt format or episodes get the task's text as it
        is and one response per prompt: what `chat_template=none` with a single-turn task builds."""
        if self.prompts is None:
            self.prompts = RawPrompts(self.tokenizer, self.task)
        if self.episodes is None:
            self.episodes = SingleTurn(self.task, self.prompts, self.tokenizer, self.sampling.max_new_tokens)

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
    seconds = {} if seconds is None else seconds
    select_device()
    init_process_group()
    task = instantiate(cfg.task)
    sampling = SamplingOptions(**cfg.sampling, support=instantiate(cfg.support))
    check_conversation(cfg, task, sampling)  # before the model is built
    with timed(seconds, "model"):
        model_path = instantiate(cfg.model).resolve(task, to_container(cfg.task))
    precision = instantiate(cfg.precision)
    precision.apply()
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
    tokenizer = load_tokenizer(model_path)
    prompt_format, episodes = conversation_parts(cfg, tokenizer, model_path, task, sampling)  # before any engine
    prompt_tokens = longest_prompt(prompt_format, prompts(task), episodes, sampling.max_new_tokens, model_path)
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
            engine_args["calibration_prompts"] = [prompt_format.ids(e) for e in first]
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
                      bitwise=row_width is not None, prompts=prompt_format, episodes=episodes,
                      precision_report=check_precision(precision, sampler.actual_precision, trainer.actual_precision))


def conversation_parts(cfg: DictConfig, tokenizer, model_path: str, task, sampling: SamplingOptions):
    """The bound prompt format (`chat_template=`) and the episodes (one response, or a multi-turn task's
    conversations along `token_path=`), once the tokenizer is known (`check_conversation` has run)."""
    prompt_format = instantiate(cfg.chat_template).bind(tokenizer, model_path, task)
    return prompt_format, build_episodes(task, prompt_format, tokenizer, sampling.max_new_tokens,
                                         instantiate(cfg.token_path))


def check_conversation(cfg: DictConfig, task, sampling: SamplingOptions) -> None:
    """What the task's kind (one response, or a conversation) cannot run with, in one line, before the model is
    built or any engine starts: another token path than `tokens` for a single-turn task; for a multi-turn one, no
    template, `rlmm probe`'s captured layers, a critic (PPO), partial rollouts, routing replay or comparison off
    `token_path=tokens`, `retokenize`'s prefill under a tempered or truncated sampler."""
    path = instantiate(cfg.token_path)
    check_token_path(task, path)
    if not is_multi_turn(task):
        return
    if isinstance(instantiate(cfg.chat_template), NoChatTemplate):
        raise ValueError("chat_template=none: a multi-turn task renders its turns with the model's chat template "
                         "(allowed: chat_template=auto or model)")
    train = cfg.get("train")
    if train is None:  # rlmm probe
        if cfg.probe.layers:
            raise ValueError("probe.layers=true with a multi-turn task: the sampler's hidden states are captured per "
                             "generate call, not stitched over a conversation's turns (allowed: probe.layers=false)")
    elif instantiate(cfg.algo).critic:
        raise ValueError(f"algo={cfg.algo._target_.rsplit('.', 1)[-1].lower()} with a multi-turn task: its critic's "
                         f"GAE runs over a contiguous response, and a conversation's sampled tokens have the "
                         f"environment's between them (allowed: algo=grpo, dr_grpo, dapo, gspo, cispo)")
    if train is not None and train.partial_rollouts:
        raise ValueError("train.partial_rollouts=true with a multi-turn task: a conversation is not continued across "
                         "weight syncs yet (allowed: train.partial_rollouts=false; train.staleness works)")
    routing = instantiate(cfg.routing)
    if (routing.replays or routing.compare) and path.name != "tokens":
        raise ValueError(f"routing={routing.name}{' compare=true' if routing.compare else ''} with token_path="
                         f"{path.name}: the trainer scores ids the sampler's forwards did not all see, whose experts "
                         f"it never chose (allowed: token_path=tokens, or routing=none with compare=false)")
    if path.rescores and (sampling.temperature != 1.0 or sampling.truncates):
        raise ValueError(f"token_path={path.name}: the sampler's log-probs of the re-rendered ids come from its prefill, "
                         f"which scores the untempered, untruncated distribution (allowed with sampling.temperature=1.0, "
                         f"top_p=1.0, top_k=0)")


def longest_prompt(prompt_format, examples: list, episodes, max_new_tokens: int, model_path: str) -> int:
    """The longest prompt a turn may have, in tokens (sizes the sampler's max_model_len): the examples' longest, or a
    multi-turn task's context less a whole turn (`task.max_context_tokens`), which no first prompt may exceed and
    which, with the position a re-scoring prefill asks past it, must fit the model's positions."""
    longest = max(len(prompt_format.ids(e)) for e in examples)
    if isinstance(episodes, SingleTurn):
        return longest
    context = episodes.max_context
    positions = checkpoint_positions(model_path)
    if positions is not None and context + 1 > positions:
        raise ValueError(f"task.max_context_tokens: {context} tokens (and the one a re-scoring prefill asks past them) "
                         f"are more than the model's {positions} positions (allowed: <= {positions - 1})")
    if longest + max_new_tokens > context:
        raise ValueError(f"task.max_context_tokens: {context} tokens do not hold the longest first prompt ({longest} "
                         f"tokens) and a whole turn (sampling.max_new_tokens={max_new_tokens}): allowed >= "
                         f"{longest + max_new_tokens}")
    return context - max_new_tokens
