"""`hydra/sweeper=rlmm`, every app's sweeper (conf/hydra/default.yaml): Hydra's basic sweeper, which also says how
many jobs of the sweep had finished already.

A sweep is launched again into its sweep directory after a job of it failed or was killed: the jobs whose run
directory holds that very run, finished, do nothing (rlmm/run/resume.py, `AlreadyFinished`: the job returns
`FINISHED_JOB`) and the others run or resume. Those jobs may run in other processes (`hydra/launcher=process`,
`local`, `slurm`), where what they print goes to their own logs; their results come back to the sweeper, so it is
here that they are counted, whatever the launcher:

    rlmm: 1 of 2 jobs of this sweep had finished already and did nothing (#0); 1 ran

Nothing is printed when every job ran. The sweeping itself (the grid, `hydra.sweeper.params`, batches, the first
failed job raised once every job of its batch has run) is the basic sweeper's, unchanged.

(No `from __future__ import annotations` here: Hydra imports plugin modules outside sys.modules, where a
dataclass with string annotations cannot be built.)
"""
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus


@dataclass
class RlmmSweeperConf:
    _target_: str = "hydra_plugins.rlmm_launcher.sweeper.RlmmSweeper"
    max_batch_size: Optional[int] = None
    params: Optional[Dict[str, str]] = None


ConfigStore.instance().store(group="hydra/sweeper", name="rlmm", node=RlmmSweeperConf, provider="rlmm")


def finished_already(result: JobReturn) -> bool:
    """Whether the job found its run finished and did nothing (rlmm/launch/apps.py returns FINISHED_JOB then)."""
    from rlmm.run.resume import FINISHED_JOB

    return result.status == JobStatus.COMPLETED and result.return_value == FINISHED_JOB


def job_number(result: JobReturn) -> str:
    num = result.hydra_cfg.hydra.job.get("num") if result.hydra_cfg is not None else None
    return f"#{num}" if num is not None else "?"


def skipped_line(results: Sequence[JobReturn]) -> Optional[str]:
    """The line that says how many of the sweep's jobs had finished already, or None when none had."""
    skipped = [result for result in results if finished_already(result)]
    if not skipped:
        return None
    return (f"rlmm: {len(skipped)} of {len(results)} jobs of this sweep had finished already and did nothing "
            f"({', '.join(map(job_number, skipped))}); {len(results) - len(skipped)} ran")


class CountedLaunches:
    """The sweep's launcher, keeping every result it returns."""

    def __init__(self, launcher) -> None:
        self.launcher = launcher
        self.results: List[JobReturn] = []

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        results = self.launcher.launch(job_overrides, initial_job_idx=initial_job_idx)
        self.results.extend(results)
        return results


class RlmmSweeper(BasicSweeper):
    def setup(self, *, hydra_context, task_function, config) -> None:
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        self.launcher = CountedLaunches(self.launcher)

    def sweep(self, arguments: List[str]) -> Any:
        try:
            return super().sweep(arguments)
        finally:  # also when a job failed (the basic sweeper raises its error once its batch has run)
            line = skipped_line(self.launcher.results)
            if line:
                print(line, flush=True)
