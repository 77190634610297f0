"""Finding runs and reading their records: the run directories of a sweep (Hydra multirun dirs, globs,
or W&B through `wandb_source`), each job's overrides, and its `steps.jsonl`, `summary.json` or
`probe.json` as a `Run`."""
from __future__ import annotations

import glob as globlib
import json
import os
import re
from pathlib import Path

from rlmm.run.records import finished, read_steps_and_damage
from rlmm.table.base import Run, TableError, is_number, number, set_status
from rlmm.table.wandb_source import read_wandb

RUN_DIR_MARKERS = (".hydra/overrides.yaml", "config.yaml", "steps.jsonl", "summary.json", "probe.json")
# probe.json sections -> metric prefixes (the sampler-vs-trainer numbers under the names train logs).
PROBE_SECTIONS = {"sampler_vs_trainer": "mismatch", "trainer_vs_itself": "trainer_vs_itself",
                  "sampler_vs_itself": "sampler_vs_itself", "early_vs_late": "position", "agreement": "agreement",
                  "decode_vs_prefill": "decode_vs_prefill"}
PROBE_ROLLOUTS = {"mean_reward": "reward_mean", "mean_response_length": "response_length_mean",
                  "frac_truncated": "frac_truncated", "num": "num"}


def find_run_dirs(source: str | Path) -> list[Path]:
    """Run directories under a path: the path itself if it is a run, else its job subdirectories,
    or one level deeper (a directory of sweeps). Hidden directories (`.submitit/`) are skipped."""
    path = Path(source)
    if _is_run_dir(path):
        return [path]
    found = []
    for child in _children(path):
        if _is_run_dir(child):
            found.append(child)
        else:
            found += [grandchild for grandchild in _children(child) if _is_run_dir(grandchild)]
    return found


def _children(path: Path) -> list[Path]:
    dirs = [p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return sorted(dirs, key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)])


def _is_run_dir(path: Path) -> bool:
    return any((path / marker).exists() for marker in RUN_DIR_MARKERS)


def read_overrides(run_dir: Path) -> dict[str, str]:
    """`key=value` overrides of a Hydra job (`hydra.*` left out; `+key` counts as `key`)."""
    import yaml

    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.exists():
        return {}
    overrides = {}
    for item in yaml.safe_load(path.read_text()) or []:
        key, _, value = str(item).partition("=")
        deleted = key.startswith("~")
        key = key.lstrip("+~")
        if not key.startswith("hydra.") and key != "hydra":
            overrides[key] = "<deleted>" if deleted else value
    return overrides


def read_local_run(run_dir: Path, name: str) -> Run:
    run = Run(name=name, path=str(run_dir), overrides=read_overrides(run_dir))
    probe = run_dir / "probe.json"
    if probe.exists():
        try:
            record = json.loads(probe.read_text())
        except json.JSONDecodeError:
            return set_status(run, complete=False, note="probe.json unreadable")
        run.kind, run.steps = "probe", 1
        run.values = probe_values(record)
        return set_status(run, complete=True)
    run.history, run.damage = read_steps_and_damage(run_dir)
    run.kind = "train" if run.history else ""
    run.steps = max((int(row.get("step", 0)) for row in run.history), default=0)
    if not finished(run_dir):  # no summary.json, or a torn one (`rlmm train` resumes such a run too)
        return set_status(run, complete=False)
    record = json.loads((run_dir / "summary.json").read_text())
    run.values = {f"summary/{k}": number(v) for k, v in record.items() if is_number(v)}
    steps = record.get("steps")
    if not run.damage and isinstance(steps, int) and run.steps < steps:  # rows lost from its end: not whole
        return set_status(run, complete=False, note=f"its record ends at step {run.steps} of {steps} (summary.json)")
    return set_status(run, complete=True)


def probe_values(record: dict) -> dict[str, float]:
    """probe.json's scalar numbers as metrics: `mismatch/*` (sampler vs trainer), `trainer_vs_itself/*`,
    `sampler_vs_itself/*`, `position/*` (early vs late), `agreement/*` (tokens scored to the same bits),
    `decode_vs_prefill/*` (the sampler's decoding against its own prefill), `simulated/*` (real vs simulated),
    `attribution/*` (the op-class attribution), `layers/*` (the layer attribution),
    `rollout/*`, `perf/seconds`."""
    values = {}
    for section, prefix in PROBE_SECTIONS.items():
        for key, value in record.get(section, {}).items():
            if is_number(value):
                values[f"{prefix}/{key}"] = number(value)
    # An MoE probe's routing part, under the names `rlmm train` logs: routing/<disagreement key>, and
    # routing/own|replayed|share_removed/<gap key> (rlmm/probe/measurements.py::routing_decomposition).
    routing = record.get("routing") or {}
    for key, value in routing.get("disagreement", {}).items():
        if is_number(value):
            values[f"routing/{key}"] = number(value)
    for part in ("own", "replayed", "share_removed"):
        for key, value in routing.get(part, {}).items():
            if is_number(value):
                values[f"routing/{part}/{key}"] = number(value)
    # Real vs simulated: simulated/<ε>/<gap key> per stand-in, simulated/matching_epsilon/<gap key>.
    simulated = record.get("real_vs_simulated") or {}
    for eps, metrics in simulated.get("simulated", {}).items():
        values.update({f"simulated/{eps}/{k}": number(v) for k, v in metrics.items() if is_number(v)})
    for key, value in simulated.get("matching_epsilon", {}).items():
        if is_number(value):
            values[f"simulated/matching_epsilon/{key}"] = number(value)
    # The op-class attribution: attribution/<op>/share_raised|share_lowered/<gap key>, attribution/all_low/<gap key>.
    attribution = record.get("attribution") or {}
    for op, parts in attribution.get("ops", {}).items():
        for part in ("share_raised", "share_lowered"):
            values.update({f"attribution/{op}/{part}/{k}": number(v) for k, v in parts[part].items() if is_number(v)})
    values.update({f"attribution/all_low/{k}": number(v) for k, v in attribution.get("all_low", {}).items()
                   if is_number(v)})
    # The layer attribution: layers/<comparison>/<figure>/<site> and layers/<comparison>/growth.
    layers = record.get("layers") or {}
    for name, figures in layers.get("comparisons", {}).items():
        for figure in ("rel_error", "rel_error_prompt", "rel_error_response", "frac_identical"):
            values.update({f"layers/{name}/{figure}/{site}": number(v) for site, v in zip(layers["sites"], figures[figure])
                           if is_number(v)})
        if is_number(figures["growth"]):
            values[f"layers/{name}/growth"] = number(figures["growth"])
    for key, value in record.get("rollouts", {}).items():
        if key in PROBE_ROLLOUTS and is_number(value):
            values[f"rollout/{PROBE_ROLLOUTS[key]}"] = number(value)
    if "seconds" in record and is_number(record["seconds"]):
        values["perf/seconds"] = number(record["seconds"])
    return values


def read_runs(sources: str | Path | list) -> list[Run]:
    """Every run under the sources: sweep directories, run directories, glob patterns, or
    `wandb:ENTITY/PROJECT[/GROUP]`."""
    sources = [sources] if isinstance(sources, (str, Path)) else list(sources)
    runs, dirs = [], []
    for source in sources:
        text = str(source)
        if text.startswith("wandb:"):
            runs += read_wandb(text)
            continue
        matches = [Path(text)] if Path(text).exists() else [Path(p) for p in sorted(globlib.glob(text))]
        if not matches:
            raise TableError(f"no such file or directory: {text}")
        found = [d for m in matches if m.is_dir() for d in find_run_dirs(m)]
        if not found:
            raise TableError(f"no runs in {text} (expected Hydra job directories holding .hydra/overrides.yaml, "
                             "steps.jsonl, summary.json or probe.json)")
        dirs += found
    dirs = list(dict.fromkeys(d.resolve() for d in dirs))
    root = Path(os.path.commonpath(dirs)) if len(dirs) > 1 else None
    runs += [read_local_run(d, d.relative_to(root).as_posix() if root else d.name) for d in dirs]
    trained, probes = [r for r in runs if r.kind == "train"], [r for r in runs if r.kind == "probe"]
    if trained and probes:  # their metrics differ in kind (per step vs one measurement): no row compares them
        raise TableError(f"the sources hold {len(trained)} training run{'s' if len(trained) != 1 else ''} and "
                         f"{len(probes)} probe{'s' if len(probes) != 1 else ''} ({', '.join(r.name for r in probes[:3])}"
                         f"{', ...' if len(probes) > 3 else ''}): a table compares one kind; give each its own "
                         f"rlmm table")
    return runs
