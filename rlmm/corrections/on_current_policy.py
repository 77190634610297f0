"""verl's bypass mode: importance weights and rejection of pi_theta against the sampler, inside the update."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from omegaconf import OmegaConf

from rlmm.config.options import from_yaml, group_options, option_node, validate_node
from rlmm.corrections.base import (Anchor, BatchView, Correction, CorrectionOutput, InUpdate, MicroBatchView, finish,
                                   log_ratios)
from rlmm.corrections.stack import Stack


class OnCurrentPolicy(Correction):
    """verl's bypass mode: pi_old := mu, the stages weigh and drop on pi_theta / mu inside the update (``correction=bypass_is``).

    Before the update: old = log mu, weight 1, nothing dropped (`bypass`). In each micro-batch the stages (any batch
    stages, in order, as a stack: ``stages: {a: ..., b: ...}``) run on the detached current policy in place of the
    trainer's recomputation,

        delta_t = log pi_theta(y_t) - log mu(y_t)   (not log pi_old - log mu),

    and their weights and mask act on the loss: with ``algo=cispo algo.objective.clip_low=0
    algo.objective.clip_high=0`` (CISPO's weight held at 1: REINFORCE)
    the per-token loss is verl's term -w_t * A_t * log pi_theta over the tokens the stages keep; the dropped ones stay in the
    divisor. The stages see one micro-batch, as verl's loss sees one (a self-normalisation or M2PO's cut is the
    micro-batch's here).

    Source: verl's ``compute_policy_loss_bypass_mode`` (`verl/trainer/ppo/core_algos.py`, ``rollout_correction.
    bypass_mode: true``, ``loss_type: reinforce``): ``compute_rollout_correction_and_rejection_mask`` on
    (log_prob, rollout_log_prob) under no_grad, then ``compute_policy_loss_reinforce`` -A * log_prob * w over the
    modified mask; Liu et al. 2025, "When Speed Kills Stability" (its bypass mode). verl's presets, here:
    ``bypass_pg_is`` (sequence TIS at 2) is this YAML's default with REINFORCE; ``bypass_pg_geo_rs_token_tis``
    is the stages {tis, geo_rs} with geo_rs's bounds its ``rollout_rs_threshold``. verl's ``loss_type: ppo_clip`` applies no weight
    (the ratio pi_theta / mu is already PPO's): `bypass` with a rejection stage on pi_old is the closest. Departures:
    verl clamps log-ratios to [-20, 20] before exp (the weights differ only beyond e^20, then capped anyway, or below
    e^-20); verl's ``seq_mean_k1`` bounds the mean of -delta (symmetric bounds, as geo_rs's defaults, agree); the
    weights are float32 (the corrections' contract), verl's the log-probs' dtype. Logs, summed over the step's
    micro-batches: ``frac_tokens_dropped`` (verl's ``rollout_rs_masked_fraction``).

    Args:
        stages: correction option -> the parameters that differ from conf/correction/<option>.yaml ({} for none),
            run in order on (pi_theta, mu) inside the update: ``correction.stages.seq_tis.cap=3``; Hydra adds and
            removes one with ``+correction.stages.geo_rs={low:0.5,high:2}``, ``~correction.stages.seq_tis``. Batch
            stages only (one that acts inside the update or on the step size is refused: its own in_update or
            step_size would never run).
    """

    old_policy = Anchor.sampler

    def __init__(self, stages: Mapping[str, Mapping[str, Any]]):
        self.stack = Stack({name: stage(name, values) for name, values in stages.items()})

    @property
    def needs_versions(self) -> bool:
        return self.stack.needs_versions

    def before_update(self, batch: BatchView) -> CorrectionOutput:
        delta, m = log_ratios(batch.trainer_logprobs, batch.sampler_logprobs, batch.mask)
        return finish(old_logprobs=batch.sampler_logprobs, weights=torch.ones_like(delta), keep=m, delta=delta, mask=m)

    def in_update(self, micro: MicroBatchView) -> InUpdate:
        current = BatchView(trainer_logprobs=micro.logprobs.detach(), sampler_logprobs=micro.sampler_logprobs,
                            mask=micro.mask, advantages=micro.advantages, token_staleness=micro.token_staleness)
        out = self.stack.before_update(current)
        given, kept = float(micro.mask.sum()), float(out.mask.sum())
        return InUpdate(weights=out.weights.to(micro.weights.dtype), mask=micro.mask & out.mask,
                        counts={"frac_tokens_dropped": (given - kept, given)})


def stage(option: str, values: Mapping[str, Any]) -> Correction:
    """conf/correction/<option>.yaml with `values` replacing its own, checked as the app checks an option (unknown
    keys and wrong types refused in one line), and refused unless it acts once per batch only."""
    where = f"correction.stages.{option}"
    if option not in group_options("correction"):
        raise ValueError(f"{where}: unknown correction (allowed: {', '.join(group_options('correction'))})")
    values = dict(values or {})
    validate_node(OmegaConf.merge(option_node("correction", option), values), where)
    built = from_yaml("correction", option, **values)
    if type(built).in_update is not Correction.in_update:
        raise ValueError(f"{where}: acts inside the update ({type(built).__name__}.in_update); bypass_is runs "
                         "batch stages on pi_theta")
    if type(built).step_size is not Correction.step_size:
        raise ValueError(f"{where}: acts on the step size ({type(built).__name__}.step_size), which bypass_is's "
                         "stages never reach; stack it outside: correction=bypass_is+" + option)
    return built
