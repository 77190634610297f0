"""Typed schemas of the top-level configs, registered with Hydra's ConfigStore.

The apps' YAML files (conf/*.yaml) hold every value; these dataclasses only fix the keys and types,
so a typo such as `sampling.temprature=0.7` or `probe.num_prompts=many` fails at composition. Group
nodes (model, sampler, ...) are typed `Any` here and checked against their own `_target_` class by
`rlmm.config.options.validate`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, Optional, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from rlmm.policy import rollouts

# The schema of the `sampling:` node: rlmm.policy.rollouts.SamplingOptions' fields but `support`, which the app builds
# from the `support=` group. A class of this module (a config holding it is pickled to a sampler process).
SamplingOptions = make_dataclass("SamplingOptions", [(f.name, get_type_hints(rollouts.SamplingOptions)[f.name],
                                                      field(default=MISSING))
                                                     for f in fields(rollouts.SamplingOptions) if f.name != "support"])
SamplingOptions.__module__ = __name__


@dataclass
class BatchInvarianceOptions:
    num_prompts: int = MISSING
    num_completions: int = MISSING
    max_batch_size: int = MISSING


@dataclass
class EarlyVsLateOptions:
    """rlmm/mismatch/metrics.py::early_vs_late: the mismatch early and late in the same long responses."""

    response_tokens: Optional[int] = MISSING  # null: off; N: responses at least N tokens long
    window: int = MISSING                     # tokens in each window: [0, window) and [N - window, N)


@dataclass
class TrainerLayout:
    """One way to lay out the trainer's micro-batches (rlmm/trainers/packing.py), scored in `rlmm probe`
    against padded micro-batches of `trainer.micro_batch_size` (the trainer's other settings unchanged)."""

    micro_batch_tokens: Optional[int] = MISSING  # null: micro_batch_size rows a micro-batch; N: a token budget
    padding_free: bool = MISSING


@dataclass
class ProbeOptions:
    split: str = MISSING
    num_prompts: int = MISSING
    samples_per_prompt: int = MISSING
    ratio_cap: float = MISSING
    position_buckets: int = MISSING
    entropy_edges: list[float] = MISSING  # bucket edges of the trainer's token entropy (rlmm/mismatch/metrics.py::entropy_profile)
    trainer_micro_batch_sizes: list[int] = MISSING
    trainer_layouts: dict[str, TrainerLayout] = MISSING
    early_vs_late: EarlyVsLateOptions = field(default_factory=EarlyVsLateOptions)
    batch_invariance: BatchInvarianceOptions = field(default_factory=BatchInvarianceOptions)
    simulated: list[float] = MISSING  # sampler.perturb stand-ins measured beside the real sampler ([]: none)
    attribution: bool = MISSING  # the op-class attribution of the gap at the sampler's dtype (rlmm/mismatch/attribution.py)
    layers: bool = MISSING  # the residual stream after every layer, sampler vs trainer (rlmm/mismatch/layer_attribution.py)


@dataclass
class ProbeConfig:
    model: Any = MISSING
    task: Any = MISSING
    sampler: Any = MISSING
    trainer: Any = MISSING
    precision: Any = MISSING
    routing: Any = MISSING
    support: Any = MISSING
    quantization: Any = MISSING
    chat_template: Any = MISSING
    token_path: Any = MISSING
    logger: Any = MISSING
    seed: int = MISSING
    sampling: SamplingOptions = MISSING
    probe: ProbeOptions = field(default_factory=ProbeOptions)


@dataclass
class MonitorOptions:
    enabled: bool = MISSING
    rising: list[str] = MISSING
    falling: list[str] = MISSING
    warmup_steps: int = MISSING
    drift: float = MISSING
    threshold: float = MISSING
    clip: float = MISSING
    action: str = MISSING  # an rlmm.run.monitor.Action's name, checked there (config sits below run)
    switch_to: str = MISSING


@dataclass
class TrainAttributionOptions:
    every: int = MISSING  # 0: off; N: the op-class attribution at step 0 and every N steps (rlmm/mismatch/attribution.py)
    prompts: int = MISSING  # held-out prompts it is measured on, the same each time


@dataclass
class TrainOptions:
    steps: int = MISSING
    prompts_per_step: int = MISSING
    eval_every: int = MISSING
    eval_prompts: int = MISSING
    eval_trained_weights: bool = MISSING
    ratio_cap: float = MISSING
    checkpoint_every: int = MISSING
    resume: bool = MISSING
    max_bad_steps: int = MISSING
    reuse_training_forward: bool = MISSING
    staleness: int = MISSING
    decompose_staleness: bool = MISSING
    overlap: bool = MISSING
    partial_rollouts: bool = MISSING
    rollout_chunk: int = MISSING
    monitor: MonitorOptions = field(default_factory=MonitorOptions)
    attribution: TrainAttributionOptions = field(default_factory=TrainAttributionOptions)


@dataclass
class TrainConfig:
    model: Any = MISSING
    task: Any = MISSING
    sampler: Any = MISSING
    trainer: Any = MISSING
    precision: Any = MISSING
    correction: Any = MISSING
    algo: Any = MISSING
    routing: Any = MISSING
    support: Any = MISSING
    quantization: Any = MISSING
    chat_template: Any = MISSING
    token_path: Any = MISSING
    logger: Any = MISSING
    seed: int = MISSING
    sampling: SamplingOptions = MISSING
    train: TrainOptions = field(default_factory=TrainOptions)


def register() -> None:
    store = ConfigStore.instance()
    store.store(name="probe_schema", node=ProbeConfig)
    store.store(name="train_schema", node=TrainConfig)


register()
