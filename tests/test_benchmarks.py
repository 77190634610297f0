"""The benchmark scripts that the prepared GPU check runs must keep running: here at their CPU dry size.

`benchmarks/layouts.py` (scripts/gpu_fsdp_check.sh's `layouts` step) times the train phase under each
micro-batch layout; its figures are only as good as its bookkeeping, so the positions and micro-batch counts
it reports are checked against what the layouts must compute on its rows.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.common import WORKLOADS, forced_lengths
from tests.conftest import subprocess_env


def test_layouts_benchmark_counts_what_each_layout_computes(tmp_path):
    out = tmp_path / "layouts.json"
    result = subprocess.run([sys.executable, "-m", "benchmarks.layouts", "--workload", "varlen-dry", "--trainer",
                             "torch", "--budget", "64,128", "--repeats", "1", "--out", str(out)],
                            capture_output=True, text=True, timeout=600, env=subprocess_env())
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(out.read_text())
    summary = record["summary"]
    assert list(summary) == ["padded", "packed", "budget_64", "budget_packed_64", "budget_128", "budget_packed_128"]
    w = WORKLOADS["varlen-dry"]
    responses = forced_lengths(w.response_lengths, (w.warmup + w.steps) * w.rollouts)[w.warmup * w.rollouts:]
    (tokens,) = record["tokens_per_minibatch"]  # one measured minibatch: its prompts' tokens + these responses
    assert tokens > sum(responses)
    for name, layout in summary.items():
        (positions,) = layout["positions_per_minibatch"]
        (micro_batches,) = layout["micro_batches"]
        assert layout["attention"] == "sdpa" and layout["wall_sum"] > 0
        assert layout["gradient_checkpointing"] == [False]  # a tiny model fits
        if "packed" in name:  # no padding is computed
            assert positions == tokens, name
        else:
            assert positions > tokens, name
        if name.startswith("budget"):  # each micro-batch holds at most the budget, one row above it alone
            budget = layout["micro_batch_tokens"]
            assert micro_batches >= -(-tokens // budget), name
        else:
            assert micro_batches == -(-w.rollouts // w.micro_batch_size), name
    # longest-first grouping pads less than the fixed consecutive rows
    assert summary["budget_128"]["positions_per_minibatch"][0] < summary["padded"]["positions_per_minibatch"][0]
    assert summary["padded"]["cpu_speedup_vs_padded"] == 1.0


@pytest.mark.slow  # ~45 s
def test_staleness_benchmark_times_both_arms_in_one_process(tmp_path):
    """`benchmarks/staleness.py` runs a real train run per arm in one process and times the steps between its
    logged rows; the staleness-1 arms' timed steps train on rollouts one update old (the partial arm's tokens less:
    only each response's first chunk is), `train.overlap` is a row only where the config has the key (else skipped
    with a line saying so), and an arm `rlmm train` refuses (partial rollouts overlapped did, before the sampler process
    could continue responses) is a skipped row with the refusal."""
    from omegaconf import OmegaConf

    from rlmm.config.options import CONF_DIR

    out = tmp_path / "staleness.json"
    result = subprocess.run([sys.executable, "-m", "benchmarks.staleness", "--steps", "4", "--repeats", "1",
                             "--override", "sampler=hf", "--override", "trainer=torch",
                             "--override", "train.prompts_per_step=2", "--override", "algo.group_size=2",
                             "--out", str(out)], capture_output=True, text=True, timeout=600, env=subprocess_env())
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(out.read_text())
    has_overlap = "overlap" in OmegaConf.load(CONF_DIR / "train.yaml").train
    overlapped_partial = [] if "partial+overlap" in record["skipped"] else ["partial+overlap"]
    assert list(record["summary"]) == (["staleness=0", "staleness=1"] + (["overlap"] if has_overlap else [])
                                       + ["partial"] + overlapped_partial)
    assert ("overlap" in record["skipped"]) != has_overlap
    if "partial+overlap" in record["skipped"]:
        assert "train.partial_rollouts=true with train.overlap=true" in record["skipped"]["partial+overlap"]
    assert record["chunk"] == 2 and record["summary"]["staleness=0"]["vs_staleness_0"] == 1.0
    for arm, s in record["summary"].items():
        assert s["generate_median"] is None if "overlap" in arm else s["generate_median"] > 0
        assert s["sampler_idle_median"] is None if "overlap" in arm else 0 < s["sampler_idle_median"] < s["step_max"]
        assert s["train_median"] > 0 and (s["rollout_wait_median"] is not None) == ("overlap" in arm)
    for run in record["runs"]:
        assert sorted(int(s) for s in run["step_seconds"]) == [1, 2, 3, 4]  # step 0's evaluation row first
        assert all(t > 0 for t in run["step_seconds"].values())
        assert run["staleness_logged"] == ([None, None] if run["arm"] == "staleness=0" else [1.0, 1.0])
        # partial: each response's first 2 tokens (of up to 8) one update old, the rest fresh; whole: all of them old
        if run["arm"].startswith("partial"):
            assert all(0 < t < 1 for t in run["token_staleness_logged"]), run["token_staleness_logged"]
        else:
            assert run["token_staleness_logged"] == ([None, None] if run["arm"] == "staleness=0" else [1.0, 1.0])


def test_moe_expert_kernel_benchmark_times_both_kernels_on_the_same_logits(tmp_path):
    """`benchmarks/moe_experts.py` on a small batch: both kernels timed, and the same logits (what lets the
    loaders pick either on speed alone)."""
    out = tmp_path / "moe_experts.json"
    result = subprocess.run([sys.executable, "-m", "benchmarks.moe_experts", "--repeats", "1", "--rows", "4",
                             "--tokens", "6", "--out", str(out)], capture_output=True, text=True,
                            timeout=600, env=subprocess_env(), stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    summary = json.loads(out.read_text())["summary"]
    assert set(summary) == {"eager", "grouped_mm"}
    assert all(s["forward"] > 0 and s["forward_backward"] > 0 for s in summary.values())
    assert summary["grouped_mm"]["max_abs_logit_diff_vs_eager"] < 1e-4


@pytest.mark.slow  # ~1 min: vLLM starts
def test_quantized_rollouts_benchmark_counts_tokens_and_times_syncs(tmp_path):
    """`benchmarks/quantized_rollouts.py` at its smallest: every response is --new-tokens long (the benchmark
    model's eos cannot be sampled), so each call's token count is fixed; the int8 engine holds half the weight
    bytes of its quantized layers, and the fp8 weights the CPU kernel cannot take are a recorded refusal."""
    out = tmp_path / "quantized.json"
    result = subprocess.run([sys.executable, "-m", "benchmarks.quantized_rollouts", "--model", "smoke", "--rows", "4",
                             "--new-tokens", "4", "--repeats", "1", "--calls", "1", "--modes", "bf16,int8,fp8",
                             "--out", str(out)], capture_output=True, text=True, timeout=600, env=subprocess_env())
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(out.read_text())
    summary, runs = record["summary"], record["runs"]
    assert [r["mode"] for r in runs] == ["bf16", "int8", "fp8"]
    assert all(r["tokens_per_call"] == 4 * 4 for r in runs if "refused" not in r)
    assert summary["bf16"]["throughput_vs_bf16"] == 1.0 and summary["int8"]["tokens_per_second"] > 0
    assert summary["int8"]["kernel"].startswith("CPUInt8ScaledMMLinearKernel") and summary["bf16"]["kernel"] == "-"
    assert summary["int8"]["served_weight_mib"] < summary["bf16"]["served_weight_mib"]
    assert "quantization=fp8" in summary["fp8"]["refused"]
    assert all(summary[m]["sync_seconds"] > 0 for m in ("bf16", "int8"))


@pytest.mark.slow  # two vLLM starts: ~1 min
def test_kept_sets_benchmark_sizes_and_caps_the_sets(tmp_path):
    """`benchmarks/kept_sets.py` at its smallest, on the built-in model: top-k 5 with at most 2 kept tokens listed
    caps every position's set (the 2 most likely tokens and the sampled one: at most 3 ids, 4 bytes each, beside
    the offsets and the capped flag); top-p 0.9 keeps whole sets below the cap of 512."""
    out = tmp_path / "kept.json"
    for spec, max_kept in (("top_k=5", 2), ("top_p=0.9", 512)):
        result = subprocess.run([sys.executable, "-m", "benchmarks.kept_sets", "--model", "builtin", "--rows", "4",
                                 "--new-tokens", "4", "--repeats", "1", "--truncations", spec, "--max-kept",
                                 str(max_kept), "--out", str(out)], capture_output=True, text=True, timeout=600,
                                env=subprocess_env())
        assert result.returncode == 0, result.stderr[-3000:]
        row = json.loads(out.read_text())["rows"][0]
        assert row["vocab"] == 100 and row["tokens"] > 0 and row["tokens_per_second_not_listed"] > 0
        if spec == "top_k=5":
            assert row["frac_capped"] == 1 and 2 <= row["kept_size_max"] <= 3
            assert row["kept_bytes_per_token"] <= 3 * 4 + 8 + 1
        else:
            assert row["frac_capped"] == 0 and row["kept_size_mean"] >= 1


def test_retokenize_cost_benchmark_counts_each_paths_renders(tmp_path):
    """`benchmarks/retokenize_cost.py` at its dry size: each token path's bookkeeping is counted (renders, tokens
    encoded) before it is timed, and the counts are what rlmm's code must do per conversation of T turns:
    `tokens` renders a dummy exchange twice per next prompt (the same few tokens every turn), `retokenize` and
    `realign` the whole conversation once per next prompt (growing with T: quadratic in all), `retokenize`'s
    trained row one whole render and two per assistant turn, and the drift measurement two per assistant turn on
    every path. Times are only checked to be there."""
    out = tmp_path / "retokenize_cost.json"
    result = subprocess.run([sys.executable, "-m", "benchmarks.retokenize_cost", "--dry", "--out", str(out)],
                            capture_output=True, text=True, timeout=600, env=subprocess_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| retokenize | 8 |" in result.stdout and "HFSampler" in result.stdout
    record = json.loads(out.read_text())
    summary = record["summary"]
    assert list(summary) == ["tokens", "retokenize", "realign"]
    turns = [1, 2, 4, 8]
    renders = {"tokens": lambda t: {"next_prompt": 2 * (t - 1), "trained": 0, "turn_drift": 2 * t},
               "retokenize": lambda t: {"next_prompt": t - 1, "trained": 1 + 2 * t, "turn_drift": 2 * t},
               "realign": lambda t: {"next_prompt": t - 1, "trained": 0, "turn_drift": 2 * t}}
    for name, per_turns in summary.items():
        assert [int(t) for t in per_turns] == turns
        for t, s in per_turns.items():
            t = int(t)
            counts = s["counts"]
            assert {stage: c["renders"] for stage, c in counts.items()} == renders[name](t), (name, t)
            assert all(c["encodes"] == c["renders"] for c in counts.values())
            assert counts["turn_drift"] == summary["tokens"][str(t)]["counts"]["turn_drift"]  # the same conversation
            assert s["total_seconds"] > 0 and all(v >= 0 for v in s["seconds"].values())
            # a difference of two timed calls: present, not asserted positive (a loaded machine can invert it)
            assert s["generation_decode_seconds"] >= 0 and "ratio_to_generation" in s
            # canonical sampled ids: no drift, every turn clean, every sampled token (eos included) trained
            assert s["drifted_turns"] == 0 and set(s["kinds"]) <= {"clean"}
            assert s["sampled_in_row"] == s["sampled_tokens"] == summary["tokens"][str(t)]["sampled_tokens"]
            assert s["tokens"] > s["sampled_tokens"] >= t
            # the same conversation's ids; the re-rendered one ends with the template's newline after <|end|>
            assert s["tokens"] == summary["tokens"][str(t)]["tokens"] + (name == "retokenize")
        assert [s["tokens"] for s in per_turns.values()] == sorted({s["tokens"] for s in per_turns.values()})

    def encoded(name, t, stage=None):
        counts = summary[name][str(t)]["counts"]
        return sum(c["encoded_tokens"] for k, c in counts.items() if stage in (None, k))

    # tokens: each next prompt encodes the dummy exchange and one tool reply, whatever came before (linear in T)
    assert encoded("tokens", 8, "next_prompt") <= 1.5 * 7 * encoded("tokens", 2, "next_prompt")
    # the whole conversation per turn: 4x the turns encode far more than 4x the tokens (quadratic: ~16x)
    for name in ("retokenize", "realign"):
        assert encoded(name, 8, "next_prompt") > 8 * encoded(name, 2, "next_prompt"), name
        assert encoded(name, 8, "next_prompt") > encoded("tokens", 8, "next_prompt"), name
    assert encoded("retokenize", 8) > 8 * encoded("retokenize", 2)
    assert encoded("retokenize", 8, "trained") > 8 * encoded("retokenize", 2, "trained")
    generation = record["generation"]
    assert "HFSampler" in generation["reference"] and generation["num_parameters"] > 2_000_000
    assert [r["context"] for r in generation["rows"]] == [16, 64]
    assert all(r["new_tokens"] == [8] and r["call_seconds"] > 0 and r["prefill_seconds"] > 0
               for r in generation["rows"])  # every call generated what it asked (the eos cannot be sampled)


def test_multi_turn_benchmark_rows_hold_the_same_tokens_in_both_arms(tmp_path):
    """`benchmarks/multi_turn.py --dry`: a multi-turn step (T = 2 turns of L = 4 tokens, a tool message between them)
    against a single-turn step of the same row length, both through rlmm's own step. Checked: the bookkeeping, not
    the times (only that they are there): every multi-turn row holds T turns of L drawn tokens and the eos the adapter
    adds to each, ends by `turns`, with T sampler calls a step; every single-turn row samples its whole response in
    one call and is as long (prompt + response) as the multi-turn row of the same prompt; the reported counts are the
    rows'."""
    out = tmp_path / "multi_turn.json"
    result = subprocess.run([sys.executable, "-m", "benchmarks.multi_turn", "--dry", "--out", str(out)],
                            capture_output=True, text=True, timeout=600, env=subprocess_env())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "| multi-turn | 4 | 2 | 10 (8 + 2) |" in result.stdout
    record = json.loads(out.read_text())
    T, L, rows = 2, 4, 2 * 2
    shape = record["shape"]
    assert shape["turns"] == T and shape["tokens_per_turn"] == L
    E, R = shape["environment_tokens"], shape["response_tokens"]
    assert E > 1 and R == T * (L + 1) + (T - 1) * E
    assert record["model"]["special_logprob_max"] < -20 and record["model"]["eos_token_id"] in \
        record["model"]["special_ids"]
    runs = {r["arm"]: r for r in record["runs"]}
    assert record["order"] == ["multi-turn", "single-turn"] and set(runs) == {"multi-turn", "single-turn"}
    multi, single = runs["multi-turn"]["steps"], runs["single-turn"]["steps"]
    assert len(multi) == len(single) == 1  # the measured step (the warm-up's is not kept)
    m, s = multi[0], single[0]
    assert m["rows"]["finish"] == ["turns"] and m["rows"]["turns"] == [T] and m["turns_mean"] == T
    assert m["rows"]["sampled"] == [T * (L + 1)] * rows  # T turns of L drawn tokens and the added eos
    assert m["sampler_calls"] == T and m["engine_tokens"] == rows * T * L and m["added_eos"] == rows * T
    assert s["rows"]["finish"] == ["length"] and s["rows"]["turns"] is None
    assert s["rows"]["sampled"] == [R] * rows and s["sampler_calls"] == 1 and s["engine_tokens"] == rows * R
    assert s["added_eos"] == 0
    for step in (m, s):  # the same first prompts, the same row lengths
        assert step["rows"]["prompt"] == m["rows"]["prompt"] == step["rows"]["first_prompt"]
        assert step["rows"]["response"] == [R] * rows
        assert step["rows"]["row"] == [p + R for p in m["rows"]["prompt"]]
    summary = record["summary"]
    for arm, step in (("multi-turn", m), ("single-turn", s)):
        a = summary[arm]
        assert a["rows"] == rows and a["sampler_calls"] == step["sampler_calls"]
        assert a["sampled_tokens_per_row"] == sum(step["rows"]["sampled"]) / rows
        assert a["engine_tokens_per_row"] + a["added_eos_per_row"] == a["sampled_tokens_per_row"]
        assert a["row_tokens_per_row"] == sum(step["rows"]["row"]) / rows
        assert a["row_tokens_per_step"] == sum(step["rows"]["row"]) and a["sampled_tokens_per_step"] == \
            sum(step["rows"]["sampled"])
        assert all(a[k] > 0 for k in ("wall", "cpu", "generate", "sampler", "train", "weight_sync"))
        assert a["sampler"] <= a["generate"] and step["train_skipped"] == 0
    assert summary["multi-turn"]["row_tokens_per_row"] == summary["single-turn"]["row_tokens_per_row"]
    assert summary["multi-turn"]["token_path"] > 0 and summary["single-turn"]["token_path"] == 0
    assert summary["single-turn"]["vs_single_turn"] == 1.0
