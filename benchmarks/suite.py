"""The benchmark suite: rlmm's RL step vs the same work by each library alone vs TRL's GRPOTrainer.

    .venv/bin/python -m benchmarks.suite                       # default + large, fp32 + bf16, every system
    .venv/bin/python -m benchmarks.suite --size smoke --steps 2 --warmup 1    # a quick check that all runs
    .venv/bin/python -m benchmarks.suite --show benchmarks/results/<run>/results.json   # re-print a table

Each (size, precision, system) runs in its own process (benchmarks/{rlmm_step,parts,trl_grpo}.py), one after
the other, so that every process's peak RSS is its own and no two compete for the cores. TRL runs in
benchmarks/.venv-trl (bash benchmarks/setup_trl.sh). Results: benchmarks/results/<date>_<time>/results.json
(machine, versions, every step of every system) and logs/ beside it. See benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from benchmarks.common import ROOT, WORKLOADS, git_commit, machine_info, package_versions

SYSTEMS = ("rlmm", "parts", "trl-vllm", "trl-hf")
PRECISIONS = ("fp32", "bf16")
STAGES = [  # (key in the workers' medians, label); indented ones are parts of the one above
    ("generate", "generate"), ("generate.engine", "  engine call"), ("generate.unseeded", "  unseeded"),
    ("reward", "reward"), ("trainer_logprobs", "trainer log-probs"), ("logprobs", "log-probs"),
    ("train", "train"), ("train.cpu", "  CPU time (fwd+bwd+step)"), ("train.forward", "  forward"), ("train.backward", "  backward"),
    ("train.step", "  optimizer step"), ("train.other", "  other"),
    ("weight_sync", "weight sync"), ("weight_sync.state_dict", "  state_dict"),
    ("logging", "logging"), ("other", "everything else"), ("step.cpu", "step CPU time"),
]


def trl_python(explicit: str | None) -> str | None:
    candidate = Path(explicit) if explicit else ROOT / "benchmarks" / ".venv-trl" / "bin" / "python"
    return str(candidate) if candidate.exists() else None


def run_worker(module: str, job: dict, out_dir: Path, tag: str, python: str, timeout: float) -> dict:
    """Run `python -m benchmarks.<module> job.json result.json`; return its result or why it failed."""
    jobs = out_dir / "jobs"
    logs = out_dir / "logs"
    jobs.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    job_path, result_path, log_path = jobs / f"{tag}.json", jobs / f"{tag}.result.json", logs / f"{tag}.log"
    job_path.write_text(json.dumps(job, indent=2))
    result_path.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                            "LOCAL_RANK")}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    print(f"[{time.strftime('%H:%M:%S')}] {tag}: running (log: {log_path.relative_to(ROOT) if log_path.is_relative_to(ROOT) else log_path})",
          flush=True)
    try:
        with open(log_path, "w") as log:
            done = subprocess.run([python, "-m", f"benchmarks.{module}", str(job_path), str(result_path)], cwd=ROOT,
                                  env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
        status = "ok" if done.returncode == 0 and result_path.exists() else f"failed (exit {done.returncode})"
    except subprocess.TimeoutExpired:
        status = f"failed (timeout after {timeout:.0f} s)"
    wall = time.perf_counter() - started
    result = json.loads(result_path.read_text()) if status == "ok" else {}
    if status != "ok":
        tail = log_path.read_text(errors="replace").strip().splitlines()[-40:]
        errors = [line for line in tail if "Error" in line or "error:" in line]
        result["error"] = (errors[-1] if errors else (tail[-1] if tail else "no output"))[:500]
        print(f"    {status}: {result['error']}", flush=True)
    else:
        step = result.get("median", {}).get("step") or result.get("median", {}).get("sum")
        print(f"    ok in {wall:.0f} s" + (f": median step {step:.3f} s" if step else "")
              + f", peak RSS {result.get('peak_rss_mib', 0):.0f} MiB", flush=True)
    return {**result, "status": status, "wall_seconds": wall, "load_average_before": load_before,
            "load_average_after": os.getloadavg()[0], "log": str(log_path)}


def run_suite(args) -> dict:
    out_dir = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / time.strftime("%Y-%m-%d_%H-%M-%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    trl = trl_python(args.trl_python)
    record = {
        "machine": machine_info(), "versions": package_versions(python),
        "versions_trl_venv": package_versions(trl) if trl else None, "git_commit": git_commit(),
        "command": " ".join([Path(python).name, "-m", "benchmarks.suite", *sys.argv[1:]]),
        "device": args.device, "noisy": not args.quiet_machine, "workloads": {}, "models": {}, "results": [],
        "probe": [],
    }
    results_path = out_dir / "results.json"

    def save():
        results_path.write_text(json.dumps(record, indent=2, default=str))

    for size in args.size:
        w = WORKLOADS[size]
        w = replace(w, steps=args.steps or w.steps, warmup=args.warmup if args.warmup is not None else w.warmup)
        record["workloads"][size] = asdict(w)
        prepared = run_worker("prepare", {"model": w.model, "precisions": args.precision, "device": args.device,
                                          "model_path": args.model_path},
                              out_dir, f"{size}-prepare", python, args.timeout)
        record["models"][size] = prepared
        save()
        if prepared["status"] != "ok":
            continue
        for precision in args.precision:
            common = {"workload": asdict(w), "precision": precision, "device": args.device}
            if args.device == "cuda":
                common["gpu_memory_utilization"] = args.gpu_memory_utilization
            for system in args.systems:
                tag = f"{size}-{precision}-{system}"
                run_dir = str(out_dir / "runs" / tag)
                if system == "rlmm":
                    for label, extra in variants(args.variant):
                        overrides = list(args.override) + extra
                        if args.device == "cuda":
                            overrides.append(f"sampler.gpu_memory_utilization={args.gpu_memory_utilization}")
                        job = {**common, "model_path": prepared["model_path"], "run_dir": run_dir + label,
                               "model_path_given": bool(args.model_path), "logger": args.logger,
                               "overrides": overrides, "eval_prompts": args.eval_prompts}
                        result = run_worker("rlmm_step", job, out_dir, tag + label, python, args.timeout)
                        record["results"].append({**result, "size": size, "precision": precision,
                                                  "system": f"rlmm{label}"})
                        save()
                    continue
                elif system == "parts":
                    job = {**common, "model_path": prepared["model_path"]}
                    result = run_worker("parts", job, out_dir, tag, python, args.timeout)
                else:
                    if trl is None:
                        result = {"status": "skipped", "error": "no benchmarks/.venv-trl (bash benchmarks/setup_trl.sh)"}
                    else:
                        job = {**common, "model_path": prepared["paths"][precision], "run_dir": run_dir,
                               "generation": "vllm" if system == "trl-vllm" else "transformers"}
                        result = run_worker("trl_grpo", job, out_dir, tag, trl, args.timeout)
                record["results"].append({**result, "size": size, "precision": precision, "system": system})
                save()
            if args.probe:
                record["probe"].append({"size": size, "precision": precision,
                                        **run_probe(prepared["model_path"], precision, w, args, out_dir, size)})
                save()
    record["summary"] = summary_rows(record)
    save()
    print_tables(record)
    print(f"\nwrote {results_path}")
    return record


def variants(specs: list[str]) -> list[tuple[str, list[str]]]:
    """`--variant "LABEL OVERRIDE ..."` as ("-LABEL", overrides); none given: rlmm once, as configured."""
    if not specs:
        return [("", [])]
    out = []
    for spec in specs:
        label, *overrides = spec.split()
        out.append((f"-{label}", overrides))
    return out


def run_probe(model_path: str, precision: str, w, args, out_dir: Path, size: str) -> dict:
    """`rlmm probe` on the benchmark's model: sampler vs trainer mismatch at this scale."""
    run_dir = out_dir / "runs" / f"{size}-{precision}-probe"
    model = [] if w.model == "tiny" and not args.model_path else ["model=hf", f"model.path={model_path}"]
    command = [str(Path(sys.executable).parent / "rlmm"), "probe", *model, f"precision={precision}", "logger=none",
               f"sampling.max_new_tokens={w.max_new_tokens}", f"probe.num_prompts={args.probe_prompts}",
               f"hydra.run.dir={run_dir}", *args.probe_override]
    if args.device == "cuda":
        command.append(f"sampler.gpu_memory_utilization={args.gpu_memory_utilization}")
    log_path = out_dir / "logs" / f"{size}-{precision}-probe.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"[{time.strftime('%H:%M:%S')}] {size}-{precision}-probe: {' '.join(command[1:])}", flush=True)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    try:
        with open(log_path, "w") as log:
            done = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=args.timeout)
        probe = json.loads((run_dir / "probe.json").read_text()) if done.returncode == 0 else None
    except (subprocess.TimeoutExpired, OSError, ValueError):
        probe = None
    if probe is None:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-5:] if log_path.exists() else []
        print(f"    failed: {tail[-1] if tail else 'no output'}", flush=True)
        return {"status": "failed", "error": tail[-1] if tail else "no output", "log": str(log_path)}
    print(f"    ok: mean |logprob diff| {probe['sampler_vs_trainer']['logprob_abs_diff_mean']:.3e}", flush=True)
    return {"status": "ok", "sampler_vs_trainer": probe["sampler_vs_trainer"],
            "trainer_vs_itself": probe["trainer_vs_itself"], "precision_report": probe["precision"],
            "rollouts": probe["rollouts"], "seconds": probe["seconds"], "log": str(log_path)}


# ----------------------------------------------------------------------------------------------------------
def _step(result: dict) -> float | None:
    if result.get("status") != "ok":
        return None
    median = result.get("median", {})
    return median.get("step", median.get("sum"))


def summary_rows(record: dict) -> list[dict]:
    """One row per (size, precision): each system's median step, the ratios, peak RSS."""
    rows = []
    keys = sorted({(r["size"], r["precision"]) for r in record["results"]},
                  key=lambda k: (list(WORKLOADS).index(k[0]) if k[0] in WORKLOADS else 99,
                                 PRECISIONS.index(k[1]) if k[1] in PRECISIONS else 99))
    for size, precision in keys:
        by = {r["system"]: r for r in record["results"] if r["size"] == size and r["precision"] == precision}
        step = {s: _step(r) for s, r in by.items()}
        rlmm = step.get("rlmm")
        row = {"size": size, "precision": precision,
               **{f"{s}_step": v for s, v in step.items()},
               **{f"{s}_peak_rss_mib": r.get("peak_rss_mib") for s, r in by.items() if r.get("status") == "ok"},
               **{f"{s}_status": r.get("status") for s, r in by.items()}}
        for other in ("parts", "trl-vllm", "trl-hf"):
            if rlmm and step.get(other):
                row[f"rlmm_over_{other}"] = rlmm / step[other]
        if by.get("rlmm", {}).get("status") == "ok":
            row["tokens_per_step"] = by["rlmm"].get("tokens_per_step")
            row["rlmm_tokens_per_second"] = row["tokens_per_step"] / rlmm
        rows.append(row)
    return rows


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, str):
        return value
    return f"{value:.{digits}f}"


def print_tables(record: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=max(180, Console().width))
    m = record["machine"]
    versions = record.get("versions") or {}
    trl_version = (record.get("versions_trl_venv") or {}).get("trl")
    console.print(f"[bold]machine[/]: {m['cpu']}, {m['cores_usable']} usable cores, "
                  f"{(m.get('memory_gib') or 0):.0f} GiB, GPU: {m.get('gpu') or 'none'}; {m['date']}; "
                  + ", ".join(f"{k} {v}" for k, v in versions.items()) + (f", trl {trl_version}" if trl_version else ""))
    if record.get("noisy", True):
        console.print("[yellow]noisy: not run with --quiet-machine (other load on the machine); "
                      f"load average at start {m['load_average_1_5_15'][0]:.1f}[/]")
    groups: dict[tuple, list] = {}
    for r in record["results"]:
        groups.setdefault((r["size"], r["precision"]), []).append(r)
    for (size, precision), results in groups.items():
        w = record["workloads"][size]
        model = record["models"].get(size, {})
        params = (model.get("info") or {}).get("num_parameters")
        title = (f"{size} / {precision}: {w['prompts']} prompts x {w['group_size']} samples x ≤{w['max_new_tokens']} "
                 f"new tokens, micro-batch {w['micro_batch_size']}, model {w['model']}"
                 + (f" ({params / 1e6:.1f}M params)" if params else "")
                 + f"; seconds, median of {w['steps']} steps after {w['warmup']} warm-up")
        table = Table(title=title, title_justify="left")
        table.add_column("stage")
        for r in results:
            table.add_column(escape(r["system"]), justify="right")
        present = [(k, label) for k, label in STAGES if any(k in r.get("median", {}) for r in results)]
        for key, label in present:
            table.add_row(label, *[_fmt(r.get("median", {}).get(key)) if r.get("status") == "ok" else "" for r in results])
        table.add_row("[bold]step[/]", *[f"[bold]{_fmt(_step(r))}[/]" if r.get("status") == "ok" else r.get("status", "")
                                         for r in results], end_section=True)
        table.add_row("step min–max", *[f"{_fmt(r.get('step_min'), 2)}–{_fmt(r.get('step_max'), 2)}"
                                        if r.get("status") == "ok" else "" for r in results])
        table.add_row("mean response tokens", *[_fmt(r.get("response_length_mean"), 1) for r in results])
        table.add_row("peak RSS (MiB)", *[_fmt(r.get("peak_rss_mib"), 0) for r in results])
        if any(r.get("gpu_peak_mib") for r in results):
            table.add_row("peak GPU alloc (MiB)", *[_fmt(r.get("gpu_peak_mib"), 0) for r in results])
        table.add_row("setup (s)", *[_fmt(r.get("setup_seconds"), 1) for r in results])
        table.add_row("torch threads at end", *[str(r.get("torch_threads", "—")) for r in results])
        table.add_row("load avg before→after", *[f"{r['load_average_before']:.1f}→{r['load_average_after']:.1f}"
                                                 if "load_average_before" in r else "—" for r in results])
        console.print(table)
        for r in results:
            if r.get("status") not in ("ok",):
                console.print(escape(f"  {r['system']}: {r.get('status')}: {r.get('error', '')}"))
            if r.get("logger_error"):
                console.print(escape(f"  {r['system']}: {r['logger_error']}"))

    summary = summary_rows(record)
    table = Table(title="summary: median step seconds, ratios rlmm / other (> 1: rlmm slower), peak RSS MiB",
                  title_justify="left")
    for column in ("size", "prec", "rlmm", "parts", "rlmm/parts", "TRL-vLLM", "rlmm/TRL-vLLM", "TRL-hf",
                   "rlmm/TRL-hf", "rlmm tok/s", "RSS rlmm", "RSS parts", "RSS TRL-vLLM", "RSS TRL-hf"):
        table.add_column(column, justify="right")
    for row in summary:
        table.add_row(row["size"], row["precision"], _fmt(row.get("rlmm_step")), _fmt(row.get("parts_step")),
                      _fmt(row.get("rlmm_over_parts"), 2), _fmt(row.get("trl-vllm_step")),
                      _fmt(row.get("rlmm_over_trl-vllm"), 2), _fmt(row.get("trl-hf_step")),
                      _fmt(row.get("rlmm_over_trl-hf"), 2), _fmt(row.get("rlmm_tokens_per_second"), 0),
                      *[_fmt(row.get(f"{s}_peak_rss_mib"), 0) for s in SYSTEMS])
    console.print(table)
    layouts = [r for r in record["results"] if r["system"].startswith("rlmm-") and r.get("status") == "ok"]
    if layouts:
        table = Table(title="rlmm variants (--variant) and TRL: median seconds; train = forward + backward + "
                            "optimizer step; x: the first variant's over this one", title_justify="left")
        for column in ("size", "prec", "system", "step", "step CPU", "train", "train CPU", "train x (CPU x)",
                       "peak RSS MiB"):
            table.add_column(column, justify="right")
        for r in layouts + [r for r in record["results"] if r["system"].startswith("trl") and r.get("status") == "ok"]:
            first = next(f for f in layouts if f["size"] == r["size"] and f["precision"] == r["precision"])
            m, f = r["median"], first["median"]
            train = sum(m.get(k, 0.0) for k in ("train.forward", "train.backward", "train.step"))
            first_train = sum(f.get(k, 0.0) for k in ("train.forward", "train.backward", "train.step"))
            table.add_row(r["size"], r["precision"], r["system"], _fmt(m.get("step")), _fmt(m.get("step.cpu")),
                          _fmt(train), _fmt(m.get("train.cpu")),
                          f"{first_train / train:.2f} ({f.get('train.cpu', 0) / max(m.get('train.cpu', 1e-9), 1e-9):.2f})",
                          _fmt(r.get("peak_rss_mib"), 0))
        console.print(table)
    probes = [p for p in record.get("probe", []) if p.get("status") == "ok"]
    if probes:
        table = Table(title="rlmm probe at the benchmark's scale (sampler vs trainer, same rollouts)",
                      title_justify="left")
        for column in ("size", "precision", "mean |Δlogp|", "max |Δlogp|", "KL k3", "prob Pearson",
                       "frac ratio outside", "trainer vs itself |Δlogp|"):
            table.add_column(column, justify="right")
        for p in probes:
            s, t = p["sampler_vs_trainer"], p["trainer_vs_itself"]
            table.add_row(p["size"], p["precision"], f"{s['logprob_abs_diff_mean']:.3e}", f"{s['logprob_abs_diff_max']:.3e}",
                          f"{s['kl_k3']:.3e}", f"{s['prob_pearson']:.6f}", f"{s['frac_ratio_outside']:.4f}",
                          f"{t['logprob_abs_diff_mean']:.3e}")
        console.print(table)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.suite", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)

    def listed(allowed):
        def parse(text):
            values = [v for v in text.split(",") if v]
            bad = [v for v in values if v not in allowed]
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {', '.join(bad)} (allowed: {', '.join(allowed)})")
            return values
        return parse

    parser.add_argument("--size", type=listed(WORKLOADS), default=["default", "large"],
                        help=f"workloads, comma-separated ({', '.join(WORKLOADS)}; default: default,large)")
    parser.add_argument("--precision", type=listed(PRECISIONS), default=list(PRECISIONS),
                        help="fp32 and/or bf16 (both sides; default: fp32,bf16)")
    parser.add_argument("--systems", type=listed(SYSTEMS), default=list(SYSTEMS),
                        help=f"what to run (default: {','.join(SYSTEMS)})")
    parser.add_argument("--steps", type=int, default=None, help="measured steps (default: the workload's)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: the workload's)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--logger", default="wandb",
                        help="rlmm's logger= for its steps (default wandb: conf/train.yaml's, offline; none: off)")
    parser.add_argument("--eval-prompts", type=int, default=0,
                        help="also time one rlmm greedy evaluation on this many prompts (0: off)")
    parser.add_argument("--override", action="append", default=[], help="extra rlmm train override (repeatable)")
    parser.add_argument("--variant", action="append", default=[], metavar='"LABEL OVERRIDE ..."',
                        help="run rlmm once per variant (system rlmm-LABEL) with these extra overrides "
                             "(repeatable; e.g. --variant padded --variant budget trainer.micro_batch_tokens=2048)")
    parser.add_argument("--model-path", default=None, help="use this checkpoint instead of building one")
    parser.add_argument("--trl-python", default=None, help="python of the TRL venv (default benchmarks/.venv-trl)")
    parser.add_argument("--probe", action="store_true", help="also run `rlmm probe` on each size x precision")
    parser.add_argument("--probe-prompts", type=int, default=32)
    parser.add_argument("--probe-override", action="append", default=[], help="extra rlmm probe override")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="vLLM's share of the GPU (cuda)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per worker process")
    parser.add_argument("--out", default=None, help="output folder (default benchmarks/results/<date>_<time>)")
    parser.add_argument("--quiet-machine", action="store_true",
                        help="declare that nothing else ran on the machine (else the results are marked noisy)")
    parser.add_argument("--show", default=None, metavar="RESULTS_JSON", help="only print the tables of a past run")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.show:
        print_tables(json.loads(Path(args.show).read_text()))
        return
    run_suite(args)


if __name__ == "__main__":
    main()
