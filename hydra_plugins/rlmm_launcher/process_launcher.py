"""`hydra/launcher=process`: the jobs of a `-m` sweep one after another, each in a fresh process.

Hydra's basic launcher runs every job in the `rlmm` process itself, and on a GPU node what one job
leaves behind reaches the next: vLLM does not give back the GPU memory of an in-process engine that is
deleted (vllm-project/vllm#21073), so the next job's engine starts beside the last one's weights and KV
cache; and vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT) swaps aten kernels for the whole process,
so every job after one that turned it on runs with it. A fresh process per job starts each from nothing.
One at a time, because one GPU node holds one job's engines (`hydra/launcher=local` starts every job
at once).

The job side is the hydra-submitit-launcher plugin's, unchanged (`BaseSubmititLauncher.__call__`: load
the job's config, run it with Hydra's `run_job`, which keeps a failed job's exception in its result),
and so is the process: submitit's `LocalExecutor` pickles this launcher with the job's arguments, runs
it in a new Python and reads its `JobReturn` back. Only `launch` differs: it submits one job, waits for
it and keeps its result before it submits the next. A job whose process ended without a result (killed,
out of memory, a crash inside a CUDA kernel) becomes a failed `JobReturn` that says so, so the jobs
after it still run; once `launch` returns, Hydra's basic sweeper reports the first failed job and the
command exits 1 (docs/sweeps.md).
"""
from __future__ import annotations

import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher

log = logging.getLogger(__name__)


class JobEndedWithoutResult(RuntimeError):
    """A job's process ended without writing its result: something outside the job stopped it."""


def log_failed(num: int, result: JobReturn) -> None:
    """One line for a failed job as soon as it is known (Hydra names only the first failed job, and only at the end)."""
    err = result._return_value
    log.error(f"\t#{num} failed: {(str(err).strip().splitlines() or [type(err).__name__])[0]}")


class ProcessLauncher(BaseSubmititLauncher):
    """Run each job in its own process on this machine, the next one when the last has ended.

    submitit_folder: each job's logs, pickled task and result (`%j`: the job's id).
    timeout_min: a job still running after this many minutes is stopped and counts as failed (SIGUSR2
        30 s before: rlmm checkpoints at the end of its step, so the run resumes when run again into
        its run directory). No requeue: locally it would only restart the job into the same limit.
    gpus_per_node: the GPUs a job sees: null, every GPU the sweep command sees (its CUDA_VISIBLE_DEVICES,
        or all); N, the first N of them; 0, none.
    """

    def __init__(self, submitit_folder: str, timeout_min: float, gpus_per_node: int | None) -> None:
        if not timeout_min > 0:
            raise ValueError(f"hydra.launcher.timeout_min: must be > 0, got {timeout_min}")
        if gpus_per_node is not None and gpus_per_node < 0:
            raise ValueError(f"hydra.launcher.gpus_per_node: must be null or >= 0, got {gpus_per_node}")
        super().__init__()
        self.submitit_folder = submitit_folder
        self.timeout_min = timeout_min
        self.gpus_per_node = gpus_per_node

    def job_python(self) -> str:
        """The command the job's Python runs as: `env` first, setting the job's CUDA_VISIBLE_DEVICES.

        submitit's local controller sets CUDA_VISIBLE_DEVICES to the first `gpus_per_node` GPU
        numbers, none when that is unset, whatever the shell had chosen. A job that runs alone may have
        every GPU the shell sees, and a number counts from the shell's own list (CUDA_VISIBLE_DEVICES=2,3
        with gpus_per_node=1 means GPU 2), so the job's Python is started through `env` with that list,
        before CUDA can read it.
        """
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if self.gpus_per_node is None:
            assign = ["-u", "CUDA_VISIBLE_DEVICES"] if visible is None else [f"CUDA_VISIBLE_DEVICES={visible}"]
        else:
            devices = visible.split(",") if visible is not None else [str(i) for i in range(self.gpus_per_node)]
            assign = [f"CUDA_VISIBLE_DEVICES={','.join(devices[:self.gpus_per_node])}"]
        return shlex.join(["env", *assign, sys.executable])

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import submitit  # imported here, as in the plugin: Hydra imports this module at every start

        assert self.config is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        executor = submitit.LocalExecutor(folder=self.submitit_folder, max_num_timeout=0, python=self.job_python())
        executor.update_parameters(timeout_min=self.timeout_min)
        log.info(f"{len(job_overrides)} jobs, one process each, one after another; sweep output dir: {sweep_dir}")
        results = []
        for num, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{num} : {' '.join(filter_overrides(overrides))}")
            job = executor.submit(self, list(overrides), "hydra.sweep.dir", num, f"job_id_for_{num}",
                                  Singleton.get_state())
            result = self.job_result(job, num, overrides)
            if result.status == JobStatus.FAILED:
                log_failed(num, result)
            results.append(result)
        return results

    @staticmethod
    def job_result(job, num: int, overrides: Sequence[str]) -> JobReturn:
        """The job's own JobReturn once its process has ended (a failed job's error is inside it), or a
        failed one that says why there is none."""
        job.wait()
        if job.paths.result_pickle.exists():  # the job writes it before its process exits
            try:
                return job.result()
            except Exception as err:  # it failed before Hydra ran it: submitit's FailedJobError, with its trace
                error = err
        else:
            error = JobEndedWithoutResult(f"job {num} ended without a result (killed, out of memory, a crash, or "
                                          f"past timeout_min): its output is in {job.paths.folder}")
        failed = JobReturn(overrides=list(overrides), status=JobStatus.FAILED)
        failed.return_value = error
        return failed
