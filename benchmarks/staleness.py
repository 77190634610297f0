"""RL step time at `train.staleness=0` and `train.staleness=1` (and `train.overlap=true` where the config has it),
in one process, on the built-in default.

    .venv/bin/python -m benchmarks.staleness [--steps 8] [--repeats 2] [--override KEY=VALUE ...] [--device cuda]
        [--out FILE.json]

Each arm is a real `rlmm train` run (`rlmm.run.train.run_train` on conf/train.yaml as `rlmm train` composes it, the
arm's key set, `logger=none`, `train.eval_every=0`, `train.eval_prompts=16`), one after another in this process
(each builds and closes its own engines), in ABBA order over the repeats (0, 1, 1, 0, ...) so that a drift of
the machine's load falls on both arms alike (its figures moved 4x with the load on a shared machine: read the
ratio of arms run close together, and the CPU time beside the wall time). What is timed: the wall time between the run's consecutive logged
steps (a logger that notes when each step's metrics arrive), which is what a step costs however the loop is
arranged (the delay line samples ahead, an overlapped sampler would hide generation behind the update). Step 1
is left out (it follows step 0's evaluation; at staleness 1 it samples two batches) and the last step too (it
runs the final evaluation): the median over steps 2 .. steps-1 of every run of an arm.

`train.overlap` is being built elsewhere: when conf/train.yaml has no such key, its row says so and is skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT, machine_info, set_runtime_env, write_record

ARMS = {"staleness=0": ["train.staleness=0"], "staleness=1": ["train.staleness=1"],
        "overlap": ["train.staleness=1", "train.overlap=true"]}


class StepClock:
    """A logger (rlmm.run.logging's interface) that notes when each step's metrics arrive."""

    def __init__(self):
        self.arrivals: dict[int, float] = {}
        self.cpu: dict[int, float] = {}  # this process's CPU time (all threads) at each arrival
        self.metrics: dict[int, dict] = {}

    def log(self, metrics: dict, step: int | None = None) -> None:
        self.arrivals[step], self.cpu[step] = time.perf_counter(), time.process_time()
        self.metrics[step] = {k: v for k, v in metrics.items() if k.startswith(("perf/", "rollout/staleness"))}

    def summary(self, metrics: dict) -> None:
        pass

    def finish(self) -> None:
        pass

    def step_seconds(self, clock: str = "arrivals") -> dict[int, float]:
        times = getattr(self, clock)
        return {s: times[s] - times[s - 1] for s in sorted(times) if s - 1 in times}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.staleness", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="train.steps of each run (>= 4: steps 2 .. steps-1 timed)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each arm, in ABBA order")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a Hydra override for every arm (e.g. sampler=hf)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: the engines on GPUs (the overlap arm needs 2 per trainer rank: its sampler's own)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.steps < 4:
        parser.error("--steps: at least 4 (step 1 and the last step are not timed)")
    set_runtime_env(args.device)
    from omegaconf import OmegaConf

    from benchmarks.rlmm_step import compose_train_config
    from rlmm.run.train import run_train
    from rlmm.runtime.devices import init_process_group

    init_process_group()
    common = ["logger=none", f"train.steps={args.steps}", "train.eval_every=0", "train.eval_prompts=16",
              *args.override]
    arms, skipped = [], {}
    for arm in args.arms.split(","):
        if arm not in ARMS:
            parser.error(f"--arms: unknown arm {arm!r} (known: {', '.join(ARMS)})")
        if arm == "overlap" and "overlap" not in OmegaConf.load(ROOT / "conf" / "train.yaml").train:
            skipped[arm] = "train.overlap is not in this tree's conf/train.yaml yet: row skipped"
            print(f"{arm}: {skipped[arm]}", flush=True)
            continue
        if arm == "overlap" and args.device == "cuda" and gpu_count() < 2:
            skipped[arm] = f"the overlapped sampler needs a GPU of its own: {gpu_count()} visible, 2 needed"
            print(f"{arm}: {skipped[arm]}", flush=True)
            continue
        arms.append(arm)
    order = []
    for repeat in range(args.repeats):
        order += arms if repeat % 2 == 0 else arms[::-1]
    runs = []
    for index, arm in enumerate(order):
        cfg, choices = compose_train_config(common + ARMS[arm])
        clock = StepClock()
        load_before = os.getloadavg()[0]
        with tempfile.TemporaryDirectory(prefix=f"rlmm-staleness-{index}-") as run_dir:
            started = time.perf_counter()
            run_train(cfg, Path(run_dir), choices, clock)
            wall = time.perf_counter() - started
        seconds = clock.step_seconds()
        timed = {s: t for s, t in seconds.items() if 2 <= s <= args.steps - 1}
        runs.append({"arm": arm, "run": index, "overrides": common + ARMS[arm], "wall": wall,
                     "step_seconds": seconds, "timed_median": statistics.median(timed.values()),
                     "step_cpu_seconds": clock.step_seconds("cpu"),
                     "staleness_logged": [clock.metrics[s].get("rollout/staleness") for s in sorted(timed)],
                     "generate_seconds": [clock.metrics[s].get("perf/generate_seconds") for s in sorted(timed)],
                     "perf": {s: clock.metrics[s] for s in sorted(timed)},  # the step's own stage timers
                     "load_before": load_before, "load_after": os.getloadavg()[0]})
        print(f"{arm} (run {index + 1}/{len(order)}): median step {runs[-1]['timed_median']:.3f} s over steps "
              f"2..{args.steps - 1}, load {load_before:.1f} -> {runs[-1]['load_after']:.1f}", flush=True)
    summary = {}
    for arm in arms:
        timed = [t for r in runs if r["arm"] == arm for s, t in r["step_seconds"].items() if 2 <= s <= args.steps - 1]
        generate = [g for r in runs if r["arm"] == arm for g in r["generate_seconds"] if g is not None]
        cpu = [t for r in runs if r["arm"] == arm for s, t in r["step_cpu_seconds"].items() if 2 <= s <= args.steps - 1]
        summary[arm] = {"step_median": statistics.median(timed), "step_min": min(timed), "step_max": max(timed),
                        "step_cpu_median": statistics.median(cpu),
                        "steps_timed": len(timed), "generate_median": statistics.median(generate) if generate else None}
    for arm in arms:
        summary[arm]["vs_staleness_0"] = (summary[arm]["step_median"] / summary["staleness=0"]["step_median"]
                                          if "staleness=0" in summary else None)
    print(f"\n{'arm':<14}{'step median s':>15}{'min':>8}{'max':>8}{'CPU s':>8}{'generate s':>12}{'vs staleness=0':>16}")
    for arm in arms:
        s = summary[arm]
        gen = f"{s['generate_median']:.3f}" if s["generate_median"] is not None else "-"
        ratio = f"{s['vs_staleness_0']:.3f}" if s["vs_staleness_0"] is not None else "-"
        print(f"{arm:<14}{s['step_median']:>15.3f}{s['step_min']:>8.3f}{s['step_max']:>8.3f}{s['step_cpu_median']:>8.3f}"
              f"{gen:>12}{ratio:>16}")
    for arm, why in skipped.items():
        print(f"{arm:<14}{why}")
    record = {"machine": machine_info(), "summary": summary, "skipped": skipped, "runs": runs, "order": order,
              "command": "python -m benchmarks.staleness " + " ".join(sys.argv[1:] if argv is None else argv)}
    write_record("staleness", record, args.out)


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


if __name__ == "__main__":
    main()
