"""Several corrections applied in order as one: `correction=seq_veto+token_rs+tis`."""
from __future__ import annotations

import functools
from collections.abc import Mapping

import torch

from rlmm.corrections.base import (Anchor, BatchView, Correction, CorrectionOutput, InUpdate, MicroBatchView,
                                   StepSize, finish, log_ratios)

SEPARATOR = "+"
RAW_RATIOS = ("ratio_mean", "ratio_min", "ratio_max", "seq_ratio_max")  # METRIC_KEYS before any weight or mask


class Stack(Correction):
    """Apply the stages in order, each to what the earlier ones left (``correction=a+b+c``).

    Before the update, stage k sees the tokens stages 1..k-1 kept (``BatchView.mask``), their weights multiplied
    (``BatchView.weights``) and the batch's response mask (``BatchView.response_mask``: a sequence veto tests every
    response token, the ones earlier stages dropped included, so it vetoes wherever it stands); the stack keeps a
    token only if every stage keeps it (masks ANDed) and weights it by the product of the stages' weights. PPO's
    pi_old is the one the stages' `old_policy` names (the trainer's when none names one); two stages naming
    different ones, or two importance-weighting stages (their product would count the ratio twice), are refused
    when the stack is built, before any engine starts. Inside the update the stages' `in_update` are chained the
    same way: weights multiplied, masks ANDed, penalties added; a stage that replaces PPO's pi_old for the
    micro-batch (`InUpdate.old_logprobs`, `prox_loglinear`) hands it to the stages after it and to the loss, and two
    such stages are refused when the stack is built (the ratio has one denominator). The step size is the product
    of the stages' factors, each stage seeing the stack's own batch (``correction=tis+vcpo``: TIS's weights, VCPO's
    step); a stack with a stage that acts there logs the product as ``correction/lr_scale`` beside each stage's
    ``correction/<stage>/<key>``. Its state is each stage's, by name.

    Each stage's metrics (but the raw ratios, the same for every stage) are logged under ``correction/<stage>/<key>``,
    the shared ones (rlmm/corrections/base.py's
    METRIC_KEYS) of the whole stack under ``correction/<key>``; so a stack of one stage gives that stage's old
    log-probs, weights and mask exactly.

    The stacks of the field, in this spelling: verl's ``rollout_rs`` options chained and ANDed, then ``rollout_is``
    (``seq_veto+token_rs+tis``; verl `trainer/ppo/rollout_corr_helper.py`); SkyRL's outlier veto, token mask, TIS,
    sequence mask (``seq_veto+token_rs+tis+seq_mis`` without seq_mis's weight); slime's IS weights, rejection,
    veto and batch normalisation (``tis+token_rs+seq_veto+normalize`` with its mis.yaml's band and veto,
    ``correction.stages.token_rs.high=2 correction.stages.seq_veto.estimator=min_ratio
    correction.stages.seq_veto.threshold=1e-4``; its `examples/train_infer_mismatch_helper/mis.py`, whose
    `calculate_veto_mask` tests the raw ratios on the loss mask after the rejection: so does seq_veto here);
    NeMo-RL's and OpenRLHF's ``seq-mask-tis`` (``geo_rs+tis``; NeMo-RL's token weight is untruncated:
    ``correction.stages.tis.cap=1e9``).

    Args:
        stages: name -> correction, in order (Hydra builds each from conf/correction/<name>.yaml: hydra_plugins/
            rlmm_stack composes ``correction=a+b`` into ``stages: {a: ..., b: ...}``, so one stage's parameter is
            ``correction.stages.a.<key>=...``).
    """

    def __init__(self, stages: Mapping[str, Correction]):
        self.stages = dict(stages)
        if not self.stages:
            raise ValueError("correction: a stack needs at least one stage (correction=a+b)")
        for name, stage in self.stages.items():
            if not isinstance(stage, Correction):
                raise ValueError(f"correction.stages.{name}: not a correction ({type(stage).__name__})")
        spelled = SEPARATOR.join(self.stages)
        choices = {name: stage.old_policy for name, stage in self.stages.items() if stage.old_policy is not None}
        if len(set(choices.values())) > 1:
            said = ", ".join(f"{name} the {side.name}'s" for name, side in choices.items())
            raise ValueError(f"correction={spelled}: the stages want different log-probs as PPO's pi_old ({said})")
        replacing = [name for name, stage in self.stages.items() if stage.replaces_old_logprobs]
        if len(replacing) > 1:
            raise ValueError(f"correction={spelled}: {' and '.join(replacing)} both replace PPO's pi_old inside the "
                             "update (the ratio has one denominator); keep one")
        weighted = [name for name, stage in self.stages.items() if stage.importance_weighted]
        if len(weighted) > 1:
            raise ValueError(f"correction={spelled}: {' and '.join(weighted)} both weight tokens by the importance "
                             "ratio (their product counts it twice); use one as a mask (e.g. token_rs for icepop's "
                             "band, or correction.stages.<name>.reweight=false)")
        self._old_policy = next(iter(choices.values()), None)

    @property
    def old_policy(self) -> Anchor | None:
        return self._old_policy

    @property
    def importance_weighted(self) -> bool:
        return any(stage.importance_weighted for stage in self.stages.values())

    @property
    def needs_versions(self) -> bool:
        return any(stage.needs_versions for stage in self.stages.values())

    @property
    def replaces_old_logprobs(self) -> bool:
        return any(stage.replaces_old_logprobs for stage in self.stages.values())

    def before_update(self, batch: BatchView) -> CorrectionOutput:
        delta, response = log_ratios(batch.trainer_logprobs, batch.sampler_logprobs, batch.mask)
        mask, weights = response, batch.running_weights()
        metrics = {}
        for name, stage in self.stages.items():
            out = stage.before_update(BatchView(trainer_logprobs=batch.trainer_logprobs,
                                                sampler_logprobs=batch.sampler_logprobs, mask=mask,
                                                advantages=batch.advantages, weights=weights,
                                                response_mask=batch.response_mask,
                                                token_staleness=batch.token_staleness))
            mask = mask & out.mask
            weights = torch.where(mask, weights * out.weights.to(torch.float64), 0.0)
            # the raw ratios a stage saw are the stack's (logged once, below): each stage logs what it did
            metrics.update({f"{name}/{key}": value for key, value in out.metrics.items() if key not in RAW_RATIOS})
        old = (self.old_policy or Anchor.trainer).logprobs(batch)  # the trainer's when no stage names one
        whole = finish(old_logprobs=old, weights=weights, keep=mask, delta=delta, mask=response)
        whole.metrics.update(metrics)
        return whole

    def step_size(self, batch: BatchView) -> StepSize:
        scale, metrics = 1.0, {}
        for name, stage in self.stages.items():
            size = stage.step_size(batch)
            scale *= size.scale
            metrics.update({f"{name}/{key}": value for key, value in size.metrics.items()})
        return StepSize(scale=scale, metrics={"lr_scale": scale, **metrics} if metrics else {})

    def state_dict(self) -> dict:
        return {name: state for name, stage in self.stages.items() if (state := stage.state_dict())}

    def load_state_dict(self, state: dict) -> None:
        unknown = sorted(set(state) - set(self.stages))
        if unknown:
            raise ValueError(f"correction={SEPARATOR.join(self.stages)}: the saved state has a stage '{unknown[0]}' "
                             "this stack lacks")
        for name, saved in state.items():
            self.stages[name].load_state_dict(saved)

    def in_update(self, micro: MicroBatchView) -> InUpdate:
        mask, weights, penalties, counts = micro.mask, micro.weights, [], {}
        factor, replaced = torch.ones_like(micro.weights), None
        for name, stage in self.stages.items():
            old = micro.old_logprobs if replaced is None else replaced  # a later stage sees the replaced pi_old
            fix = stage.in_update(MicroBatchView(logprobs=micro.logprobs, old_logprobs=old,
                                                 trainer_logprobs=micro.trainer_logprobs,
                                                 sampler_logprobs=micro.sampler_logprobs, advantages=micro.advantages,
                                                 mask=mask, weights=weights,
                                                 token_staleness=micro.token_staleness))
            mask = mask & fix.mask
            factor = factor * fix.weights
            weights = weights * fix.weights
            if fix.penalty is not None:
                penalties.append(fix.penalty)
            if fix.old_logprobs is not None:
                replaced = fix.old_logprobs
            counts.update({f"{name}/{key}": value for key, value in fix.counts.items()})
        return InUpdate(weights=factor, mask=mask, counts=counts, old_logprobs=replaced,
                        penalty=functools.partial(_summed, penalties) if penalties else None)


def _summed(penalties, logprobs: torch.Tensor) -> torch.Tensor:
    return sum(penalty(logprobs) for penalty in penalties)
