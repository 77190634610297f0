"""Collapse early warning (`train.monitor`): online change detection on the step's metrics.

Liu et al. 2025 ("When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference
Mismatch") report that before a run collapses the sampler-vs-trainer mismatch spikes (their KL between
the two policies and the importance weights' spread grow) while the reward still looks fine, and falls
only later. So a test that watches the mismatch metrics for a lasting upward shift can warn before the
reward does. Each watched signal gets one `CUSUM` detector (Page 1954) on the signal robustly
standardised against its own first steps; the run logs every detector's score, raises an alarm when one
crosses the threshold, and can act on it (`train.monitor.action`):

- `none`: log only (a warning line naming the signal, the step and the score; the step's row in
  steps.jsonl gets `monitor/alarms`);
- `stop`: checkpoint and stop the run (`rlmm: stopped: monitor alarm ...`, exit 3, like `max_bad_steps`);
- `switch_correction`: from the next step on, train with the correction `conf/correction/<switch_to>.yaml`
  (built from the correction group, as rlmm/run/components.py builds the run's own).

Each is a member of `Action`, which owns what it does on the alarm and again when a run that had raised it
resumes; the YAML spells it by name (`action: stop`).

The detector acts on the first alarm of the run only (one stop, one switch); later alarms are logged.
Metrics are means over ranks, so every rank takes the same decision at the same step.
"""
from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from enum import Enum

from rlmm.runtime.errors import ConfigError

log = logging.getLogger(__name__)

DIRECTIONS = ("up", "down")
MAD_TO_SD = 1.4826  # 1 / Φ⁻¹(3/4): the MAD of a normal sample times this estimates its standard deviation


class CUSUM:
    """One-sided CUSUM (Page 1954, "Continuous inspection schemes") on a robust z-score.

    Warm-up: the first `warmup_steps` observations x_1..x_K are only collected; then the baseline is

        m = median(x_1..x_K),   s = max(1.4826 · MAD(x_1..x_K), 1e-6 · |m|, 1e-12)

    (MAD = median |x_i - m|; the floor keeps a warm-up that was constant from dividing by 0). Each later
    observation x_t becomes

        z_t = clip(σ · (x_t - m) / s, -c, c),   σ = +1 for direction `up`, -1 for `down`

    so that z_t > 0 is the direction that means trouble (a mismatch metric rising, a reward or an ESS
    falling), and the score is Page's recursion

        S_t = max(0, S_{t-1} + z_t - k),   S = 0 through the warm-up,

    with alarm while S_t > h. k (`drift`) is the shift per step, in robust standard deviations, that the
    sum forgives (k = δ/2 detects a shift of δ fastest); h (`threshold`) trades the false-alarm rate for
    delay. Departures from Page: the baseline is estimated from the run's own first steps instead of
    known, the standardisation is by median/MAD instead of mean/sd so that the warm-up's own spikes do
    not inflate it, z is clipped at ±c so that one outlier step cannot raise an alarm by itself (it adds
    at most c - k), and S is not reset after an alarm (it says how far into the shift the run is).

    Number in, number out: `update(x)` takes a float (or a 0-d tensor) and returns S_t. A non-finite x
    (a skipped step's NaN metric) leaves S as it was.
    """

    def __init__(self, direction: str, warmup_steps: int, drift: float, threshold: float, clip: float):
        if direction not in DIRECTIONS:
            raise ConfigError(f"direction: '{direction}' (allowed: {', '.join(DIRECTIONS)})")
        self.sign = 1.0 if direction == "up" else -1.0
        self.warmup_steps, self.drift, self.threshold, self.clip = warmup_steps, drift, threshold, clip
        self.warmup: list[float] = []
        self.median = self.scale = math.nan
        self.score = 0.0

    def update(self, x) -> float:
        x = float(x)
        if not math.isfinite(x):
            return self.score
        if len(self.warmup) < self.warmup_steps:
            self.warmup.append(x)
            if len(self.warmup) == self.warmup_steps:
                self.median = _median(self.warmup)
                mad = _median([abs(v - self.median) for v in self.warmup])
                self.scale = max(MAD_TO_SD * mad, 1e-6 * abs(self.median), 1e-12)
            return self.score
        z = max(-self.clip, min(self.clip, self.sign * (x - self.median) / self.scale))
        self.score = max(0.0, self.score + z - self.drift)
        return self.score

    @property
    def alarm(self) -> bool:
        return self.score > self.threshold

    def state_dict(self) -> dict:
        """What a checkpoint keeps (JSON: the baseline as None until the warm-up is complete)."""
        finite = lambda v: v if math.isfinite(v) else None  # noqa: E731
        return {"warmup": list(self.warmup), "median": finite(self.median), "scale": finite(self.scale),
                "score": self.score}

    def load_state_dict(self, state: dict) -> None:
        self.warmup = list(state["warmup"])
        self.median, self.scale = (math.nan if v is None else v for v in (state["median"], state["scale"]))
        self.score = state["score"]


def _median(values: list[float]) -> float:
    ordered, n = sorted(values), len(values)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


@dataclass(frozen=True)
class Alarm:
    signal: str
    step: int
    score: float
    threshold: float

    def __str__(self) -> str:
        return f"{self.signal} score {self.score:.3g} > {self.threshold:g} at step {self.step}"


def _log_only(monitor: Monitor, step: int, components) -> None:
    """The alarm's warning line is all (`Monitor.observe` writes it for every action)."""


def _stop(monitor: Monitor, step: int, components) -> None:
    monitor.stop_requested = True


def _switch_correction(monitor: Monitor, step: int, components) -> None:
    from rlmm.config.options import from_yaml

    components.correction = from_yaml("correction", monitor.switch_to)
    log.warning("monitor: correction switched to %s from step %d on", monitor.switch_to, step + 1)


class Action(Enum):
    """`train.monitor.action`, by name: what the run does on its first alarm (``on_alarm``) and, resumed from a
    checkpoint written after it, again (``on_resume``), each ``(monitor, step, components)``, `step` the alarm's.
    A switched correction is switched again (the components are built from the config); a run stopped by its
    alarm does not stop again."""

    # (on_alarm, on_resume)
    none = (_log_only, _log_only)
    stop = (_stop, _log_only)
    switch_correction = (_switch_correction, _switch_correction)

    def __init__(self, on_alarm, on_resume):
        self.on_alarm, self.on_resume = on_alarm, on_resume


class Monitor:
    """The detectors of a run (`train.monitor`, enabled), fed each step's metrics by the training loop.

    Args:
        rising: metrics the step logs that mean trouble when they go up (e.g. mismatch/kl_k3).
        falling: metrics that mean trouble when they go down (e.g. mismatch/ess_seq, rollout/reward_mean).
        warmup_steps, drift, threshold, clip: each detector's K, k, h, c (`CUSUM`).
        action: none | stop | switch_correction (on the run's first alarm): an `Action`'s name.
        switch_to: the correction option (conf/correction/) that `switch_correction` trains with.
    """

    def __init__(self, rising: list[str], falling: list[str], warmup_steps: int, drift: float, threshold: float, clip: float,
                 action: str, switch_to: str):
        from rlmm.config.options import group_options

        where = "train.monitor"
        if action not in Action.__members__:
            raise ConfigError(f"{where}.action: '{action}' (allowed: {', '.join(Action.__members__)})")
        if switch_to not in group_options("correction"):
            raise ConfigError(f"{where}.switch_to: '{switch_to}' (allowed: {', '.join(group_options('correction'))})")
        if not rising and not falling:
            raise ConfigError(f"{where}.rising, falling: both empty (give at least one metric the step logs)")
        both = sorted(set(rising) & set(falling))
        if both:
            raise ConfigError(f"{where}: '{both[0]}' is both rising and falling (allowed: one of the two)")
        signals = {**{name: "up" for name in rising}, **{name: "down" for name in falling}}
        for key, value, ok, allowed in (("warmup_steps", warmup_steps, warmup_steps >= 2, ">= 2"),
                                        ("drift", drift, drift >= 0, ">= 0"),
                                        ("threshold", threshold, threshold > 0, "> 0"),
                                        ("clip", clip, clip > drift, "> drift")):
            if not ok:  # NaN fails every comparison
                raise ConfigError(f"{where}.{key}: {value} (allowed: {allowed})")
        short = [score_key(name) for name in signals]
        if len(set(short)) < len(short):
            raise ConfigError(f"{where}: two signals share a score name ({', '.join(short)})")
        self.detectors = {name: CUSUM(direction, warmup_steps, drift, threshold, clip)
                          for name, direction in signals.items()}
        self.action, self.switch_to, self.threshold = Action[action], switch_to, threshold
        self.alarms: list[Alarm] = []  # every alarm of the run, in order
        self.new_alarms: list[Alarm] = []  # this step's
        self.stop_requested = False
        self._checked = False

    def observe(self, metrics: dict[str, float], step: int, components=None) -> dict[str, float]:
        """Feed one step's metrics; returns `monitor/<signal>_score` for each signal and `monitor/alarm`
        (1 while any score is above the threshold). A new alarm is logged and acted on (the first of the
        run: stop, or switch `components.correction`)."""
        if not self._checked:
            unknown = [name for name in self.detectors if name not in metrics]
            if unknown:
                raise ConfigError(f"train.monitor: '{unknown[0]}' is not a metric the step logs (allowed: "
                                  f"{', '.join(k for k in sorted(metrics) if k.split('/')[0] in WATCHABLE)})")
            self._checked = True
        out, self.new_alarms = {}, []
        for name, detector in self.detectors.items():
            was = detector.alarm
            value = metrics[name]
            out[score_key(name)] = detector.update(math.nan if value is None else value)
            if detector.alarm and not was:
                self.new_alarms.append(Alarm(name, step, detector.score, self.threshold))
        out["monitor/alarm"] = float(any(d.alarm for d in self.detectors.values()))
        for alarm in self.new_alarms:
            log.warning("monitor alarm: %s (train.monitor.action=%s)", alarm, self.action.name)
        if self.new_alarms and not self.alarms:
            self.action.on_alarm(self, step, components)
        self.alarms.extend(self.new_alarms)
        return out

    def state_dict(self) -> dict:
        """The detectors and the run's alarms, for a checkpoint (state.json): a resumed run goes on with
        the baselines, scores and first alarm of the interrupted one instead of a new warm-up."""
        return {"detectors": {name: d.state_dict() for name, d in self.detectors.items()},
                "alarms": [asdict(a) for a in self.alarms]}

    def load_state_dict(self, state: dict, components) -> None:
        """Restore `state_dict()`'s state (detectors of signals no longer watched are dropped, new ones
        start their warm-up). An action already taken stays taken (`Action.on_resume`)."""
        for name, detector_state in state.get("detectors", {}).items():
            if name in self.detectors:
                self.detectors[name].load_state_dict(detector_state)
        self.alarms = [Alarm(**a) for a in state.get("alarms", [])]
        if self.alarms:
            self.action.on_resume(self, self.alarms[0].step, components)

    def record_entry(self) -> dict:
        """This step's new alarms, for the run record's row (not for the logger: not numbers)."""
        return {"monitor/alarms": [{"signal": a.signal, "score": a.score} for a in self.new_alarms]} \
            if self.new_alarms else {}

    def stop_message(self, checkpoint) -> str:
        return (f"monitor alarm: {self.alarms[0]} (train.monitor.action=stop); checkpoint in {checkpoint}")


class NoMonitor:
    """`train.monitor.enabled: false`: the same calls, doing nothing, so the loop has no `if`."""

    stop_requested = False

    def observe(self, metrics: dict[str, float], step: int, components=None) -> dict[str, float]:
        return {}

    def record_entry(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict, components) -> None:
        pass


WATCHABLE = ("mismatch", "rollout", "correction", "loss")


def score_key(signal: str) -> str:
    """`mismatch/kl_k3` -> `monitor/kl_k3_score`."""
    return f"monitor/{signal.rsplit('/', 1)[-1]}_score"


def build_monitor(options) -> Monitor | NoMonitor:
    """The run's monitor from `train.monitor` (a typed node: rlmm/config/schema.py), or the no-op one when it is
    off; its values are checked either way, so a bad one fails before the run starts."""
    monitor = Monitor(list(options.rising), list(options.falling), options.warmup_steps, options.drift, options.threshold, options.clip,
                      options.action, options.switch_to)
    return monitor if options.enabled else NoMonitor()
