"""`hydra/launcher=slurm`: the submitit plugin's SLURM launcher, but a job that ends without a result is one failed
job of the sweep, not the end of the sweep command.

The plugin submits the sweep as one job array and then reads each job's results in job order; a job with no
result file (killed by `scancel`, a time limit, the OOM killer, a lost node; or one task of a multi-task job
killed) raises submitit's `UncompletedJobError` there, 40 lines, and the command stops before it has read the
jobs after it. Here each job's result is read on its own: rank 0's `JobReturn` (rank 0 writes the record, and a
rank that died is named in its line: rlmm/launch/apps.py::machine_fault), or, when rank 0 left none, a failed one
that says in one line what SLURM says of the job (its state, through `sacct`: slurm/bin/sacct on the local
clusters) and where its output is. Every job is waited for; each failed one is logged as it is found, and Hydra's
basic sweeper then raises the first failed job's error and the command exits 1 (docs/sweeps.md).

Submission is the plugin's, unchanged: the same executor, parameters and job array (`BaseSubmititLauncher`).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as PluginSlurmLauncher
from hydra_plugins.rlmm_launcher.process_launcher import JobEndedWithoutResult, log_failed
from omegaconf import OmegaConf

log = logging.getLogger(__name__)


def rank0_result(job, num: int, overrides: Sequence[str]) -> JobReturn:
    """Rank 0's JobReturn once the job has ended (a failed run's error is inside it), or a failed one that says
    why there is none."""
    from submitit.core.utils import UncompletedJobError

    try:
        return job.task(0).result()
    except Exception as err:  # UncompletedJobError: no result file; FailedJobError: it died before Hydra ran the job
        state = job.state
        said = "" if isinstance(err, UncompletedJobError) else f" ({(str(err).strip().splitlines() or [''])[0]})"
        error = JobEndedWithoutResult(f"job {num} (SLURM {job.job_id}) ended {state} without a result{said}: its "
                                      f"output is in {job.paths.folder}")
    failed = JobReturn(overrides=list(overrides), status=JobStatus.FAILED)
    failed.return_value = error
    return failed


class SlurmLauncher(PluginSlurmLauncher):
    """The plugin's SLURM launcher, reading each job's result on its own (module docstring)."""

    def executor(self):
        """The plugin's executor for this sweep: `submitit_folder` and `max_num_timeout` to its constructor, the
        plugin's common queue keys as they are, every other key with the `slurm_` prefix submitit expects."""
        import submitit  # imported here, as in the plugin: Hydra imports this module at every start

        at_start = {"submitit_folder", "max_num_timeout"}
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, folder=self.params["submitit_folder"],
                                         slurm_max_num_timeout=self.params["max_num_timeout"])
        common = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{key if key in common else f"slurm_{key}": value
                                      for key, value in self.params.items() if key not in at_start})
        return executor

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and len(job_overrides) > 0
        executor = self.executor()
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {sweep_dir}")
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
        arguments: list[tuple[Any, ...]] = []
        for num, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{num} : {' '.join(filter_overrides(overrides))}")
            arguments.append((list(overrides), "hydra.sweep.dir", num, f"job_id_for_{num}", Singleton.get_state()))
        jobs = executor.map_array(self, *zip(*arguments))
        results = []
        for num, job, overrides in zip(range(initial_job_idx, initial_job_idx + len(jobs)), jobs, job_overrides):
            result = rank0_result(job, num, overrides)
            if result.status == JobStatus.FAILED:
                log_failed(num, result)
            results.append(result)
        return results
