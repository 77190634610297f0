"""Training-inference mismatch metrics.

The sampler (vLLM) draws a response and reports ``log pi_sampler`` of each sampled token; the
trainer recomputes ``log pi_train`` for the same tokens. Everything here is a function of the
per-token log-ratio

    delta = log pi_train - log pi_sampler,    r = exp(delta) = pi_train / pi_sampler,

so ``delta > 0`` means the trainer puts *more* mass on the sampled token than the sampler did,
and ``r`` is the importance ratio that corrects sampler draws towards the trainer policy.

Sources:
  * Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
    (truncated importance sampling, TIS): probability gaps between vLLM and the trainer.
  * Liu et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the
    Training-Inference Mismatch": sequence-level and geometric-mean ratios, chi^2 as the
    variance of importance weights, sampler-vs-trainer KL and perplexity.
  * MiniMax-M1 technical report 2025: Pearson correlation of train vs. sampler token
    probabilities (0.987 -> 0.997 with an FP32 LM head).
  * Qi et al. 2025, "Defeating the Training-Inference Mismatch via FP16".
  * Schulman 2020, "Approximating KL Divergence" (k1, k2, k3 estimators: rlmm/mismatch/kl.py).
  * Kong 1992, "A note on importance sampling using standardized weights" (effective sample size).
  * NeMo-RL's ClippedPGLossFn (nemo_rl/algorithms/loss/loss_functions.py): policy_kl_error, js_divergence_error,
    token_mult_prob_error (its gen_kl_error is kl_k3).

All arithmetic is float64 whatever the input dtype: bf16/fp16 log-probs convert to float64
exactly, so the numbers reported are the mismatch of the inputs, not rounding of the metric.
See docs/metrics.md for what each number tells a researcher.
"""

from __future__ import annotations

import math

import torch

from rlmm.mismatch.kl import k1, k2, k3

__all__ = ["mismatch_metrics", "turn_boundary_metrics", "turn_boundaries", "staleness_decomposition", "position_profile", "entropy_profile", "early_vs_late",
           "METRIC_KEYS"]

METRIC_KEYS = (
    "num_tokens",
    "num_sequences",
    "prob_abs_diff_mean",
    "prob_abs_diff_max",
    "prob_abs_diff_std",
    "logprob_abs_diff_mean",
    "logprob_abs_diff_max",
    "prob_pearson",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "policy_kl_error",
    "js_divergence_error",
    "token_mult_prob_error",
    "ppl_train",
    "ppl_sampler",
    "ppl_ratio",
    "chi2_token",
    "chi2_seq",
    "seq_logratio_mean",
    "seq_logratio_abs_max",
    "seq_geo_logratio_mean",
    "seq_geo_logratio_abs_max",
    "ratio_mean",
    "ratio_std",
    "ratio_min",
    "ratio_max",
    "ess_token",
    "ess_seq",
    "frac_ratio_outside",
)


def _gather(
    train_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(log pi_train, log pi_sampler, mask)`` as float64/float64/bool ``[B, T]``.

    Padding positions are set to 0 (ratio 1) so that garbage there (inf, nan) can never leak into
    a sum: ``0 * nan`` is nan, whereas ``where`` discards the unselected branch entirely.
    """
    if train_logprobs.dim() != 2 or not (
        train_logprobs.shape == sampler_logprobs.shape == mask.shape
    ):
        raise ValueError(
            "expected train_logprobs, sampler_logprobs and mask of equal shape [B, T], got "
            f"{tuple(train_logprobs.shape)}, {tuple(sampler_logprobs.shape)}, {tuple(mask.shape)}"
        )
    device = train_logprobs.device
    m = mask.to(device) != 0
    zero = torch.zeros((), dtype=torch.float64, device=device)
    lt = torch.where(m, train_logprobs.detach().to(device, torch.float64), zero)
    ls = torch.where(m, sampler_logprobs.detach().to(device, torch.float64), zero)
    return lt, ls, m


def _pearson(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Pearson correlation; NaN when either side is constant (correlation undefined)."""
    xc, yc = x - x.mean(), y - y.mean()
    # sqrt of the product (not product of sqrts) so identical inputs give exactly 1.
    corr = ((xc * yc).sum() / ((xc * xc).sum() * (yc * yc).sum()).sqrt()).clamp(-1.0, 1.0)
    # A constant column's centred values are not exactly 0 after the rounded mean, so test directly.
    constant = (x.max() == x.min()) | (y.max() == y.min())
    return torch.where(constant, torch.full_like(corr, math.nan), corr)


def _ess(log_w: torch.Tensor) -> torch.Tensor:
    """Normalised ESS (sum w)^2 / (n sum w^2) of weights ``exp(log_w)``, in (0, 1].

    ESS is scale-invariant, so shifting by the max log-weight keeps every weight in (0, 1]: the
    sequence ratios exp(sum delta) overflow float64 long before the ESS itself is degenerate.
    """
    w = (log_w - log_w.max()).exp()
    return w.sum() ** 2 / (w.numel() * (w * w).sum())


def mismatch_metrics(
    train_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    ratio_cap: float = 2.0,
) -> dict[str, float]:
    """Summarise the training-inference mismatch of one batch of sampled responses.

    Args:
        train_logprobs: ``[B, T]`` log pi_train of the sampled token at each response position.
        sampler_logprobs: ``[B, T]`` log pi_sampler of the same tokens (e.g. vLLM's logprobs).
        mask: ``[B, T]`` bool or 0/1, true on real response tokens (right-padded).
        ratio_cap: C for ``frac_ratio_outside``; must be >= 1.

    With delta_t = log pi_train - log pi_sampler over the n masked tokens, r_t = exp(delta_t),
    p = exp(logprob), and per non-empty sequence i with length L_i, S_i = sum_t delta_t:

    * ``prob_abs_diff_{mean,max,std}`` = stats of |p_train - p_sampler|
      (Yao et al. 2025; Qi et al. 2025). Std is the population std (divides by n).
    * ``logprob_abs_diff_{mean,max}`` = stats of |delta|.
    * ``prob_pearson`` = Pearson corr(p_train, p_sampler) over tokens (MiniMax-M1 2025).
    * ``kl_k1`` = mean(-delta), ``kl_k2`` = mean(delta^2 / 2), ``kl_k3`` = mean(r - 1 - delta):
      Schulman's (2020) estimators of KL(pi_sampler || pi_train) from sampler draws (``kl_k3`` is NeMo-RL's
      ``gen_kl_error``).
    * NeMo-RL's: ``policy_kl_error`` = mean(1/r - 1 + delta), k3 with the sides swapped (on sampler draws it
      estimates no KL exactly; NeMo-RL logs it as KL(pi_train || pi_sampler)); ``js_divergence_error`` = mean of
      (k3(log p_train - log m) + k3(log p_sampler - log m)) / 2 with m = (p_train + p_sampler) / 2 the sampled
      token's two probabilities' mean; ``token_mult_prob_error`` = mean exp|delta| (>= 1, 1 = no mismatch).
    * ``ppl_train`` = exp(-mean log pi_train), ``ppl_sampler`` = exp(-mean log pi_sampler),
      ``ppl_ratio`` = ppl_train / ppl_sampler (= exp(kl_k1)) (Liu et al. 2025).
    * ``chi2_token`` = mean((r - 1)^2), ``chi2_seq`` = mean_i((exp(S_i) - 1)^2): estimates of
      chi^2(pi_train || pi_sampler), the variance of token / sequence importance weights
      (Liu et al. 2025). ``chi2_seq`` is inf once some S_i > ~354.9, because exp(S_i)^2
      overflows float64; nothing is clamped, the inf is the honest answer.
    * ``seq_logratio_{mean,abs_max}`` over S_i; ``seq_geo_logratio_{mean,abs_max}`` over S_i / L_i,
      the log of the geometric-mean ratio (Liu et al. 2025 geometric RS; GSPO-style normalisation).
    * ``ratio_{mean,std,min,max}`` over r (population std); ``ess_token`` = (sum r)^2 / (n sum r^2)
      and ``ess_seq`` the same over exp(S_i) (Kong 1992); both in (0, 1], 1 = no mismatch.
    * ``frac_ratio_outside`` = fraction of tokens with r < 1/C or r > C (the tokens a TIS/MIS
      threshold of C would touch; Yao et al. 2025).

    Only masked tokens count; sequences with no response token are ignored. Counts are ints,
    all else plain floats. An empty mask returns ``num_tokens`` 0 and NaN elsewhere; undefined
    values (e.g. correlation of a constant) are NaN. Non-finite log-probs on *real* tokens are
    propagated, not hidden.
    """
    if not ratio_cap >= 1.0:
        raise ValueError(f"ratio_cap must be >= 1, got {ratio_cap}")
    lt, ls, m = _gather(train_logprobs, sampler_logprobs, mask)
    lengths = m.sum(dim=1)
    nonempty = lengths > 0
    num_tokens, num_sequences = int(lengths.sum()), int(nonempty.sum())
    if num_tokens == 0:
        return {k: math.nan for k in METRIC_KEYS} | {"num_tokens": 0, "num_sequences": 0}

    t, s = lt[m], ls[m]
    d = t - s
    p_diff = (t.exp() - s.exp()).abs()
    r = d.exp()
    seq = (lt - ls).sum(dim=1)[nonempty]  # padding is 0, so this sums response tokens only
    geo = seq / lengths[nonempty]
    ppl_train, ppl_sampler = (-t.mean()).exp(), (-s.mean()).exp()
    log_m = torch.logaddexp(t, s) - math.log(2.0)  # log of the two probabilities' mean, without leaving log space

    stats = {
        "prob_abs_diff_mean": p_diff.mean(),
        "prob_abs_diff_max": p_diff.max(),
        "prob_abs_diff_std": p_diff.std(correction=0),
        "logprob_abs_diff_mean": d.abs().mean(),
        "logprob_abs_diff_max": d.abs().max(),
        "prob_pearson": _pearson(t.exp(), s.exp()),
        "kl_k1": k1(d).mean(),
        "kl_k2": k2(d).mean(),
        "kl_k3": k3(d).mean(),  # expm1 inside: r - 1 stays accurate when delta ~ 1e-8 (bf16 vs fp32)
        "policy_kl_error": k3(-d).mean(),
        "js_divergence_error": ((k3(t - log_m) + k3(s - log_m)) / 2).mean(),
        "token_mult_prob_error": d.abs().exp().mean(),
        "ppl_train": ppl_train,
        "ppl_sampler": ppl_sampler,
        "ppl_ratio": ppl_train / ppl_sampler,
        "chi2_token": torch.expm1(d).square().mean(),
        "chi2_seq": torch.expm1(seq).square().mean(),
        "seq_logratio_mean": seq.mean(),
        "seq_logratio_abs_max": seq.abs().max(),
        "seq_geo_logratio_mean": geo.mean(),
        "seq_geo_logratio_abs_max": geo.abs().max(),
        "ratio_mean": r.mean(),
        "ratio_std": r.std(correction=0),
        "ratio_min": r.min(),
        "ratio_max": r.max(),
        "ess_token": _ess(d),
        "ess_seq": _ess(seq),
        "frac_ratio_outside": ((r < 1.0 / ratio_cap) | (r > ratio_cap)).double().mean(),
    }
    # One device->host copy instead of one sync per metric.
    values = torch.stack(list(stats.values())).tolist()
    return {"num_tokens": num_tokens, "num_sequences": num_sequences} | dict(zip(stats, values))


def token_agreement(train_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor) -> dict:
    """The share of response tokens whose log-prob the trainer and the sampler give to the same bits, and whether
    that is every token: a sampler and a trainer in exact agreement ("bitwise on-policy", as slime and the
    vLLM + TorchTitan work build on GPUs with batch-invariant kernels) have no mismatch to correct. Whether two
    engines get there depends on the CPU's kernels (docs/precision.md), not only on the settings."""
    same = (train_logprobs == sampler_logprobs)[mask]
    return {"num_tokens": int(same.numel()),
            "frac_tokens_identical": same.double().mean().item() if same.numel() else 0.0,
            "bitwise_identical": bool(same.numel()) and bool(same.all())}


def first_difference(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                     mask: torch.Tensor) -> tuple[int, int] | None:
    """(row, position) of the first response token (row-major over [B, T] under `mask`) whose two log-probs differ in
    their bits, or None where every token agrees. NaN never equals itself: a NaN on either side differs."""
    differ = (trainer_logprobs != sampler_logprobs) & mask
    if not differ.any():
        return None
    row, position = differ.nonzero()[0].tolist()
    return row, position


def staleness_decomposition(
    train_logprobs: torch.Tensor,
    stale_train_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    ratio_cap: float = 2.0,
) -> dict[str, float]:
    """The mismatch of rollouts sampled with stale weights, split into a numerical and a policy-lag part.

    The sampler drew the tokens with the weights of k updates ago (mu = pi_sampler at v_{u-1-k}); the
    trainer scores them now (pi_train at v_{u-1}) and scored them with the weights that sampled them
    (pi_stale = pi_train at v_{u-1-k}). Per token the log-ratio splits exactly:

        delta = log pi_train - log mu = (log pi_stale - log mu) + (log pi_train - log pi_stale)
                                      =   delta_numerical       +   delta_policy_lag

    ``numerical/<key>`` is :func:`mismatch_metrics` of (pi_stale, mu): the same weights on both sides, so
    kernels and precision alone (at staleness 0 it is the step's own mismatch); ``policy_lag/<key>`` is
    :func:`mismatch_metrics` of (pi_train, pi_stale): the same trainer at two weight versions (its
    ``ppl_sampler`` is the stale trainer's perplexity). The total is :func:`mismatch_metrics` of (pi_train, mu),
    the step's ``mismatch/`` keys. The metrics linear in delta add up: ``kl_k1``, ``seq_logratio_mean`` and
    ``seq_geo_logratio_mean`` of the two parts sum to the total's (to float64 rounding), and ``ppl_ratio``
    multiplies; the others (|delta|, k2, k3, chi^2, ESS) are not additive and are reported per part.

    Per token throughout: under partial rollouts (rlmm/run/partial_rollouts.py) a response's tokens were sampled by
    several versions, and pi_stale of each token is the trainer at that token's own version (each chunk scored
    right after it was sampled), so the split holds token by token on mixed responses (tests/test_partial_rollouts.py).
    """
    numerical = mismatch_metrics(stale_train_logprobs, sampler_logprobs, mask, ratio_cap=ratio_cap)
    lag = mismatch_metrics(train_logprobs, stale_train_logprobs, mask, ratio_cap=ratio_cap)
    return {**{f"numerical/{k}": v for k, v in numerical.items()}, **{f"policy_lag/{k}": v for k, v in lag.items()}}


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] position of each column in its row's response, 0 at the row's first masked token (the
    response may start after left padding); meaningful where `mask` is true."""
    cols = torch.arange(mask.shape[1], device=mask.device)
    first = torch.where(mask, cols, mask.shape[1]).min(dim=1, keepdim=True).values
    return cols - first


def position_profile(
    train_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_buckets: int = 8,
    bucket_size: int | None = None,
) -> dict[str, list]:
    """Mismatch as a function of position in the response.

    Position t counts from 0 at each sequence's first response token. Buckets are either
    fixed-width ``[k * bucket_size, (k + 1) * bucket_size)`` for k = 0 .. ceil(L / bucket_size) - 1,
    or (when ``bucket_size`` is None) ``num_buckets`` equal-width buckets spanning [0, L), where
    L is the longest response in the batch. Equal-width edges are L * k / num_buckets rounded up,
    which selects exactly the integer positions of the real-valued bucket; when L < num_buckets
    some buckets are necessarily empty.

    Returns equal-length lists ``bucket_start``, ``bucket_end`` (exclusive), ``num_tokens`` and,
    per bucket, the token means ``logprob_abs_diff_mean`` = mean |delta|,
    ``prob_abs_diff_mean`` = mean |p_train - p_sampler| and ``kl_k3`` = mean(r - 1 - delta)
    (Schulman 2020), with the conventions of :func:`mismatch_metrics`. Empty buckets hold NaN
    with ``num_tokens`` 0; an empty mask gives ``num_buckets`` empty buckets [0, 0), or no buckets
    with ``bucket_size``. Liu et al. 2025 find the mismatch concentrates in long responses,
    which is what this profile makes visible.
    """
    lt, ls, m = _gather(train_logprobs, sampler_logprobs, mask)
    pos = _positions(m)[m]
    length = int(pos.max()) + 1 if pos.numel() else 0

    if bucket_size is not None:
        if bucket_size < 1:
            raise ValueError(f"bucket_size must be >= 1, got {bucket_size}")
        n_b = -(-length // bucket_size)
        edges = [k * bucket_size for k in range(n_b + 1)]
        idx = pos // bucket_size
    else:
        if num_buckets < 1:
            raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
        n_b = num_buckets
        edges = [-(-k * length // n_b) for k in range(n_b + 1)]  # ceil(k * L / n_b), exact ints
        idx = pos * n_b // max(length, 1)

    t, s = lt[m], ls[m]
    d = t - s
    per_token = torch.stack(
        [torch.ones_like(d), d.abs(), (t.exp() - s.exp()).abs(), k3(d)]
    )
    sums = torch.zeros(4, n_b, dtype=torch.float64, device=d.device).index_add_(1, idx, per_token)
    means = sums[1:] / sums[0]  # 0 / 0 = NaN for empty buckets, as documented
    counts = sums[0].long().tolist()
    abs_d, abs_p, kl = means.tolist()
    return {
        "bucket_start": edges[:-1],
        "bucket_end": edges[1:],
        "num_tokens": counts,
        "logprob_abs_diff_mean": abs_d,
        "prob_abs_diff_mean": abs_p,
        "kl_k3": kl,
    }


def entropy_profile(
    train_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    mask: torch.Tensor,
    entropy: torch.Tensor,
    *,
    edges: tuple[float, ...] = (0.1, 0.5, 1.0, 2.0),
) -> dict[str, list]:
    """Mismatch as a function of the token's entropy H_t (nats, ``[B, T]``: the policy's entropy at each response
    position, e.g. the trainer's, rlmm/algos/entropy.py).

    Buckets ``[0, e_1), [e_1, e_2), ..., [e_k, inf)`` for ``edges`` e_1 < ... < e_k (all > 0). Returns equal-length
    lists ``bucket_start``, ``bucket_end`` (exclusive; ``inf`` for the last), ``num_tokens`` and per bucket the token
    means ``logprob_abs_diff_mean`` = mean |delta|, ``kl_k3`` = mean(r - 1 - delta) (Schulman 2020) and ``ratio_std``
    = the population std of r (the scale a ratio threshold acts on), with the conventions of :func:`mismatch_metrics`;
    an empty bucket holds NaN with ``num_tokens`` 0. A token whose entropy is not finite is left out (counted in no
    bucket). The argument for it: the natural scale of the ratio grows with the token's entropy, so one ratio
    threshold for every token clips high-entropy tokens for their ordinary noise (arXiv 2607.22186, as issue 49 cites
    it); this shows the scale per entropy band. Not an anchor's metric: it is checked against values worked out by
    hand.
    """
    if not edges or any(not e > 0 for e in edges) or list(edges) != sorted(set(edges)):
        raise ValueError(f"entropy_profile: edges must be increasing and > 0, got {list(edges)}")
    lt, ls, m = _gather(train_logprobs, sampler_logprobs, mask)
    h = entropy.detach().to(lt.device, torch.float64)
    if h.shape != m.shape:
        raise ValueError(f"entropy_profile: entropy has shape {tuple(h.shape)}, expected {tuple(m.shape)}")
    counted = m & torch.isfinite(h)
    d = (lt - ls)[counted]
    bounds = torch.tensor(edges, dtype=torch.float64, device=d.device)
    idx = torch.bucketize(h[counted], bounds, right=True)  # [0, e_1) -> 0, ..., [e_k, inf) -> k
    r = d.exp()
    per_token = torch.stack([torch.ones_like(d), d.abs(), k3(d), r, r * r])
    sums = torch.zeros(5, len(edges) + 1, dtype=torch.float64, device=d.device).index_add_(1, idx, per_token)
    means = sums[1:] / sums[0]  # 0 / 0 = NaN for an empty bucket
    ratio_std = (means[3] - means[2].square()).clamp_min(0).sqrt()
    return {
        "bucket_start": [0.0, *map(float, edges)],
        "bucket_end": [*map(float, edges), math.inf],
        "num_tokens": sums[0].long().tolist(),
        "logprob_abs_diff_mean": means[0].tolist(),
        "kl_k3": means[1].tolist(),
        "ratio_std": ratio_std.tolist(),
    }


def early_vs_late(
    train_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    response_tokens: int,
    window: int,
) -> dict[str, float]:
    """The mismatch early and late in the same responses.

    Of every response at least ``response_tokens`` long, the tokens at positions ``[0, window)``
    (early) and ``[response_tokens - window, response_tokens)`` (late), so both windows hold the same
    number of tokens from the same responses. :func:`position_profile`'s late buckets hold only the
    responses that got that long, so its growth mixes the position with which responses are long
    (Liu et al. 2025 find the mismatch largest on low-probability tokens, which long answers have
    more of); here the difference ``late - early`` is the position's alone, paired within each
    response. Means over tokens: ``logprob_abs_diff_mean`` = mean |delta| and ``kl_k3`` =
    mean(r - 1 - delta) (Schulman 2020), as in :func:`mismatch_metrics`. No long response: NaN.
    """
    if window < 1 or 2 * window > response_tokens:
        raise ValueError(f"early_vs_late: need 1 <= window and 2 * window <= response_tokens, got "
                         f"window={window}, response_tokens={response_tokens}")
    lt, ls, m = _gather(train_logprobs, sampler_logprobs, mask)
    pos = _positions(m)
    long = m & (m.sum(dim=1, keepdim=True) >= response_tokens)
    d = lt - ls
    out = {"num_sequences": int(long.any(dim=1).sum()), "response_tokens": response_tokens, "window": window}
    for name, selected in (("early", long & (pos < window)),
                           ("late", long & (pos >= response_tokens - window) & (pos < response_tokens))):
        dd = d[selected]
        out[f"{name}_logprob_abs_diff_mean"] = dd.abs().mean().item() if dd.numel() else math.nan
        out[f"{name}_kl_k3"] = k3(dd).mean().item() if dd.numel() else math.nan
    out["late_minus_early_logprob_abs_diff"] = out["late_logprob_abs_diff_mean"] - out["early_logprob_abs_diff_mean"]
    return out


def turn_boundaries(sampled: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: the sampled tokens at a turn's edge, its first or its last (its end-of-turn token), given the
    [B, T] mask of the tokens the policy sampled (a multi-turn response's turns are its runs of sampled tokens)."""
    before = torch.nn.functional.pad(sampled[:, :-1], (1, 0), value=False)
    after = torch.nn.functional.pad(sampled[:, 1:], (0, 1), value=False)
    return sampled & ~(before & after)


def turn_boundary_metrics(train_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                          mask: torch.Tensor) -> dict[str, float]:
    """A multi-turn batch's mismatch at the turns' edges and inside them (`mask`: the sampled tokens):

    - ``token_mult_prob_error_boundary``, ``token_mult_prob_error_generated``: NeMo-RL's
      ``token_mult_prob_error`` = mean over tokens of exp(|log pi_train - log pi_sampler|) (ClippedPGLossFn,
      nemo_rl/algorithms/loss/loss_functions.py; 1 where the two agree), over the tokens at a turn's edge
      (`turn_boundaries`: where a re-rendered conversation most often differs from the sampled one: the
      end-of-turn token, the first token after the environment's) and over the others;
    - ``frac_trainer_logprob_below_neg10``: the share of sampled tokens whose trainer log-prob is below -10 (a
      token the trainer all but rules out: re-tokenization's signature, -0.02 -> -28 in the reports).
    NaN for a part with no token."""
    lt, ls, m = _gather(train_logprobs, sampler_logprobs, mask)
    edge = turn_boundaries(m)
    error = (lt - ls).abs().exp()
    out = {}
    for name, part in (("boundary", edge), ("generated", m & ~edge)):
        out[f"token_mult_prob_error_{name}"] = error[part].mean().item() if part.any() else math.nan
    out["frac_trainer_logprob_below_neg10"] = (lt[m] < -10).double().mean().item() if m.any() else math.nan
    return out
