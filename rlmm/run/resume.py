"""Whether a run may start in its run directory, decided before anything in it is written.

A run directory holds a record (rlmm/run/records.py; a probe's probe.json) that is someone's result. Before an app
writes anything there (its config, Hydra's `.hydra/`, the W&B files, the trimmed steps of a resume), this
module reads what is there and decides, from files alone (no engine started, no checkpoint tensor read):

    nothing there (or only the traces of a run that ended before its first step)   -> a fresh run
    a training record and `train.resume=true` with the run's own settings:
        summary.json (the run finished)                        -> nothing to do (exit 0; a sweep's job: the next)
        otherwise                                                        -> resume (or redo from step 0
                                                                            where no checkpoint was written)
    a training record with other settings, or `train.resume=false`                 -> refused, nothing touched
    the checkpoint written by another number of ranks                              -> refused, nothing touched
    a probe into a training run's directory, or a training run into a probe's      -> refused, nothing touched
    a probe into a probe's directory: the same settings                            -> measured again
                                      other settings                               -> refused

"The run's own settings": its config.yaml (or probe.json's "config" and "choices") equals this run's, leaf by
leaf, except the keys in MAY_DIFFER, which change how a run is watched or saved, not what it computes; a key that
became a config group since the run was written (`sampler.quantization: int8`) counts as that group's choice
(`quantization=int8`); a key an option gained since (`sampler.kv_scales`), set here to its YAML's value, is what the
saved run computed too.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from rlmm.run.records import finished, read_record
from rlmm.runtime import checksums
from rlmm.runtime.errors import ConfigError

# Dotted keys (and every key under them) a resumed run may set differently from the run it resumes: where it
# logs, whether it resumes, how often it checkpoints; and `train.overlap`, whose records are the delay line's
# (rlmm/run/rollout_source.py: either mode resumes the other's run).
MAY_DIFFER = ("choices.logger", "logger", "train.resume", "train.checkpoint_every", "train.overlap")
SHOWN_DIFFERENCES = 3
# Where issue 51 (2026-12) moved rlmm's top-level modules: a run written before names its options' classes by
# the old paths in config.yaml (`_target_`), the same classes.
MOVED_MODULES = {
    "rlmm.apps": "rlmm.launch.apps", "rlmm.attribution": "rlmm.mismatch.attribution",
    "rlmm.checkpoint": "rlmm.run.checkpoint", "rlmm.checksums": "rlmm.runtime.checksums",
    "rlmm.collectives": "rlmm.runtime.collectives", "rlmm.components": "rlmm.run.components",
    "rlmm.config": "rlmm.config.options", "rlmm.cpu": "rlmm.runtime.cpu", "rlmm.critic": "rlmm.run.critic",
    "rlmm.devices": "rlmm.runtime.devices", "rlmm.disk": "rlmm.runtime.disk", "rlmm.errors": "rlmm.runtime.errors",
    "rlmm.evaluation": "rlmm.run.evaluation", "rlmm.formatting": "rlmm.runtime.formatting",
    "rlmm.interfaces": "rlmm.run.interfaces", "rlmm.kl": "rlmm.mismatch.kl", "rlmm.launcher": "rlmm.launch.launcher",
    "rlmm.layer_attribution": "rlmm.mismatch.layer_attribution", "rlmm.logging": "rlmm.run.logging",
    "rlmm.logprobs": "rlmm.policy.logprobs", "rlmm.loss_stats": "rlmm.mismatch.loss_stats",
    "rlmm.metrics": "rlmm.mismatch.metrics", "rlmm.monitor": "rlmm.run.monitor",
    "rlmm.overrides": "rlmm.launch.overrides", "rlmm.precision": "rlmm.policy.precision",
    "rlmm.preemption": "rlmm.run.preemption", "rlmm.prefetch": "rlmm.launch.prefetch",
    "rlmm.records": "rlmm.run.records", "rlmm.resume": "rlmm.run.resume",
    "rlmm.rollout_source": "rlmm.run.rollout_source", "rlmm.rollouts": "rlmm.policy.rollouts",
    "rlmm.routing": "rlmm.mismatch.routing", "rlmm.run_lock": "rlmm.run.run_lock",
    "rlmm.runtime_env": "rlmm.runtime.runtime_env", "rlmm.sampler_process": "rlmm.run.sampler_process",
    "rlmm.schema": "rlmm.config.schema", "rlmm.step": "rlmm.run.step", "rlmm.support": "rlmm.policy.support",
    "rlmm.timing": "rlmm.runtime.timing", "rlmm.train": "rlmm.run.train",
    "rlmm.train_report": "rlmm.run.train_report",
}
# Issue 51 also made the loss's objective a node of its own (algo.objective: {_target_, clip_low, ...}): config.yaml of
# a run written before holds `algo.objective: clip` or `cispo` and the objective's keys beside it, the same loss.
MOVED_OBJECTIVES = {"clip": ("rlmm.algos.surrogate.ClippedSurrogate", ("clip_low", "clip_high", "dual_clip")),
                    "cispo": ("rlmm.algos.surrogate.CISPO", ("clip_low", "clip_high"))}


class ResumeRefused(ConfigError):
    """The run directory holds a record this run may not continue or replace; nothing in it was touched."""


class AlreadyFinished(Exception):
    """The run directory holds this very run, finished: there is nothing to do (the record stays as it is)."""


# What a job that found its run finished returns (rlmm/launch/apps.py): a sweep launched again counts those jobs
# (hydra_plugins/rlmm_launcher/sweeper.py), whichever process they ran in.
FINISHED_JOB = "rlmm: finished already, nothing done"


def latest_marker(run_dir: Path) -> Path:
    """`checkpoints/latest`, naming the newest checkpoint (rlmm/run/checkpoint.py::save moves it; a resume reads the
    checkpoints themselves, and this only to say when the one it names is gone)."""
    return Path(run_dir) / "checkpoints" / "latest"


def training_record(run_dir: Path) -> bool:
    """Whether `run_dir` holds a training run's record: a step row, a summary or a checkpoint."""
    steps = run_dir / "steps.jsonl"
    return ((steps.exists() and steps.stat().st_size > 0) or (run_dir / "summary.json").exists()
            or latest_marker(run_dir).exists() or bool(checkpoint_chain(run_dir)))


def leaves(tree, prefix: str = "") -> dict[str, object]:
    """{dotted key: value} of every leaf of a nested dict (lists are leaves)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat = {}
    for key, value in tree.items():
        flat.update(leaves(value, f"{prefix}{key}."))
    return flat or {prefix: {}}


def groups_added_since(saved: dict, current: dict, app: str) -> tuple[str, ...]:
    """The config groups `current` has and the saved run's config lacks altogether (an axis rlmm gained after the run
    was written, e.g. `support=`) where this run has the app's default option as its YAML writes it: what the saved
    run computed too, so no difference."""
    from omegaconf import OmegaConf

    from rlmm.config.options import CONF_DIR, option_node

    defaults = {}
    for entry in OmegaConf.to_container(OmegaConf.load(CONF_DIR / f"{app}.yaml")).get("defaults", []):
        if isinstance(entry, dict):
            defaults.update({k: v for k, v in entry.items() if isinstance(v, str)})
    added = []
    for group, option in current.get("choices", {}).items():
        if group in saved or group in saved.get("choices", {}) or defaults.get(group) != option:
            continue
        if OmegaConf.to_container(option_node(group, option)) == current.get(group):
            added.append(group)
    return tuple(added)


def keys_added_since(saved: dict, current: dict) -> tuple[str, ...]:
    """The dotted keys of an option's node that `current` has and the saved run's node of the same option lacks (a
    key the option gained after the run was written, e.g. `sampler.kv_scales`), where this run holds the option's
    YAML value: the behaviour the saved run had, so no difference."""
    from omegaconf import OmegaConf

    from rlmm.config.options import group_options, option_node

    added = []
    for group, option in current.get("choices", {}).items():
        node, before = current.get(group), saved.get(group)
        if saved.get("choices", {}).get(group) != option or not isinstance(node, dict) or not isinstance(before, dict) \
                or option not in group_options(group):
            continue
        yaml_values = OmegaConf.to_container(option_node(group, option))
        added += [f"{group}.{key}" for key, value in node.items()
                  if key not in before and key in yaml_values and yaml_values[key] == value]
    return tuple(added)


def with_keys_now_groups(saved: dict) -> dict:
    """`saved` with each key that has become a config group since it was written (KEYS_NOW_GROUPS) as that group's
    choice and node: a run written with `sampler.quantization: int8` chose what `quantization=int8` chooses now, and
    conf/quantization/int8.yaml builds what it computed."""
    import copy

    from omegaconf import OmegaConf

    from rlmm.config.options import KEYS_NOW_GROUPS, group_options, option_node

    saved = copy.deepcopy(saved)
    for key, group in KEYS_NOW_GROUPS.items():
        node, _, leaf = key.partition(".")
        if not isinstance(saved.get(node), dict) or leaf not in saved[node] or group in saved.get("choices", {}):
            continue
        option = saved[node].pop(leaf)
        saved.setdefault("choices", {})[group] = option
        if option in group_options(group):  # else no node: the difference names the choice
            saved[group] = OmegaConf.to_container(option_node(group, option))
    return saved


def differences(saved: dict, current: dict, app: str = "train") -> list[str]:
    """`key=saved there, current here` for every leaf that differs, keys of MAY_DIFFER and groups and keys added
    since the run was written at their default (`groups_added_since`, `keys_added_since`) aside; a key that has become
    a group since is compared as that group's choice (`with_keys_now_groups`)."""
    saved = with_keys_now_groups(saved)
    # Through YAML, as config.yaml was written: 1e-3 and tuples come back as what the file holds.
    old, new = leaves(yaml.safe_load(yaml.safe_dump(saved))), leaves(yaml.safe_load(yaml.safe_dump(current)))
    skipped = MAY_DIFFER + tuple(name for group in groups_added_since(saved, current, app)
                                 for name in (group, f"choices.{group}")) + keys_added_since(saved, current)
    shown = []
    for key in sorted(old.keys() | new.keys()):
        name = key.rstrip(".")
        if any(name == allowed or name.startswith(allowed + ".") for allowed in skipped):
            continue
        missing = "(not set)"
        saved_value = current_target(old.get(key, missing)) if name.endswith("._target_") else old.get(key, missing)
        if saved_value != new.get(key, missing):
            shown.append(f"{name}={_shown(old.get(key, missing))} there, {_shown(new.get(key, missing))} here")
    return shown


def objective_as_a_node(saved: dict) -> dict:
    """`saved` with an `algo.objective` string (MOVED_OBJECTIVES) as the node it is now; any other config as it is.
    CISPO had a `dual_clip` that had to be null: it goes too."""
    algo = saved.get("algo")
    named = algo.get("objective") if isinstance(algo, dict) else None
    if not isinstance(named, str) or named not in MOVED_OBJECTIVES:  # a node (or nothing): as this version writes it
        return saved
    target, keys = MOVED_OBJECTIVES[named]
    algo = {k: v for k, v in algo.items() if k not in keys and not (k == "dual_clip" and v is None)}
    algo["objective"] = {"_target_": target, **{k: saved["algo"][k] for k in keys if k in saved["algo"]}}
    return {**saved, "algo": algo}


def current_target(value):
    """A `_target_` as this version of rlmm spells it (MOVED_MODULES); anything else as it is."""
    if isinstance(value, str):
        module, _, name = value.rpartition(".")
        if module in MOVED_MODULES:
            return f"{MOVED_MODULES[module]}.{name}"
    return value


def _shown(value) -> str:
    return "null" if value is None else str(value)


def listed(changed: list[str]) -> str:
    """The first SHOWN_DIFFERENCES differences, and how many more there are."""
    more = len(changed) - SHOWN_DIFFERENCES
    return "; ".join(changed[:SHOWN_DIFFERENCES]) + (f" (and {more} more)" if more > 0 else "")


def newest_checkpoint(run_dir: Path) -> tuple[Path, dict] | None:
    """The newest checkpoint of the run and its state.json, whatever the record holds (the checkpoint a run resumes
    from is `resume_point`'s); None if there is none."""
    chain = checkpoint_chain(run_dir)
    return (chain[0], json.loads((chain[0] / "state.json").read_text())) if chain else None


def checkpoint_step(path: Path) -> int:
    """N of a checkpoint directory `step-N`."""
    return int(path.name.removeprefix("step-"))


def checkpoint_chain(run_dir: Path) -> list[Path]:
    """The run's checkpoints, newest first: every `checkpoints/step-N` (a directory gets that name only once every
    file of it is written: rlmm/run/checkpoint.py::save), whole or not."""
    found = (run_dir / "checkpoints").glob("step-*")
    return sorted((p for p in found if p.is_dir() and p.name[5:].isdigit()), key=checkpoint_step, reverse=True)


def latest_gone(run_dir: Path) -> str | None:
    """The name `checkpoints/latest` gives when no checkpoint of that name is there (removed by hand), else None."""
    marker = latest_marker(run_dir)
    if not marker.exists():
        return None
    name = marker.read_text(errors="replace").strip()
    return None if (marker.parent / name).is_dir() else name


@dataclass(frozen=True)
class ResumePoint:
    """Where a run resumes: `checkpoint` (None: from step 0, its record replaced), its state.json (`state`), and
    what the choice passed over (`warnings`, one line each, for the log)."""

    checkpoint: Path | None
    state: dict
    warnings: tuple[str, ...] = ()


def resume_point(run_dir: Path) -> ResumePoint:
    """The newest whole checkpoint that the record covers.

    Whole: every file matches its SHA-256 in the checkpoint's SHA256SUMS (rlmm/runtime/checksums.py) and its state.json
    reads; a damaged one is named and passed over for the one before it. Covered: the record (steps.jsonl) holds
    every step up to it, whole and once, since the rows after it are dropped and redone and the rows before it
    are kept; so a damaged row (rlmm/run/records.py::read_record: torn, repeated, out of place) is redone from the
    newest checkpoint before it, and named. Where no checkpoint is both, the resume is refused (ResumeRefused),
    before anything is touched. No checkpoint at all: from step 0."""
    rows, damage = read_record(run_dir)
    covered = rows[-1]["step"] if rows else -1  # the record holds every step up to this one
    chain, gone = checkpoint_chain(run_dir), latest_gone(run_dir)
    steps = run_dir / "steps.jsonl"
    damaged = damage.of(steps) if damage else ""
    broken, past = [], []  # "<checkpoint> is damaged (<what>)"; checkpoints past the record; newest first
    for path in chain:
        if checkpoint_step(path) > covered:
            past.append(path)
            continue
        state, what = read_checkpoint_state(path)
        if what:
            broken.append(f"{path} is damaged ({what})")
            continue
        warnings = [f"checkpoint {'; '.join(broken)}: resuming from the one before it, {path}"] if broken else []
        if gone:
            warnings.insert(0, f"{latest_marker(run_dir)} names {gone}, which is not there: resuming from the newest "
                               f"checkpoint there, {path}")
        if damage:
            warnings.append(f"{damaged}: resuming from {path}, which redoes the steps after it")
        elif past:  # rows lost from its end (a finished run's last row deleted, a record restored from a copy)
            warnings.append(f"{steps} ends at step {covered}, before checkpoint {past[-1]}: resuming from {path}, "
                            f"which redoes the steps after it")
        return ResumePoint(path, state, tuple(warnings))
    checkpoints = run_dir / "checkpoints"
    if not chain and gone:
        raise ResumeRefused(f"train.resume: {latest_marker(run_dir)} names {gone}, which is not there, and no other "
                            f"checkpoint is: restore it, or remove {checkpoints} to redo the run from step 0, or give "
                            f"this run another hydra.run.dir")
    if not chain:
        return ResumePoint(None, {"step": 0}, (f"{damaged}: no checkpoint, the run is redone from step 0",)
                           if damage else ())
    if broken:
        raise ResumeRefused(f"train.resume: no whole checkpoint in {checkpoints}: {'; '.join(broken)}: restore them, "
                            f"or remove {checkpoints} to redo the run from step 0, or give this run another "
                            f"hydra.run.dir")
    if damage:
        raise ResumeRefused(f"train.resume: {damaged}, and every checkpoint is past it (the oldest: {chain[-1].name}): "
                            f"restore the line, or remove {checkpoints} to redo the run from step 0, or give this run "
                            f"another hydra.run.dir")
    held = f"ends at step {covered}" if rows else "holds no step"
    raise ResumeRefused(f"train.resume: {steps} {held}, before every checkpoint (the oldest: {chain[-1].name}): "
                        f"restore its rows, or remove {checkpoints} to redo the run from step 0, or give this run "
                        f"another hydra.run.dir")


def read_checkpoint_state(path: Path) -> tuple[dict, str]:
    """A checkpoint's state.json, and what is damaged in it ("" when it is whole: rlmm/runtime/checksums.py)."""
    what = checksums.damage(path)
    if what:
        return {}, what
    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}, "state.json is not readable JSON"
    if not isinstance(state, dict) or not {"step", "world_size"} <= state.keys():
        return {}, "state.json lacks its step or world_size"
    return state, ""


def check_train_dir(run_dir: Path, config: dict, world: int, resume: bool) -> None:
    """Raise ResumeRefused or AlreadyFinished per the module docstring; return when the run may start (fresh, or
    resuming). `config`: the run's record config ({"choices": ..., **the config}, redacted, as RunRecord writes
    it); `world`: this run's number of ranks."""
    if (run_dir / "probe.json").exists():
        raise ResumeRefused(f"hydra.run.dir: {run_dir} holds a probe's record (probe.json): give the training run "
                            f"another hydra.run.dir")
    if not training_record(run_dir):
        return
    if not resume:
        raise ResumeRefused(f"train.resume=false: {run_dir} holds a run's record (steps.jsonl): give this run another "
                            f"hydra.run.dir, or resume it (train.resume=true)")
    saved_config = run_dir / "config.yaml"
    if not saved_config.exists():
        raise ResumeRefused(f"train.resume: {run_dir} holds a run's record but no config.yaml, so whether this is that "
                            f"run cannot be told: give this run another hydra.run.dir")
    try:
        saved = yaml.safe_load(saved_config.read_text(encoding="utf-8")) or {}
        why = "not a mapping"
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        saved, why = None, str(err).splitlines()[0]
    if not isinstance(saved, dict):
        raise ResumeRefused(f"train.resume: {saved_config} is not readable YAML ({why}), so whether this is that run "
                            f"cannot be told: restore it, or give this run another hydra.run.dir")
    changed = differences(objective_as_a_node(saved), config)
    if changed:
        raise ResumeRefused(f"train.resume: {run_dir} holds a run with other settings ({listed(changed)}): resume it "
                            f"with its own settings, or give this run another hydra.run.dir")
    if finished(run_dir):  # a torn summary.json is a run to resume (its summary written again)
        raise AlreadyFinished(f"rlmm: {run_dir} holds this run, finished (summary.json): nothing to do")
    point = resume_point(run_dir)
    if point.checkpoint is not None and point.state["world_size"] != world:
        raise ResumeRefused(f"train.resume: checkpoint {point.checkpoint} was written by {point.state['world_size']} "
                            f"ranks, this run has {world} (resume with the same number of ranks, or give this run "
                            f"another hydra.run.dir)")


def check_probe_dir(run_dir: Path, config: dict) -> None:
    """Raise ResumeRefused per the module docstring; return when the probe may run (and write probe.json)."""
    if training_record(run_dir):
        raise ResumeRefused(f"hydra.run.dir: {run_dir} holds a training run's record (steps.jsonl): give the probe "
                            f"another hydra.run.dir")
    record = run_dir / "probe.json"
    if not record.exists():
        return
    try:
        saved = json.loads(record.read_text())
    except json.JSONDecodeError:
        raise ResumeRefused(f"hydra.run.dir: {record} is not readable JSON: give the probe another hydra.run.dir, or "
                            f"remove it") from None
    changed = differences({"choices": saved.get("choices", {}), **saved.get("config", {})}, config, app="probe")
    if changed:
        raise ResumeRefused(f"hydra.run.dir: {run_dir} holds a probe with other settings ({listed(changed)}): give "
                            f"this probe "
                            f"another hydra.run.dir")
