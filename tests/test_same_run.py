"""scripts/same_run.py, the check behind every behaviour-preserving refactor: it must see a changed metric
and must not see a changed timing."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "same_run.py"


def record(run_dir: Path, steps: list[dict]) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    return run_dir


def same_run(before: Path, after: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(before), str(after)], capture_output=True, text=True)


def test_timings_may_differ_and_metrics_may_not(tmp_path):
    step = {"step": 0, "loss/policy": 0.25, "perf/step_seconds": 1.0, "rollout/tokens_per_second": 10.0}
    before = record(tmp_path / "before", [step, {**step, "step": 1}])  # a record's rows are steps 0, 1, ...
    timing_only = record(tmp_path / "timing", [{**step, "perf/step_seconds": 2.0, "rollout/tokens_per_second": 3.0},
                                               {**step, "step": 1}])
    assert same_run(before, timing_only).returncode == 0
    changed = record(tmp_path / "changed", [step, {**step, "step": 1, "loss/policy": 0.25000001}])
    result = same_run(before, changed)
    assert result.returncode == 1 and "step 1: loss/policy" in result.stdout
    missing = record(tmp_path / "missing", [step])
    assert same_run(before, missing).returncode == 1
