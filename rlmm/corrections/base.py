"""The correction interface (the `correction=` config group) and the masked float64 helpers its methods share.

A correction decides how PPO's loss absorbs the mismatch between the policy that sampled the tokens and the one
that trains on them. It sees three policies on the step's sampled tokens (docs/corrections.md, "Three policies"):

* ``log mu``, the sampler's (``sampler_logprobs``: the behaviour policy, its kernels and precision),
* ``log pi_old``, the trainer's recomputation before the update (``trainer_logprobs``: the proximal policy),
* ``log pi_theta``, the current policy of each micro-batch inside the update (``logprobs``, detached),

and the advantages. It can act in three places, each a method of its class (`Correction` gives each as the identity,
so a method overrides only where it acts; the RL step calls all three for every correction, never asking which):

* ``before_update(batch: BatchView) -> CorrectionOutput``: once per batch, on every rank's rows (the whole batch,
  as one rank would see it): which log-probs play pi_old in PPO's ratio, a detached per-token weight, the tokens
  that still count, and metrics logged under ``correction/<key>`` (TIS, IcePop, MIS, the rejection methods, M2PO,
  the self-normalisation of the weights);
* ``in_update(micro: MicroBatchView) -> InUpdate``: each micro-batch of every epoch and minibatch, once pi_theta
  is known: a weight and a mask on top of the batch's, an optional penalty on log pi_theta, token counts
  logged as ratios summed over the step (OPSM, DPPO's TV trust region), and optionally the log-probs that replace
  the batch stage's pi_old in PPO's ratio for this micro-batch (AReaL's approximated proximal policy,
  `prox_loglinear`);
* ``step_size(batch: BatchView) -> StepSize``: once per batch, after ``before_update``, on the same view: a factor
  on the learning rate of this RL step's optimizer steps (the schedule's rate times it, the schedule itself
  untouched) and its metrics (VCPO's effective-sample-size scaling, a mismatch-triggered decay). The identity is
  1.0 and no metric, so a method that does not act here changes no bit of a run. A method whose factor depends on
  the steps before (a decay) keeps that in ``state_dict()`` / ``load_state_dict()``, saved with the checkpoint
  (rlmm/run/checkpoint.py); the others have none ({}).

Everything in the batch stage is a function of delta = log pi_old - log pi_sampler (see rlmm/mismatch/metrics.py): the token
ratio r_t = exp(delta_t), the sequence log-ratio S_i = sum_t delta_t and the geometric-mean log-ratio S_i / |y_i|.
Ratios are computed in float64 (bf16 and fp16 log-probs convert exactly) and the weights cast to float32 at the
end. Padding may hold garbage (inf, nan): it is replaced with ``torch.where`` before any arithmetic, never
multiplied by 0 (``0 * nan`` is nan), so it cannot leak into a sum, a weight or a metric.

Several corrections apply in order as one (`correction=seq_veto+token_rs+tis`, rlmm/corrections/stack.py): masks
ANDed, weights multiplied, each stage seeing what the earlier ones left (`BatchView.mask`, `.weights`) and the
batch's response mask (`.response_mask`, which a sequence veto tests). A class
says which pi_old its weights assume (`old_policy`, an `Anchor`) so that a stack can refuse two that disagree.

A setting with a few fixed values (`kl_rs`'s `estimator` and `level`, `seq_veto`'s `estimator`, `opsm`'s `anchor`) is
an `Enum` whose members own what the value does (`Anchor.sampler.logprobs(view)`), spelled in the YAML by the
member's name (`anchor: sampler`): the config's schema (rlmm/config/options.py `schema_of`) checks it against the
names, and the constructor takes the name or the member (`choice`).

Each method is one class in its own module and one YAML in conf/correction/; nothing else needs to change to add
one (docs/corrections.md shows how).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar, TypeVar

import torch

from rlmm.mismatch.kl import k3

__all__ = ["Anchor", "BatchView", "CappedImportanceRatio", "Correction", "CorrectionOutput", "InUpdate", "METRIC_KEYS",
           "MicroBatchView", "OldPolicyChoice", "StepSize", "DROP_SPLIT_KEYS", "drop_split", "log_ratios", "finish",
           "masked_mean", "masked_max", "masked_min", "choice", "sequence_ratio", "check_versions"]


class Anchor(Enum):
    """One of the two policies whose log-probs of the sampled tokens a correction is given: the sampler's (log mu,
    ``sampler``) or the trainer's recomputation before the update (log pi_old, ``trainer``). ``logprobs(view)``
    reads that side from a `BatchView` or a `MicroBatchView`: the member's value is the field's name."""

    sampler = "sampler_logprobs"
    trainer = "trainer_logprobs"

    def logprobs(self, view: BatchView | MicroBatchView) -> torch.Tensor:
        return getattr(view, self.value)


# Which log-probs a method's weights assume as PPO's pi_old: the trainer's recomputation (the importance weight
# pi_old / mu corrects the samples towards it), the sampler's (pi_old := mu: bypass, DPPO's trust region), or no
# assumption (a mask of outliers, a rescaling): None.
OldPolicyChoice = Anchor | None

E = TypeVar("E", bound=Enum)


def choice(kind: type[E], value: E | str, key: str) -> E:
    """The member of `kind` that `value` names (Hydra hands a constructor the YAML's string; Python callers may pass
    the member). Raises ValueError naming `key`, the value and the allowed names otherwise (what a config that
    skipped the schema's check, or a caller in Python, sees)."""
    if isinstance(value, kind):
        return value
    if isinstance(value, str) and value in kind.__members__:
        return kind[value]
    raise ValueError(f"correction.{key}: must be one of {', '.join(kind.__members__)}, got '{value}'")


# Logged by every method (methods may add their own keys on top).
METRIC_KEYS = (
    "ratio_mean",             # mean of r_t over response tokens, before any truncation or masking
    "ratio_min",
    "ratio_max",
    "seq_ratio_max",          # max_i exp(S_i); inf once some S_i > ~709.8 (float64 overflow), not clamped
    "weight_mean",            # mean weight over the tokens that are kept
    "weight_std",             # their population std (verl's rollout_is_std)
    "weight_ess",             # (sum w)^2 / (n sum w^2) over them, in [0, 1] (verl's rollout_is_eff_sample_size)
    "frac_tokens_masked",     # response tokens rejected / response tokens
    "frac_sequences_masked",  # non-empty sequences left with no kept token / non-empty sequences
)


@dataclass
class CorrectionOutput:
    """What a correction hands to the PPO loss; every tensor is ``[B, T]`` and detached.

    Padding positions hold 0 in ``old_logprobs`` and ``weights`` and False in ``mask``.
    """

    old_logprobs: torch.Tensor  # log pi_old in PPO's ratio; the dtype of the input it was taken from
    weights: torch.Tensor  # float32, >= 0: multiplies each token's policy-gradient loss; 0 where ``mask`` is False
    mask: torch.Tensor  # bool: response tokens that still count (input mask AND not rejected)
    metrics: dict[str, float]  # logged under correction/<key>


@dataclass(frozen=True)
class BatchView:
    """What a correction sees once per batch, before the update: ``[B, T]`` right-padded tensors of every rank's
    rows (the whole batch), detached."""

    trainer_logprobs: torch.Tensor  # log pi_old: the trainer's recomputation of the sampled tokens
    sampler_logprobs: torch.Tensor  # log mu: the sampler's
    mask: torch.Tensor  # bool: the tokens still in (the response mask, minus what earlier stages of a stack dropped)
    advantages: torch.Tensor  # each token's advantage (GRPO's sequence advantage on each of its tokens)
    weights: torch.Tensor | None = None  # earlier stages' weights multiplied (None: no earlier stage, all 1)
    # bool: the batch's response mask, before any stage dropped a token (None: `mask`, set so); what a sequence
    # veto tests wherever it stands in a stack (slime's veto after its rejection)
    response_mask: torch.Tensor | None = None
    # int64: updates between the weights that sampled each token and pi_old's, the trainer's v_{u-1} (0 on padding;
    # None: the run tracks no versions, the synchronous step). Under `train.partial_rollouts` a row's tokens may
    # differ (rlmm/run/rollout_source.py); a method that reads it sets `needs_versions`.
    token_staleness: torch.Tensor | None = None

    def __post_init__(self):
        if self.response_mask is None:
            object.__setattr__(self, "response_mask", self.mask)

    def running_weights(self) -> torch.Tensor:
        """The earlier stages' weights in float64, 1 where none came before (0 on dropped tokens)."""
        if self.weights is None:
            return torch.where(self.mask.to(self.trainer_logprobs.device), 1.0, 0.0).to(torch.float64)
        return self.weights.to(torch.float64)


@dataclass(frozen=True)
class MicroBatchView:
    """What a correction sees in each micro-batch of the update: ``[b, t]`` tensors of this rank's micro-batch
    rows, cut to the width the trainer's forward returned, detached."""

    logprobs: torch.Tensor  # log pi_theta: the current policy, as the update's forward computed it
    old_logprobs: torch.Tensor  # the log pi_old PPO's ratio uses (the batch stage's choice)
    trainer_logprobs: torch.Tensor  # log pi_old as the trainer recomputed it
    sampler_logprobs: torch.Tensor  # log mu
    advantages: torch.Tensor
    mask: torch.Tensor  # bool: the tokens the batch stage (and earlier stages of a stack) left in
    weights: torch.Tensor  # float32: the batch stage's weights (and earlier in-update stages', multiplied)
    token_staleness: torch.Tensor | None = None  # int64, as `BatchView.token_staleness`, these rows cut alike


@dataclass
class InUpdate:
    """What a correction adds inside the update, for one micro-batch, ``[b, t]``: its own ``weights`` (detached,
    multiplied into the batch stage's by the RL step) and the tokens it keeps (``mask``, ANDed with the batch
    stage's); ``penalty`` maps the differentiable log pi_theta to a per-token loss term, 0 where it does not apply,
    that the algorithm sums and divides by its loss's divisor, on the tokens ``mask`` drops too (None: none);
    ``counts`` are (numerator, denominator) pairs summed over every micro-batch of the step and every rank and
    logged as their ratio under ``correction/<key>`` (exact whatever the micro-batching); ``old_logprobs``, when
    not None, replaces the batch stage's log pi_old as the denominator of PPO's ratio in this micro-batch
    (detached, ``[b, t]``; a method that sets it declares `Correction.replaces_old_logprobs`).

    The batch stage's `CorrectionOutput` is read the same way: a method returns its own weights and the tokens it
    keeps, and whoever holds several (a stack, the RL step) multiplies and ANDs them."""

    weights: torch.Tensor
    mask: torch.Tensor
    penalty: Callable[[torch.Tensor], torch.Tensor] | None = None
    counts: dict[str, tuple[float, float]] = field(default_factory=dict)
    old_logprobs: torch.Tensor | None = None


@dataclass(frozen=True)
class StepSize:
    """What a correction does to the step size, once per batch: ``scale`` multiplies the learning rate of this RL
    step's optimizer steps (every epoch's and minibatch's; the schedule's own rate is untouched, the next step
    starts from it again), finite and >= 0; ``metrics`` are logged under ``correction/<key>`` beside the batch
    stage's (none for the identity, so a run without such a method logs what it always has). The RL step agrees
    the scale over the ranks (their smallest) before any rank steps."""

    scale: float = 1.0
    metrics: dict[str, float] = field(default_factory=dict)


class Correction:
    """The base of every correction: the identity in every place (pi_old the trainer's, weight 1, nothing dropped,
    the step size as the schedule has it, no state).
    A method overrides `before_update`, `in_update`, `step_size` or several; calling it, ``correction(train_logprobs,
    sampler_logprobs, mask[, advantages])``, runs `before_update` on a batch of one rank (tests, scripts).

    `old_policy`: which pi_old the method's weights assume (an `Anchor`, or None for none); the batch stage's
    `old_logprobs` must be that side's. `needs_versions`: whether it reads each token's staleness. `importance_weighted`: whether its weights are an importance ratio (a stack refuses two:
    their product would count the ratio twice). `replaces_old_logprobs`: whether its `in_update` returns
    `InUpdate.old_logprobs` (a stack refuses two: PPO's ratio has one denominator)."""

    old_policy: ClassVar[OldPolicyChoice] = None
    # Whether the method reads `token_staleness` (the run refuses it where no versions are tracked, before engines).
    needs_versions: ClassVar[bool] = False
    # Whether its `in_update` replaces PPO's pi_old in each micro-batch (`InUpdate.old_logprobs`).
    replaces_old_logprobs: ClassVar[bool] = False

    @property
    def importance_weighted(self) -> bool:
        return False

    def before_update(self, batch: BatchView) -> CorrectionOutput:
        delta, m = log_ratios(batch.trainer_logprobs, batch.sampler_logprobs, batch.mask)
        return finish(old_logprobs=batch.trainer_logprobs, weights=torch.ones_like(delta), keep=m, delta=delta, mask=m)

    def in_update(self, micro: MicroBatchView) -> InUpdate:
        return InUpdate(weights=torch.ones_like(micro.weights), mask=micro.mask)

    def step_size(self, batch: BatchView) -> StepSize:
        return StepSize()

    def state_dict(self) -> dict:
        """What the method carries from step to step (plain ints and floats), saved with a checkpoint; {} for none."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned (a resumed run continues as the uninterrupted one)."""

    def __call__(self, train_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor,
                 advantages: torch.Tensor | None = None, token_staleness: torch.Tensor | None = None
                 ) -> CorrectionOutput:
        """`before_update` on ``[B, T]`` right-padded trainer and sampler log-probs of the sampled tokens, the bool
        response mask and (for a method that reads them) the advantages and each token's staleness."""
        if advantages is None:
            advantages = torch.zeros(train_logprobs.shape, dtype=torch.float32, device=train_logprobs.device)
        return self.before_update(BatchView(trainer_logprobs=train_logprobs, sampler_logprobs=sampler_logprobs,
                                            mask=mask, advantages=advantages, token_staleness=token_staleness))


def check_versions(correction: Correction, tracked: bool, option: str = "correction") -> None:
    """Refuse a correction that reads each token's staleness (`needs_versions`) in a run that tracks no versions
    (`tracked` False: train.staleness=0, where every token is pi_old's own), before any engine starts: ValueError in one
    line naming `option` and the correction (a stack: its stages that read them)."""
    if not correction.needs_versions or tracked:
        return
    stages = getattr(getattr(correction, "stack", correction), "stages", None)  # a Stack, or OnCurrentPolicy's
    named = type(correction).__name__ if stages is None else \
        "+".join(name for name, stage in stages.items() if stage.needs_versions)
    raise ValueError(f"{option}: {named} reads each token's weight version, which this run does not track "
                     "(train.staleness=0); use train.staleness >= 1, with whole responses or train.partial_rollouts=true")


# What the correction dropped and what it kept, inside the update (`drop_split`; logged by every method).
DROP_SPLIT_KEYS = (
    "kl_k3_dropped",               # prime-rl's masked_mismatch_kl
    "kl_k3_kept",                  # prime-rl's unmasked_mismatch_kl
    "dropped_advantage_positive",  # prime-rl's masked_advantage_positive
    "dropped_advantage_negative",  # prime-rl's masked_advantage_negative
)


def drop_split(micro: MicroBatchView, response_mask: torch.Tensor, kept: torch.Tensor) -> dict[str, tuple[float, float]]:
    """prime-rl's split of the mismatch over the tokens a correction kept and those it dropped, for one micro-batch
    of the update, as `InUpdate.counts` pairs (summed over micro-batches and ranks, logged as their ratio).
    `kept`: the in-update stage's mask (`InUpdate.mask`); what the batch stage kept is `micro.mask`.

    With delta_t = log pi_theta(y_t) - log mu(y_t) (the update's own forward against the sampler) and k3 = e^delta -
    1 - delta per token, for each sample (row) i, D_i its dropped tokens (`response_mask` and not kept: the batch
    stage's drops and the in-update ones together) and K_i its kept ones:
        kl_k3_dropped = mean_i mean_{t in D_i} k3_t,  kl_k3_kept = mean_i mean_{t in K_i} k3_t,
        dropped_advantage_positive / _negative = mean_i share of D_i with A_t > 0 / A_t < 0 (A_t = 0 is neither),
    a sample's mean 0 where its set is empty (so a run that drops nothing logs 0, not NaN) and the outer mean over
    every sample of the micro-batches: prime-rl's `default_loss_fn` metrics masked_mismatch_kl, unmasked_mismatch_kl,
    masked_advantage_positive / _negative, each a per-sample `_safe_mean` that `compute_loss` stacks over samples
    (src/prime_rl/trainer/rl/loss.py at 559b447; tests/test_corrections_inside.py holds its figures on a seeded batch).
    Whether the tokens a trust region drops are the ones the sampler and trainer disagree on, and whether it drops
    reinforcement or punishment."""
    m = response_mask.to(micro.logprobs.device, torch.bool)
    kept = kept & micro.mask & m
    dropped = m & ~kept
    mismatch = k3(torch.where(m, micro.logprobs.detach().to(torch.float64) - micro.sampler_logprobs.to(torch.float64),
                              0.0))
    adv = micro.advantages.to(m.device)
    values = torch.stack([mismatch, mismatch, (adv > 0).to(torch.float64), (adv < 0).to(torch.float64)])
    sets = torch.stack([dropped, kept, dropped, dropped])
    sums = torch.where(sets, values, 0.0).sum(2) / sets.sum(2).clamp_min(1)  # [key, row]: each sample's mean
    rows = float(m.size(0))
    return {key: (total, rows) for key, total in zip(DROP_SPLIT_KEYS, sums.sum(1).tolist())}  # one host copy


def check_cap(cap: float) -> float:
    """A truncation or rejection cap C: finite and >= 1 (1 turns every up-weight off)."""
    if not (math.isfinite(cap) and cap >= 1.0):
        raise ValueError(f"correction.cap: must be a finite number >= 1, got {cap}")
    return float(cap)


class CappedImportanceRatio(Correction):
    """The base of the methods whose weight is the importance ratio pi_old / mu of a token or a sequence, bounded
    by a cap C (``tis`` truncates at C, ``seq_tis`` too, ``seq_mis`` rejects above C): pi_old is the trainer's
    (the ratio corrects the samples towards it) and the weights are an importance ratio (a stack refuses two).
    What each does with the ratio and the cap is its own `before_update`.

    Args:
        cap: C; finite and >= 1 (`check_cap`).
    """

    old_policy = Anchor.trainer
    importance_weighted = True

    def __init__(self, cap: float):
        self.cap = check_cap(cap)


def sequence_ratio(delta: torch.Tensor) -> torch.Tensor:
    """exp(S_i) = prod_t r_t, ``[B, 1]``, from `log_ratios`' delta (padding is 0 in it, so S_i sums the response
    tokens); float64, so S_i > ~709.8 overflows to inf."""
    return delta.sum(dim=1, keepdim=True).exp()


def log_ratios(train_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
               mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(delta, mask)``: float64 delta = log pi_train - log pi_sampler with 0 on padding, and a bool mask.

    Both on ``train_logprobs``' device; raises ValueError unless all three are ``[B, T]`` of one shape.
    """
    if train_logprobs.dim() != 2 or not (train_logprobs.shape == sampler_logprobs.shape == mask.shape):
        raise ValueError(
            "correction: expected train_logprobs, sampler_logprobs and mask of equal shape [B, T], got "
            f"{tuple(train_logprobs.shape)}, {tuple(sampler_logprobs.shape)}, {tuple(mask.shape)}"
        )
    device = train_logprobs.device
    m = mask.to(device) != 0
    lt = train_logprobs.detach().to(torch.float64)
    ls = sampler_logprobs.detach().to(device, torch.float64)
    delta = torch.where(m, lt - ls, torch.zeros((), dtype=torch.float64, device=device))
    return delta, m


def masked_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` where ``m`` (0 / 0 = NaN when ``m`` selects nothing). ``x`` may hold garbage outside ``m``."""
    return torch.where(m, x, 0.0).sum() / m.sum()


def masked_max(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Max of ``x`` where ``m``; NaN when ``m`` selects nothing."""
    if x.numel() == 0:
        return x.new_tensor(math.nan)
    return torch.where(m.any(), torch.where(m, x, -math.inf).amax(), math.nan)


def masked_min(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Min of ``x`` where ``m``; NaN when ``m`` selects nothing."""
    if x.numel() == 0:
        return x.new_tensor(math.nan)
    return torch.where(m.any(), torch.where(m, x, math.inf).amin(), math.nan)


def finish(
    *,
    old_logprobs: torch.Tensor,
    weights: torch.Tensor,
    keep: torch.Tensor,
    delta: torch.Tensor,
    mask: torch.Tensor,
    extra: dict[str, torch.Tensor] | None = None,
) -> CorrectionOutput:
    """Assemble a :class:`CorrectionOutput` and the shared metrics (:data:`METRIC_KEYS`) plus ``extra``.

    Args:
        old_logprobs: the log-probs PPO's ratio should use (trainer's or sampler's), any dtype.
        weights: float64 ``[B, T]`` weights; only their values on kept tokens are used.
        keep: bool ``[B, T]`` (or broadcastable), False for rejected tokens; ANDed with ``mask``.
        delta, mask: as returned by :func:`log_ratios`.
        extra: method-specific 0-dim float64 tensors, logged beside the shared metrics.
    """
    kept = mask & keep
    nonempty = mask.any(dim=1)
    seq = delta.sum(dim=1)  # padding is 0, so this sums response tokens only
    r = delta.exp()
    w = torch.where(kept, weights.to(torch.float64), 0.0)
    w_mean = masked_mean(w, kept)
    stats = {
        "ratio_mean": masked_mean(r, mask),
        "ratio_min": masked_min(r, mask),
        "ratio_max": masked_max(r, mask),
        "seq_ratio_max": masked_max(seq, nonempty).exp(),
        "weight_mean": w_mean,
        "weight_std": masked_mean((w - w_mean).square(), kept).sqrt(),
        "weight_ess": w.sum().square() / (kept.sum() * w.square().sum()),  # Kong 1992
        "frac_tokens_masked": masked_mean((~kept).double(), mask),
        "frac_sequences_masked": masked_mean((~kept.any(dim=1)).double(), nonempty),
    } | (extra or {})
    # One device->host copy instead of one sync per metric.
    values = torch.stack([v.to(torch.float64) for v in stats.values()]).tolist()
    return CorrectionOutput(
        old_logprobs=torch.where(mask, old_logprobs.detach().to(delta.device), 0.0),
        weights=torch.where(kept, weights.detach().to(torch.float64), 0.0).to(torch.float32),
        mask=kept,
        metrics=dict(zip(stats, values)),
    )
