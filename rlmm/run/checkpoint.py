"""Checkpoints of a training run, and resuming from the newest one.

    <run dir>/checkpoints/step-000040/model.safetensors  full weights (Hugging Face names), from rank 0
    <run dir>/checkpoints/step-000040/rank0.pt, rank1.pt  per rank: trainer state (optimizer, ZeRO partition,
                                                          LR schedule, step counters), torch's RNG state and,
                                                          with train.staleness, the rank's rollouts in flight,
                                                          and a correction's state where it carries one (a
                                                          learning-rate decay: `Correction.state_dict`)
    <run dir>/checkpoints/step-000040/shards/            the states' sharded tensors (DTensors: FSDP's optimizer
                                                          moments), written by `torch.distributed.checkpoint`,
                                                          each rank its own shard
    <run dir>/checkpoints/step-000040/critic.safetensors  the critic's weights, when the algorithm has one (PPO; its
                                                          optimizer and warm-up count are in rankN.pt's "critic")
    <run dir>/checkpoints/step-000040/state.json         step, the sampler's request counter
    <run dir>/checkpoints/step-000040/SHA256SUMS         the SHA-256 of every file above (rlmm/runtime/checksums.py),
                                                          checked before a resume: a damaged checkpoint is named
                                                          and the one before it resumed (rlmm/run/resume.py)
    <run dir>/checkpoints/latest                         name of the newest *complete* checkpoint

Every rank writes into `checkpoints/.partial-step-000040`; once all have, rank 0 writes state.json there, renames
the directory to `step-000040`, then replaces `latest` atomically: a job killed while checkpointing resumes from
the previous complete one, and the half-written directory is removed at the next start (`remove_partial`, from
rlmm/run/train.py). Files are read back with safetensors and `torch.load(weights_only=True)` (only tensors, plain
containers and the trainer's own allow-listed bookkeeping types are rebuilt; no pickled code runs).

What makes a resumed run repeat the uninterrupted one: the prompts of step t are a pure function of
(seed, t) (the task's example list), the sampler seeds request k of the run with (seed, k), the
trainer's optimizer and schedule are restored, and torch's global RNG (minibatch shuffles) is restored;
with `train.staleness` k the batches sampled for the next k updates come back too (rlmm/run/rollout_source.py).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch

from rlmm.corrections.base import Correction
from rlmm.run.critic import NoCritic
from rlmm.run.interfaces import Critic
from rlmm.run.resume import ResumeRefused, checkpoint_chain, checkpoint_step, newest_checkpoint, resume_point
from rlmm.runtime.checksums import write_sums
from rlmm.runtime.disk import writing

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
CRITIC_WEIGHTS = "critic.safetensors"
SHARDS = "shards"
PARTIAL = ".partial-"  # a checkpoint being written: checkpoints/.partial-step-000040, renamed once complete
# Where a sharded tensor stood in a rank's state (rankN.pt); its data is in shards/ under its path.
IN_SHARDS = "<in shards/>"


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def latest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of the run, or None."""
    newest = newest_checkpoint(Path(run_dir))
    return newest[0] if newest else None


def to_resume(run_dir: str | Path) -> Path | None:
    """The checkpoint a run in `run_dir` resumes from (None: from step 0): the newest one its record covers
    (rlmm/run/resume.py::resume_point, which rlmm/launch/apps.py ran before anything started, refusing what it cannot
    resume); what the choice passed over, each a warning in the log."""
    point = resume_point(Path(run_dir))
    for warning in point.warnings:
        log.warning(warning)
    return point.checkpoint


def save(run_dir: str | Path, step: int, trainer, sampler, critic: Critic = NoCritic(), keep: int = 2,
         loop: dict | None = None, rollouts: dict | None = None, correction: Correction = Correction()) -> Path:
    """Write a checkpoint of step `step` (every rank calls this together); keep the newest `keep`. `loop`: the
    training loop's own state (JSON: bad-step counts, the monitor's detectors), back as state.json's "loop".
    `rollouts`: this rank's rollouts in flight (`RolloutSource.state_dict()`: tensors and plain values, in its
    rankN.pt; {} or None writes nothing), back as `load`'s "rollouts". A critic with no weights and no state
    (`NoCritic`) writes nothing, nor does a correction with no state (`state_dict()` {}: all but a decay's)."""
    from safetensors.torch import save_file

    rank, world = _rank_and_world()
    root = Path(run_dir) / CHECKPOINTS
    path = root / f"step-{step:06d}"
    partial = root / f"{PARTIAL}{path.name}"  # every file is written here, then the directory renamed to `path`
    # Read on every rank: a collective under ZeRO-3 and FSDP (whose weights are gathered as they are read).
    weights = dict(trainer.state_dict().items())
    critic_weights = dict(critic.state_dict().items())
    if rank == 0:
        with writing(partial):
            partial.mkdir(parents=True)
            # clone: tied weights share storage, which safetensors refuses to write twice
            save_file({k: v.detach().cpu().clone().contiguous() for k, v in weights.items()},
                      partial / "model.safetensors")
            if critic_weights:
                save_file({k: v.detach().cpu().clone().contiguous() for k, v in critic_weights.items()},
                          partial / CRITIC_WEIGHTS)
    _barrier()
    rank_state, shards = split_sharded({"trainer": trainer.checkpoint_state(), "torch_rng": torch.get_rng_state(),
                                        **critic_entry(critic), **({"rollouts": rollouts} if rollouts else {}),
                                        **({"correction": state} if (state := correction.state_dict()) else {})})
    with writing(partial):
        if shards:  # a collective: every rank of a sharded trainer has them (its metadata names files relative to it)
            import torch.distributed.checkpoint as dcp

            dcp.save(shards, checkpoint_id=partial / SHARDS)
        torch.save(rank_state, partial / f"rank{rank}.pt")
    _barrier()
    if rank == 0:
        state = {"step": step, "world_size": world, "sampler_calls": sampler.calls, "loop": loop or {}}
        with writing(partial):
            (partial / "state.json").write_text(json.dumps(state, indent=2))
            write_sums(partial)  # last: every rank's files are in (rlmm/run/resume.py checks them before a resume)
        if path.exists():  # written before by a run killed before it moved `latest` (which names an older one)
            shutil.rmtree(path)
        os.replace(partial, path)
        tmp = root / "latest.tmp"
        tmp.write_text(path.name)
        os.replace(tmp, root / "latest")
        prune(root, step, keep)
    _barrier()
    return path


def prune(root: Path, step: int, keep: int) -> None:
    """Remove the checkpoints in `root` but the newest `keep` up to `step` (the one just written): the older ones, and
    any past it, left from before a resume went back to an older checkpoint (rlmm/run/resume.py) and now redone."""
    mine = sorted((p for p in checkpoint_chain(root.parent) if checkpoint_step(p) <= step), key=checkpoint_step)
    past = [p for p in checkpoint_chain(root.parent) if checkpoint_step(p) > step]
    for old in mine[:-keep or None] + past:
        shutil.rmtree(old, ignore_errors=True)


def remove_partial(run_dir: str | Path) -> None:
    """Remove the checkpoints a killed run left half-written (never loaded: `latest` names complete ones only)."""
    for partial in (Path(run_dir) / CHECKPOINTS).glob(f"{PARTIAL}*"):
        shutil.rmtree(partial, ignore_errors=True)


def load(path: Path, trainer, sampler, critic: Critic = NoCritic(), correction: Correction = Correction()) -> dict:
    """Restore trainer, sampler, critic, the correction's state (where the checkpoint holds one) and RNG from
    checkpoint `path`; returns its state.json, with this rank's rollouts in flight under "rollouts" (None when it
    holds none)."""
    from safetensors.torch import load_file

    rank, world = _rank_and_world()
    state = read(path / "state.json", lambda file: json.loads(file.read_text()))
    if state["world_size"] != world:
        raise ValueError(f"train.resume: checkpoint {path} was written by {state['world_size']} ranks, this run has "
                         f"{world} (resume with the same number of ranks, or another hydra.run.dir)")
    # Fresh states: the sharded tensors come back into them (laid out over this run's ranks as they were).
    fresh = {"trainer": trainer.checkpoint_state(), **critic_entry(critic)}
    if "critic" in fresh and not (path / CRITIC_WEIGHTS).exists():
        raise ValueError(f"train.resume: checkpoint {path} has no critic (written by another algorithm); resume "
                         f"with the run's own algo, or another hydra.run.dir")
    allowed = trainer.safe_checkpoint_types() + critic.safe_checkpoint_types()
    with torch.serialization.safe_globals(allowed):
        # map_location: a GPU run's states come back on the CPU (every rank reads every rank's file)
        rank_states = [read(path / f"rank{r}.pt", lambda file: torch.load(file, weights_only=True, map_location="cpu"))
                       for r in range(world)]
    _, shards = split_sharded(fresh)
    if shards:
        import torch.distributed.checkpoint as dcp

        read(path / SHARDS, lambda folder: dcp.load(shards, checkpoint_id=folder))
        rank_states[rank] = joined_sharded(rank_states[rank], shards)
    weights = read(path / "model.safetensors", load_file)
    trainer.load_checkpoint(weights, [s["trainer"] for s in rank_states])
    if "critic" in fresh:
        critic.load_checkpoint(read(path / CRITIC_WEIGHTS, load_file), [s["critic"] for s in rank_states])
    if "correction" in rank_states[rank]:
        correction.load_state_dict(rank_states[rank]["correction"])
    torch.set_rng_state(rank_states[rank]["torch_rng"])
    sampler.calls = state["sampler_calls"]
    sampler.load_weights(trainer.state_dict())
    state["rollouts"] = rank_states[rank].get("rollouts")
    return state


def read(path: Path, reader):
    """`reader(path)`; a file it cannot read is named in one line (ResumeRefused, its cause kept: a disk fault
    stays one, rlmm/launch/apps.py::machine_fault). SHA256SUMS catches a damaged file before this (rlmm/run/resume.py); this is
    for a checkpoint written without one, or a file damaged since."""
    try:
        return reader(path)
    except Exception as err:
        said = (str(err).strip().splitlines() or [""])[0][:200]
        raise ResumeRefused(f"train.resume: {path} cannot be read ({type(err).__name__}: {said}): remove its "
                            f"checkpoint {path.parent} to resume from the one before it, or give this run another "
                            f"hydra.run.dir") from err


def critic_entry(critic: Critic) -> dict:
    """The critic's part of a rank's state: {"critic": its state}, or nothing for a critic without one
    (`NoCritic`: then the checkpoint holds no critic at all, as before critics existed)."""
    state = critic.checkpoint_state()
    return {"critic": state} if state else {}


def split_sharded(state: dict, prefix: str = "") -> tuple[dict, dict[str, torch.Tensor]]:
    """`state` with every DTensor (a tensor sharded over the ranks) replaced by `IN_SHARDS`, and those
    DTensors by their path ("trainer/optimizer/state/<param>/exp_avg"), for `torch.distributed.checkpoint`:
    it writes each rank's shard of them once, where `torch.save` of a rank's state would write only that
    rank's local piece with no record of the layout."""
    from torch.distributed.tensor import DTensor

    kept, shards = {}, {}
    for key, value in state.items():
        path = f"{prefix}{key}"
        if isinstance(value, DTensor):
            kept[key], shards[path] = IN_SHARDS, value
        elif isinstance(value, dict):
            kept[key], inner = split_sharded(value, f"{path}/")
            shards.update(inner)
        else:
            kept[key] = value
    return kept, shards


def joined_sharded(state: dict, shards: dict[str, torch.Tensor], prefix: str = "") -> dict:
    """The inverse of `split_sharded`: each `IN_SHARDS` in `state` replaced by its tensor from `shards`."""
    joined = {}
    for key, value in state.items():
        path = f"{prefix}{key}"
        if isinstance(value, str) and value == IN_SHARDS:
            if path not in shards:
                raise ValueError(f"train.resume: the checkpoint's sharded tensor '{path}' has no counterpart in this "
                                 f"run's trainer (resume with the run's own trainer and algo, or another hydra.run.dir)")
            joined[key] = shards[path]
        elif isinstance(value, dict):
            joined[key] = joined_sharded(value, shards, f"{path}/")
        else:
            joined[key] = value
    return joined
