"""`rlmm` with a fault injected at one point of a run: `python tests/fault_at.py ACTION POINT N [rlmm args...]`.

At the N-th time (1-based) the run reaches POINT, ACTION happens:
    kill  SIGKILL this process (no handler runs: the machine lost power, the OOM killer came)
    fill  fill the file system of $RLMM_FAULT_FILLER (a file outside the run directory) to the last byte,
          then go on: the run's next write meets a full disk
    remove_run_dir  remove the run directory (hydra.run.dir) and all in it, then go on (a user's rm -r, a cleanup)
    sigint  send this process SIGINT (Ctrl-C in its terminal), then go on

POINT (the function whose N-th call it is):
    sampling        entering rlmm.run.step.sample_groups (the sampler generating a step's rollouts) or, with
                    `train.partial_rollouts`, PartialBatch.start or PartialBatch.advance (one batch's first chunk,
                    or its next chunk or its rest: each batch in flight is one call, so several a step)
    update          entering rlmm.run.step.OldPolicy.score (the update, between the scoring forward and the optimizer)
    weight_sync     entering rlmm.run.step.send_weights (the trainer has stepped, the sampler has the old weights)
    record          RunRecord.log (a kill writes half of the row first: a torn last line)
    record_written  after RunRecord.log returned (the row on disk)
    checkpoint      inside checkpoint.save, after rank 0 wrote model.safetensors, before the ranks' states
    checkpointed    after checkpoint.save returned (`latest` moved)
    summary         after RunRecord.summary returned (only the plot is left)
    sampler_process SamplerProcess.request_batch (`train.overlap`): a kill is of the sampler process, not this one

Under torchrun, $RLMM_FAULT_RANK names the one rank that meets the fault (unset: every rank).
"""
import errno
import os
import signal
import sys
from pathlib import Path

calls = {"n": 0}


def fill_disk() -> None:
    filler = Path(os.environ["RLMM_FAULT_FILLER"])
    descriptor = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for size in (1 << 20, 1 << 12, 1):  # down to the last byte
            block = b"\0" * size
            while True:
                try:
                    os.write(descriptor, block)
                except OSError as err:
                    if err.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(descriptor)


def fault(*_, **__) -> None:
    if ACTION == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif ACTION == "fill":
        fill_disk()
    elif ACTION == "sigint":
        os.kill(os.getpid(), signal.SIGINT)
    elif ACTION == "remove_run_dir":
        import shutil

        run_dir = [arg.split("=", 1)[1] for arg in sys.argv if arg.startswith("hydra.run.dir=")][-1]
        shutil.rmtree(run_dir)
    else:
        raise SystemExit(f"fault_at: unknown action {ACTION!r} (kill, fill, remove_run_dir, sigint)")


def reached() -> bool:
    calls["n"] += 1
    return calls["n"] == NTH


def before(owner, name: str, act=fault) -> None:
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        if reached():
            act(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(owner, name, wrapped)


def after(owner, name: str) -> None:
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        result = original(*args, **kwargs)
        if reached():
            fault()
        return result

    setattr(owner, name, wrapped)


def torn_row(record, metrics, step=None) -> None:
    """Half of the row, on disk, then the fault."""
    import json

    line = json.dumps({"step": step, **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}})
    record._steps.write(line[: len(line) // 2])
    record._steps.flush()
    os.fsync(record._steps.fileno())
    fault()


def kill_the_sampler_process(process, index, **_) -> None:
    process.process.kill()
    process.process.join(timeout=30)


def main() -> None:
    """Install the fault at its point, then run `rlmm` (only in the main process: a spawned sampler process
    imports this file as its main module and must not)."""
    import rlmm.run.checkpoint
    import rlmm.run.step
    from rlmm.run.records import RunRecord
    from rlmm.run.sampler_process import SamplerProcess

    if POINT == "sampling":
        from rlmm.run.partial_rollouts import PartialBatch

        before(rlmm.run.step, "sample_groups")
        before(PartialBatch, "start")  # a classmethod: looked up on the class, the wrapper gets (c, ...)
        before(PartialBatch, "advance")
    elif POINT == "update":
        before(rlmm.run.step.OldPolicy, "score")
    elif POINT == "weight_sync":
        before(rlmm.run.step, "send_weights")
    elif POINT == "record":
        before(RunRecord, "log", act=torn_row if ACTION == "kill" else fault)
    elif POINT == "record_written":
        after(RunRecord, "log")
    elif POINT == "checkpoint":
        before(rlmm.run.checkpoint, "critic_entry")  # once a save (split_sharded recurses)
    elif POINT == "checkpointed":
        after(rlmm.run.checkpoint, "save")
    elif POINT == "summary":
        after(RunRecord, "summary")
    elif POINT == "sampler_process":
        before(SamplerProcess, "request_batch", act=kill_the_sampler_process)
    elif POINT != "nowhere":
        raise SystemExit(f"fault_at: unknown point {POINT!r}")

    from rlmm.cli import main as rlmm_main

    rlmm_main(sys.argv[4:])


if __name__ == "__main__":
    ACTION, POINT, NTH = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if os.environ.get("RLMM_FAULT_RANK", os.environ.get("RANK", "0")) != os.environ.get("RANK", "0"):
        POINT = "nowhere"  # under torchrun, only rank $RLMM_FAULT_RANK meets the fault
    main()
