"""The benchmark scripts that the prepared GPU check runs must keep running: here at their CPU dry size.

`benchmarks/layouts.py` (scripts/gpu_fsdp_check.sh's `layouts` step) times the train phase under each
micro-batch layout; its figures are only as good as its bookkeeping, so the positions and micro-batch counts
it reports are checked against what the layouts must compute on its rows.
"""
from __future__ import annotations

import json
import subprocess
import sys

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
