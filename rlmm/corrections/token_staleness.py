"""xtuner's per-token staleness mask: drop the response tokens sampled too many updates before pi_old."""
from __future__ import annotations

import torch

from rlmm.corrections.base import BatchView, Correction, CorrectionOutput, finish, log_ratios, masked_max, masked_mean


class TokenStalenessMask(Correction):
    """Drop the tokens sampled more than N updates before pi_old (``correction=token_staleness_mask``).

    old = log pi_train (unchanged),  w_t = 1,  keep_t = [s_t <= N],
    s_t = the updates between the weights that sampled y_t and pi_old's (`BatchView.token_staleness`; 0: pi_old's
    own weights), N = ``max_token_staleness``.

    For partial rollouts, where one response holds tokens of several weight versions: its tokens from old weights
    are dropped one by one, its fresher ones kept. Source: xtuner's ``max_token_staleness`` (InternLM/xtuner PR
    #2003, commit 52212b2, unchanged at b934f46): `xtuner/v1/data_proto/rl_data.py::_calculate_effective_response_mask`
    keeps token t iff calculate_seq_staleness(model_step_t, current_train_step) < token_stale_threshold, with
    `xtuner/v1/data_proto/utils.py::calculate_seq_staleness` = current_train_step - model_step_t - 1 and
    `xtuner/v1/rl/agent_loop_manager/produce_utils.py::calculate_stale_threshold` = (N + 1) * sync_weights_interval.
    model_step_t is the train step whose weights sampled t and current_train_step the step that trains on it, whose
    trainer holds the weights of step current_train_step - 1: so xtuner's staleness is rlmm's s_t (0 = sampled by
    pi_old's weights, compared with the version the update starts from, not the one it makes), and with rlmm's
    weight sync after every update (sync_weights_interval 1) its strict bound s_t < N + 1 is s_t <= N, inclusive
    (N = 0: only pi_old's own tokens). xtuner ANDs it into the response mask when it takes the train batch
    (`produce_utils.py::take_train_batch`): tokens are dropped, not samples.
    Departures: a sample left with no token is expired in xtuner before it reaches a batch
    (`xtuner/v1/rl/replay_buffer.py::ReplayBuffer._apply_staleness_lifecycle`: re-sampled when its
    `tail_batch_trigger_size` >= 0, its whole group discarded otherwise); a correction cannot re-sample, so here the
    row stays in the batch (its reward in its group's advantages) with no token in the loss (``frac_sequences_masked``).
    xtuner counts N in weight-sync periods of sync_weights_interval steps; rlmm syncs every update, so N counts updates.
    Dropped tokens leave the loss's divisor unless ``algo.count_rejected`` (xtuner's reduced response mask removes
    them). xtuner logs no figure of the mask (its buffer counts the expired samples); this logs, over the batch's
    response tokens (the same wherever it stands in a stack), ``frac_tokens_stale`` (the share with s_t > N: alone,
    its ``frac_tokens_masked``) and ``token_staleness_mean`` / ``token_staleness_max``. Needs the versions
    (`needs_versions`): a run that tracks none refuses it (`check_versions`), and a batch without them raises.

    Args:
        max_token_staleness: N, the most updates a kept token's weights may lag behind pi_old's; an integer >= 0.
    """

    needs_versions = True

    def __init__(self, max_token_staleness: int):
        if isinstance(max_token_staleness, bool) or not isinstance(max_token_staleness, int) or max_token_staleness < 0:
            raise ValueError(f"correction.max_token_staleness: must be an integer >= 0, got {max_token_staleness!r}")
        self.max_token_staleness = max_token_staleness

    def before_update(self, batch: BatchView) -> CorrectionOutput:
        if batch.token_staleness is None:
            raise ValueError("correction: the token staleness mask reads each token's weight version, and this batch "
                             "has none (BatchView.token_staleness is None): use train.staleness >= 1 or "
                             "train.partial_rollouts=true")
        delta, m = log_ratios(batch.trainer_logprobs, batch.sampler_logprobs, batch.mask)
        staleness = batch.token_staleness.to(delta.device)
        response = batch.response_mask.to(delta.device) != 0
        stale = staleness > self.max_token_staleness
        seen = staleness.to(torch.float64)  # masked_mean and masked_max read the response tokens alone
        return finish(old_logprobs=batch.trainer_logprobs, weights=torch.ones_like(delta), keep=~stale, delta=delta,
                      mask=m, extra={"frac_tokens_stale": masked_mean(stale.double(), response),
                                     "token_staleness_mean": masked_mean(seen, response),
                                     "token_staleness_max": masked_max(seen, response)})
