"""RL step time at `train.staleness=0` and `train.staleness=1` (and `train.overlap=true` where the config has it),
with whole responses and with partial rollouts, in one process, on the built-in default or the `large` workload.

    .venv/bin/python -m benchmarks.staleness [--steps 8] [--repeats 2] [--workload default|large] [--chunk N]
        [--arms A,B,...] [--override KEY=VALUE ...] [--device cuda] [--out FILE.json]

Arms: `staleness=0`, `staleness=1` (the delay line), `overlap` (staleness 1, `train.overlap=true`), `partial`
(staleness 1, `train.partial_rollouts=true`, `train.rollout_chunk` = --chunk: batch u+1's first chunk is sampled at
step u under v_{u-1}, its rest at step u+1 under v_u, a continuation that prefills prompt + chunk again) and
`partial+overlap` (the same, overlapped). Workloads (benchmarks/common.py's WORKLOADS): `default` is
conf/train.yaml as it is (the built-in model, 16 prompts x 8 samples of 8 tokens); `large` its 25M-parameter random
model (built once under $RLMM_CACHE/benchmarks, unreachable eos: every response exactly 128 tokens) with 8 prompts x
8 samples and micro-batch 32. --chunk defaults to a quarter of the workload's new tokens (2 and 32).

Each arm is a real `rlmm train` run (`rlmm.run.train.run_train` on conf/train.yaml as `rlmm train` composes it, the
arm's key set, `logger=none`, `train.eval_every=0`, `train.eval_prompts=16`), one after another in this process
(each builds and closes its own engines), in ABBA order over the repeats (0, 1, 1, 0, ...) so that a drift of
the machine's load falls on both arms alike (its figures moved 4x with the load on a shared machine: read the
ratio of arms run close together, and the CPU time beside the wall time). What is timed: the wall time between the run's consecutive logged
steps (a logger that notes when each step's metrics arrive), which is what a step costs however the loop is
arranged (the delay line samples ahead, an overlapped sampler would hide generation behind the update). Step 1
is left out (it follows step 0's evaluation; at staleness 1 it samples two batches) and the last step too (it
runs the final evaluation): the median over steps 2 .. steps-1 of every run of an arm.

Besides the step, each arm's medians of the step's own timers: generation (`perf/generate_seconds`: in this
process, so 0 when overlapped), the update (`perf/train_seconds`), the trainer's wait for rollouts
(`perf/rollout_wait_seconds`, overlapped only), and the sampler's idle time where it runs in this process (the step
less its generation: the engine stands still while the trainer scores, updates and syncs; not measured for an
overlapped sampler, whose process does not report its own); and the token staleness the partial arms log
(`rollout/token_staleness_mean`).

`train.overlap` is being built elsewhere: when conf/train.yaml has no such key, its row says so and is skipped. An
arm that `rlmm train` refuses (exit 2: `rlmm.run.train.check_options`) is a skipped row with the refusal's reason
(partial rollouts overlapped were, before the sampler process could continue responses).
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

from benchmarks.common import ROOT, WORKLOADS, machine_info, set_runtime_env, write_record

ARMS = {"staleness=0": ["train.staleness=0"], "staleness=1": ["train.staleness=1"],
        "overlap": ["train.staleness=1", "train.overlap=true"],
        "partial": ["train.staleness=1", "train.partial_rollouts=true"],  # + train.rollout_chunk (--chunk)
        "partial+overlap": ["train.staleness=1", "train.overlap=true", "train.partial_rollouts=true"]}
LOGGED = ("perf/", "rollout/staleness", "rollout/token_staleness", "rollout/frac_responses_mixed",
          "rollout/version_spans")


def arm_overrides(arm: str, chunk: int) -> list[str]:
    return ARMS[arm] + ([f"train.rollout_chunk={chunk}"] if "train.partial_rollouts=true" in ARMS[arm] else [])


def workload_overrides(name: str) -> list[str]:
    """The overrides that make conf/train.yaml's run benchmarks/common.py's workload `name`."""
    if name == "default":
        return []  # conf/train.yaml as it is
    from benchmarks.models import sized_model
    from rlmm.models.tiny import default_cache_dir

    w = WORKLOADS[name]
    work = default_cache_dir() / "benchmarks"
    work.mkdir(parents=True, exist_ok=True)
    path, _ = sized_model(w.model, work)
    return ["model=hf", f"model.path={path}", f"train.prompts_per_step={w.prompts}", f"algo.group_size={w.group_size}",
            f"sampling.max_new_tokens={w.max_new_tokens}", f"trainer.micro_batch_size={w.micro_batch_size}"]


def refusal(cfg) -> str | None:
    """What `rlmm train` would refuse of this config before building anything (its exit 2), or None."""
    from rlmm.run.train import check_options

    try:
        check_options(cfg.train)
    except ValueError as err:
        return str(err)
    return None


class StepClock:
    """A logger (rlmm.run.logging's interface) that notes when each step's metrics arrive."""

    def __init__(self):
        self.arrivals: dict[int, float] = {}
        self.cpu: dict[int, float] = {}  # this process's CPU time (all threads) at each arrival
        self.metrics: dict[int, dict] = {}

    def log(self, metrics: dict, step: int | None = None) -> None:
        self.arrivals[step], self.cpu[step] = time.perf_counter(), time.process_time()
        self.metrics[step] = {k: v for k, v in metrics.items() if k.startswith(LOGGED)}

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
    parser.add_argument("--workload", choices=["default", "large"], default="default",
                        help="default: conf/train.yaml as it is; large: benchmarks/common.py's (25M model, 128 tokens)")
    parser.add_argument("--chunk", type=int, default=None,
                        help="train.rollout_chunk of the partial arms (default: a quarter of the new tokens)")
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
              *workload_overrides(args.workload), *args.override]
    chunk = args.chunk or max(1, compose_train_config(common)[0].sampling.max_new_tokens // 4)
    arms, skipped = [], {}
    for arm in args.arms.split(","):
        if arm not in ARMS:
            parser.error(f"--arms: unknown arm {arm!r} (known: {', '.join(ARMS)})")
        overlapped = "train.overlap=true" in ARMS[arm]
        if overlapped and "overlap" not in OmegaConf.load(ROOT / "conf" / "train.yaml").train:
            skipped[arm] = "train.overlap is not in this tree's conf/train.yaml yet: row skipped"
        elif overlapped and args.device == "cuda" and gpu_count() < 2:
            skipped[arm] = f"the overlapped sampler needs a GPU of its own: {gpu_count()} visible, 2 needed"
        else:
            refused = refusal(compose_train_config(common + arm_overrides(arm, chunk))[0])
            if refused:
                skipped[arm] = f"refused by rlmm train (exit 2): {refused}"
        if arm in skipped:
            print(f"{arm}: {skipped[arm]}", flush=True)
            continue
        arms.append(arm)
    order = []
    for repeat in range(args.repeats):
        order += arms if repeat % 2 == 0 else arms[::-1]
    runs = []
    for index, arm in enumerate(order):
        cfg, choices = compose_train_config(common + arm_overrides(arm, chunk))
        clock = StepClock()
        load_before = os.getloadavg()[0]
        with tempfile.TemporaryDirectory(prefix=f"rlmm-staleness-{index}-") as run_dir:
            started = time.perf_counter()
            run_train(cfg, Path(run_dir), choices, clock)
            wall = time.perf_counter() - started
        seconds = clock.step_seconds()
        timed = {s: t for s, t in seconds.items() if 2 <= s <= args.steps - 1}
        perf = {s: clock.metrics[s] for s in sorted(timed)}
        runs.append({"arm": arm, "run": index, "overrides": common + arm_overrides(arm, chunk), "wall": wall,
                     "step_seconds": seconds, "timed_median": statistics.median(timed.values()),
                     "step_cpu_seconds": clock.step_seconds("cpu"),
                     "staleness_logged": [perf[s].get("rollout/staleness") for s in perf],
                     "token_staleness_logged": [perf[s].get("rollout/token_staleness_mean") for s in perf],
                     "generate_seconds": [perf[s].get("perf/generate_seconds") for s in perf],
                     # the engine stands still for the rest of the step (one process): not for an overlapped one
                     "sampler_idle_seconds": [None if "train.overlap=true" in ARMS[arm] else
                                              timed[s] - perf[s].get("perf/generate_seconds", 0.0) for s in perf],
                     "perf": perf,  # the step's own stage timers and token staleness
                     "load_before": load_before, "load_after": os.getloadavg()[0]})
        print(f"{arm} (run {index + 1}/{len(order)}): median step {runs[-1]['timed_median']:.3f} s over steps "
              f"2..{args.steps - 1}, load {load_before:.1f} -> {runs[-1]['load_after']:.1f}", flush=True)
    summary = {}
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm]
        timed = [t for r in mine for s, t in r["step_seconds"].items() if 2 <= s <= args.steps - 1]
        cpu = [t for r in mine for s, t in r["step_cpu_seconds"].items() if 2 <= s <= args.steps - 1]

        def logged(key):  # a logged metric's median over the arm's timed steps
            return median_of([p.get(key) for r in mine for p in r["perf"].values()])

        summary[arm] = {"step_median": statistics.median(timed), "step_min": min(timed), "step_max": max(timed),
                        "step_cpu_median": statistics.median(cpu), "steps_timed": len(timed),
                        "generate_median": median_of([g for r in mine for g in r["generate_seconds"]]),
                        "sampler_idle_median": median_of([i for r in mine for i in r["sampler_idle_seconds"]]),
                        "train_median": logged("perf/train_seconds"),
                        "rollout_wait_median": logged("perf/rollout_wait_seconds"),
                        "weight_sync_median": logged("perf/weight_sync_seconds"),
                        "token_staleness_mean": logged("rollout/token_staleness_mean")}
    for arm in arms:
        summary[arm]["vs_staleness_0"] = (summary[arm]["step_median"] / summary["staleness=0"]["step_median"]
                                          if "staleness=0" in summary else None)
    columns = {"step_median": "step median s", "step_min": "min", "step_max": "max", "step_cpu_median": "CPU s",
               "generate_median": "generate s", "sampler_idle_median": "sampler idle s", "train_median": "train s",
               "rollout_wait_median": "wait s", "token_staleness_mean": "token stale", "vs_staleness_0": "vs stale=0"}
    print(f"\n{args.workload} workload, partial arms at train.rollout_chunk={chunk}")
    widths = {key: max(8, len(title) + 2) for key, title in columns.items()}
    print(f"{'arm':<16}" + "".join(title.rjust(widths[key]) for key, title in columns.items()))
    for arm in arms:
        cells = ("-" if summary[arm][key] is None else f"{summary[arm][key]:.3f}" for key in columns)
        print(f"{arm:<16}" + "".join(cell.rjust(widths[key]) for cell, key in zip(cells, columns)))
    for arm, why in skipped.items():
        print(f"{arm:<16}skipped: {why}")
    record = {"machine": machine_info(), "workload": args.workload, "chunk": chunk, "summary": summary,
              "skipped": skipped, "runs": runs, "order": order,
              "command": "python -m benchmarks.staleness " + " ".join(sys.argv[1:] if argv is None else argv)}
    write_record("staleness", record, args.out)


def median_of(values: list) -> float | None:
    """The median of the values that are not None (None: none are)."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


if __name__ == "__main__":
    main()
