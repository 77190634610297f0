"""W&B runs as `Run`s: the `wandb:ENTITY/PROJECT[/GROUP]` source, the `wandb.Api()` client, and the
clean-up that keeps a failed request a one-line error rather than a hang (`_stop_wandb_service`,
`_silence_thread`)."""
from __future__ import annotations

import os

from rlmm.table.base import Run, TableError, is_number, number, set_status


def parse_wandb_source(source: str) -> tuple[str, str, str | None]:
    """`wandb:ENTITY/PROJECT[/GROUP]` -> (entity, project, group or None)."""
    parts = source.removeprefix("wandb:").split("/", 2)
    if len(parts) < 2 or not all(parts):
        raise TableError(f"bad W&B source '{source}' (expected wandb:ENTITY/PROJECT[/GROUP])")
    return parts[0], parts[1], parts[2] if len(parts) == 3 else None


def read_wandb(source: str) -> list[Run]:
    """Runs of a W&B project (one group of it if given), through `wandb.Api()`: the history gives the
    steps, the summary the one-off numbers (probe metrics, `summary/*`), and the config the axes (the
    group choices, and the dotted leaves of the other nodes such as `seed`, `train.steps`)."""
    entity, project, group = parse_wandb_source(source)
    os.environ.setdefault("WANDB_SILENT", "true")
    import requests
    import wandb

    try:
        api = wandb.Api()  # HTTP timeout: WANDB_HTTP_TIMEOUT (W&B default 19 s)
        found = list(api.runs(f"{entity}/{project}", filters={"group": group} if group else None))
        runs = [_wandb_run(r, f"wandb:{entity}/{project}") for r in found]
    except (wandb.errors.Error, requests.RequestException, OSError, ValueError) as err:
        _stop_wandb_service()
        message = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise TableError(f"W&B {source}: {message}") from None
    if not runs:
        raise TableError(f"no runs in {source}")
    return runs


def _stop_wandb_service() -> None:
    """Kill wandb-core after a failed request: it may still be retrying that request, and W&B's exit
    hook waits for it with no time limit (wandb 0.31: ServiceConnection.teardown -> proc.join()), which
    turned a one-line error into a hang of minutes on a loaded machine."""
    from wandb.sdk import wandb_setup

    connection = getattr(wandb_setup._singleton, "_connection", None)
    process = getattr(getattr(connection, "_proc", None), "_process", None)
    if process is None:
        return
    unregister_exit_hook = getattr(connection, "_cleanup", None)
    if unregister_exit_hook:
        unregister_exit_hook()
    _silence_thread("wandb-ServiceFinalizer")  # it may still publish to the killed service, and fail
    process.kill()
    process.wait()


def _silence_thread(name: str) -> None:
    """Drop uncaught exceptions of one thread: W&B's finalizer thread publishing to a service we killed
    printed a traceback under the one-line error (seen once in CI)."""
    import threading

    previous = threading.excepthook

    def hook(args):
        if args.thread is None or args.thread.name != name:
            previous(args)

    threading.excepthook = hook


def _wandb_run(wandb_run, prefix: str) -> Run:
    config = dict(wandb_run.config)
    choices = dict(config.get("choices") or {})
    overrides = {k: str(v) for k, v in choices.items()}
    for key, value in config.items():
        if key not in choices and key != "choices" and not key.startswith("_"):  # _wandb: W&B's own
            overrides.update(_flatten(key, value))
    run = Run(name=wandb_run.id, path=f"{prefix}/{wandb_run.id}", overrides=overrides)
    for row in wandb_run.scan_history():
        step = {k: v for k, v in row.items() if not k.startswith("_") and is_number(v)}
        if step:
            run.history.append({"step": int(row.get("_step", len(run.history))), **step})
    logged = {k for row in run.history for k in row}
    summary = {k: v for k, v in wandb_run.summary_metrics.items() if not k.startswith("_") and is_number(v)}
    if run.history:
        run.kind = "train"
        run.steps = max(row["step"] for row in run.history)
        run.values = {f"summary/{k}": number(v) for k, v in summary.items() if k not in logged}
    elif summary:
        run.kind, run.steps = "probe", 1
        run.values = {k: number(v) for k, v in summary.items()}
    state = wandb_run.state
    error = f"W&B state {state}" if state in ("failed", "crashed") else ""
    return set_status(run, complete=state == "finished", error=error)


def _flatten(key: str, value) -> dict[str, str]:
    if isinstance(value, dict):
        return {k: v for sub, item in value.items() for k, v in _flatten(f"{key}.{sub}", item).items()}
    return {key: str(value)}
