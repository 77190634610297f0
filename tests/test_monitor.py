"""`train.monitor` (rlmm/run/monitor.py): the CUSUM detector on constructed series, the monitor's checks and
actions, and the training loop's hooks in real runs (off: the run is unchanged; stop; switch_correction)."""
import json
import math
import random
import subprocess
import sys

import pytest

from rlmm.run.monitor import CUSUM, Monitor, NoMonitor, build_monitor
from rlmm.runtime.errors import ConfigError
from tests.conftest import ending, subprocess_env

DETECTOR = dict(warmup_steps=10, drift=1.0, threshold=12.0, clip=4.0)  # conf/train.yaml's values
SETTLED = {**DETECTOR, "warmup_steps": 30}  # a baseline estimated well (30 steps), for the exact properties
SIGNALS = dict(rising=["mismatch/kl_k3"], falling=["rollout/reward_mean"])


def first_alarm(detector: CUSUM, series) -> int | None:
    for t, x in enumerate(series):
        detector.update(x)
        if detector.alarm:
            return t
    return None


def student_t3(rng: random.Random) -> float:
    return rng.gauss(0, 1) / math.sqrt(sum(rng.gauss(0, 1) ** 2 for _ in range(3)) / 3)


# -- the detector ------------------------------------------------------------------------------------

def test_score_by_hand_on_a_tiny_series():
    """K = 4: median 2.5, MAD 1, s = 1.4826; then S_t = max(0, S_{t-1} + clip(z_t, ±c) - k)."""
    up = CUSUM("up", warmup_steps=4, drift=0.5, threshold=2.0, clip=4.0)
    assert [up.update(x) for x in (1, 3, 2, 4)] == [0, 0, 0, 0]  # warm-up: no score
    assert (up.median, up.scale) == (2.5, 1.4826)
    s1 = up.update(5.5)
    assert s1 == pytest.approx(3 / 1.4826 - 0.5)  # z = 2.0235
    assert up.alarm is False  # 1.52 <= 2
    s2 = up.update(2.5)  # z = 0: the drift alone comes off
    assert s2 == pytest.approx(s1 - 0.5)
    s3 = up.update(100.0)
    assert s3 == pytest.approx(s2 + 4.0 - 0.5)  # z = 65, clipped at c = 4
    assert up.alarm is True
    assert up.update(float("nan")) == s3  # a skipped step's NaN leaves the score
    assert up.update(-100.0) == pytest.approx(s3 - 4.0 - 0.5)  # clipped at -c too
    assert up.update(-100.0) == 0.0  # floored at 0
    down = CUSUM("down", warmup_steps=4, drift=0.5, threshold=2.0, clip=4.0)
    for x in (1, 3, 2, 4):
        down.update(x)
    assert down.update(5.5) == 0.0 and down.update(-0.5) == pytest.approx(3 / 1.4826 - 0.5)  # mirrored


def test_a_step_change_is_detected_within_a_few_steps():
    """Noise of sd 1, a shift of 3 sd 20 steps after the warm-up, 100 seeds x both directions: never an
    alarm before the shift, every shift caught within 30 steps, 85% within 10 (each step adds about
    3 - k = 2, so h = 12 falls in about 6; a baseline whose MAD came out large takes longer)."""
    delays = []
    for seed in range(100):
        rng = random.Random(seed)
        noise = [rng.gauss(0, 1) for _ in range(100)]
        for direction, shift in (("up", 3.0), ("down", -3.0)):
            series = [x + (shift if t >= 50 else 0.0) for t, x in enumerate(noise)]
            alarm = first_alarm(CUSUM(direction, **SETTLED), series)
            assert alarm is not None and 50 <= alarm < 80, (seed, direction, alarm)
            delays.append(alarm - 50)
    assert sorted(delays)[len(delays) // 2] <= 7 and sum(d < 10 for d in delays) >= 0.85 * len(delays), delays


def test_a_stationary_noisy_series_raises_no_alarm():
    """200 steps of stationary noise (Gaussian, and heavy-tailed Student t with 3 degrees of freedom,
    whose spikes the clip absorbs), 20 seeds, both directions: no alarm."""
    for seed in range(20):
        rng = random.Random(seed)
        gauss = [rng.gauss(5, 0.3) for _ in range(200)]
        heavy = [student_t3(rng) for _ in range(200)]
        for series in (gauss, heavy):
            for direction in ("up", "down"):
                assert first_alarm(CUSUM(direction, **SETTLED), series) is None, (seed, direction)


def test_the_default_short_warm_up_costs_a_few_false_alarms():
    """At the defaults (a 10-step baseline) the baseline's own error can start a false alarm: over 60
    stationary steps after the warm-up, 400 series, measured 3.25% per signal; allowed below 6%."""
    alarms = 0
    for seed in range(200):
        rng = random.Random(seed)
        for direction in ("up", "down"):
            alarms += first_alarm(CUSUM(direction, **DETECTOR), [rng.gauss(0, 1) for _ in range(70)]) is not None
    assert alarms / 400 < 0.06, alarms


def test_a_slow_drift_is_detected():
    """A trend of 0.1 sd per step (no single step stands out) is still caught."""
    rng = random.Random(0)
    series = [rng.gauss(0, 1) + (0.1 * (t - 30) if t > 30 else 0.0) for t in range(200)]
    alarm = first_alarm(CUSUM("up", **SETTLED), series)
    assert alarm is not None and alarm < 100, alarm


# -- the monitor ---------------------------------------------------------------------------------------

def monitor(**values) -> Monitor:
    return Monitor(**{**SIGNALS, **DETECTOR, "action": "none", "switch_to": "seq_mis", **values})


@pytest.mark.parametrize("values,message", [
    ({"action": "halt"}, "train.monitor.action: 'halt' (allowed: none, stop, switch_correction)"),
    ({"switch_to": "tsi"}, "train.monitor.switch_to: 'tsi' (allowed: "),
    ({"falling": ["mismatch/kl_k3"]}, "train.monitor: 'mismatch/kl_k3' is both rising and falling"),
    ({"rising": [], "falling": []}, "train.monitor.rising, falling: both empty"),
    ({"warmup_steps": 1}, "train.monitor.warmup_steps: 1 (allowed: >= 2)"),
    ({"threshold": 0.0}, "train.monitor.threshold: 0.0 (allowed: > 0)"),
    ({"drift": float("nan")}, "train.monitor.drift: nan (allowed: >= 0)"),
    ({"clip": 0.5}, "train.monitor.clip: 0.5 (allowed: > drift)"),
    ({"rising": ["rollout/ratio_mean", "correction/ratio_mean"]}, "train.monitor: two signals share a score name"),
])
def test_bad_values_fail_in_one_line(values, message):
    with pytest.raises(ConfigError) as err:
        monitor(**values)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_an_unknown_signal_fails_at_the_first_step_naming_what_is_logged():
    m = monitor(rising=["mismatch/kl_k4"])
    with pytest.raises(ConfigError, match=r"train.monitor: 'mismatch/kl_k4' is not a metric the step logs \(allowed: .*mismatch/kl_k3"):
        m.observe({"mismatch/kl_k3": 1.0, "perf/train_seconds": 1.0}, step=1)


def steps(m: Monitor, rows, components=None) -> list[dict]:
    return [m.observe(row, step, components) for step, row in enumerate(rows, start=1)]


def test_alarm_is_logged_once_with_signal_step_and_score(caplog):
    m = monitor()
    rows = [{"mismatch/kl_k3": 1e-4 * (1 + 0.1 * (i % 3)), "rollout/reward_mean": 0.6} for i in range(10)]
    rows += [{"mismatch/kl_k3": 1e-2, "rollout/reward_mean": 0.6}] * 7  # the KL jumps at step 11
    with caplog.at_level("WARNING", logger="rlmm.run.monitor"):
        out = steps(m, rows)
    assert set(out[0]) == {"monitor/kl_k3_score", "monitor/reward_mean_score", "monitor/alarm"}
    # z clipped at 4, so 4 - 1 = 3 a step: 12 at step 14 (not above h), 15 at step 15
    assert [o["monitor/kl_k3_score"] for o in out[10:]] == [3.0, 6.0, 9.0, 12.0, 15.0, 18.0, 21.0]
    assert [o["monitor/alarm"] for o in out] == [0.0] * 14 + [1.0] * 3
    assert [(a.signal, a.step) for a in m.alarms] == [("mismatch/kl_k3", 15)]
    assert all(o["monitor/reward_mean_score"] == 0 for o in out)  # z = 0 (MAD 0: the floor scale) minus k
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == ["monitor alarm: mismatch/kl_k3 score 15 > 12 at step 15 (train.monitor.action=none)"]
    assert m.stop_requested is False


def test_stop_and_switch_act_on_the_first_alarm_only():
    rows = [{"mismatch/kl_k3": 1.0 + 0.01 * (i % 2), "rollout/reward_mean": 0.5 + 0.01 * (i % 2)} for i in range(10)]
    rows += [{"mismatch/kl_k3": 9.0, "rollout/reward_mean": 0.0}] * 8  # alarms at step 15
    stop = monitor(action="stop")
    steps(stop, rows[:14])
    assert not stop.stop_requested
    steps(stop, rows[14:])
    assert stop.stop_requested and "(train.monitor.action=stop); checkpoint in CKPT" in stop.stop_message("CKPT")

    class Holder:
        correction = "before"

    holder = Holder()
    switch = monitor(action="switch_correction", switch_to="tis")
    steps(switch, rows[:15], holder)
    from rlmm.corrections.tis import TokenTIS

    assert isinstance(holder.correction, TokenTIS) and holder.correction.cap == 2.0  # conf/correction/tis.yaml
    holder.correction = "kept"
    steps(switch, rows[15:], holder)  # later alarms switch nothing again
    assert holder.correction == "kept" and not switch.stop_requested


@pytest.mark.parametrize("action,switched", [("none", False), ("stop", False), ("switch_correction", True)])
def test_a_resumed_run_takes_again_only_the_action_that_lasts(action, switched):
    """`Action.on_resume`: a monitor restored from a checkpoint written after its alarm switches the correction
    again (the components are rebuilt from the config) but does not stop the resumed run."""
    rows = [{"mismatch/kl_k3": 1.0 + 0.01 * (i % 2), "rollout/reward_mean": 0.5 + 0.01 * (i % 2)} for i in range(10)]
    rows += [{"mismatch/kl_k3": 9.0, "rollout/reward_mean": 0.0}] * 6  # alarm at step 15

    class Holder:
        correction = "before"

    interrupted = monitor(action=action, switch_to="tis")
    steps(interrupted, rows, Holder())
    assert interrupted.alarms
    holder, resumed = Holder(), monitor(action=action, switch_to="tis")
    resumed.load_state_dict(interrupted.state_dict(), holder)
    assert (holder.correction != "before") is switched and resumed.stop_requested is False
    assert resumed.alarms == interrupted.alarms


def test_off_is_a_no_op_but_its_values_are_still_checked():
    from omegaconf import OmegaConf

    node = OmegaConf.create({"enabled": False, **SIGNALS, **DETECTOR, "action": "none", "switch_to": "tis"})
    off = build_monitor(node)
    assert isinstance(off, NoMonitor) and off.observe({"mismatch/kl_k3": 1.0}, 1) == {} and not off.stop_requested
    node.action = "explode"
    with pytest.raises(ConfigError, match="train.monitor.action: 'explode'"):
        build_monitor(node)


# -- the loop's hooks, in real runs --------------------------------------------------------------------

# An alarm that must fire at step 3: a 2-step warm-up, no drift, a threshold of (almost) 0, and two signals
# that move together (ppl_ratio = exp(kl_k1)) watched in opposite directions: whichever way the third
# step's value goes, one of the two scores is > 0.
MUST_FIRE = ["train.monitor.enabled=true", "train.monitor.rising=[mismatch/kl_k1]",
             "train.monitor.falling=[mismatch/ppl_ratio]",
             "train.monitor.warmup_steps=2", "train.monitor.drift=0", "train.monitor.threshold=1e-12"]


def train(model_path, run_dir, *overrides):
    command = [sys.executable, "-m", "rlmm.cli", "train", "model=hf", f"model.path={model_path}", "precision=fp32",
               "sampler=hf", "trainer=torch", "logger=none", "train.prompts_per_step=2", "algo.group_size=4",
               "train.eval_every=1", "train.eval_prompts=4", "train.eval_trained_weights=false",
               "train.checkpoint_every=0", f"hydra.run.dir={run_dir}", *overrides]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=subprocess_env(),
                            stdin=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    return result, rows


def without(rows, *prefixes):
    return [{k: v for k, v in row.items() if not k.startswith(prefixes)} for row in rows]


def test_monitor_off_leaves_the_run_unchanged_and_stop_checkpoints_and_stops(small_model_path, tmp_path):
    """The same 3-step fp32 run without the monitor and with it set to fire at step 3 and stop: every
    number but monitor/* and wall-clock timings is the same; the stopped run logged its scores, the alarm
    and its record entry, wrote a checkpoint of step 3 and ended with one `rlmm: stopped: monitor alarm`
    line (exit 3)."""
    off, off_rows = train(small_model_path, tmp_path / "off", "train.steps=3")
    assert off.returncode == 0, off.stderr[-3000:]
    assert not any(k.startswith("monitor/") for row in off_rows for k in row)
    on, on_rows = train(small_model_path, tmp_path / "stop", "train.steps=3", *MUST_FIRE, "train.monitor.action=stop")
    assert on.returncode == 3, on.stderr[-3000:]
    assert without(on_rows, "monitor/", "perf/") == without(off_rows, "perf/")
    assert [r.get("monitor/alarm") for r in on_rows] == [None, 0.0, 0.0, 1.0]  # step 0 is the evaluation
    assert {"monitor/kl_k1_score", "monitor/ppl_ratio_score"} <= set(on_rows[3])
    assert on_rows[3]["monitor/alarms"][0]["signal"] in ("mismatch/kl_k1", "mismatch/ppl_ratio")
    stopped = ending(on)
    assert stopped.startswith("rlmm: stopped: monitor alarm: mismatch/") and "at step 3" in stopped, stopped
    assert "(train.monitor.action=stop); checkpoint in" in stopped
    assert (tmp_path / "stop" / "checkpoints" / "step-000003" / "state.json").exists()
    assert "monitor alarm: mismatch/" in on.stdout  # the warning line too, logged


def test_switch_correction_trains_with_the_new_correction_from_the_next_step(small_model_path, tmp_path):
    """correction=none, switched to tis by the alarm at step 3: TIS's own metric appears from step 4 on."""
    result, rows = train(small_model_path, tmp_path / "switch", "train.steps=4", "correction=none", *MUST_FIRE,
                         "train.monitor.action=switch_correction", "train.monitor.switch_to=tis")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r.get("monitor/alarm") for r in rows] == [None, 0.0, 0.0, 1.0, 1.0]
    assert ["correction/frac_tokens_truncated" in r for r in rows[1:]] == [False, False, False, True]
    assert "monitor: correction switched to tis from step 4 on" in result.stdout + result.stderr


def test_a_resumed_run_keeps_the_detectors_and_the_switched_correction(small_model_path, tmp_path):
    """A 5-step run switched to tis at step 3 writes a checkpoint there; run again in its directory it
    resumes at step 4 and logs steps 4 and 5 exactly as the first time: the detectors' scores go on from
    their baselines (not a new warm-up) and TIS is still the correction."""
    run_dir = tmp_path / "run"
    switch = ("train.steps=5", "correction=none", *MUST_FIRE, "train.monitor.action=switch_correction",
              "train.monitor.switch_to=tis", "train.checkpoint_every=3")
    first, first_rows = train(small_model_path, run_dir, *switch)
    assert first.returncode == 0, first.stderr[-3000:]
    loop = json.loads((run_dir / "checkpoints" / "step-000003" / "state.json").read_text())["loop"]
    assert loop["monitor"]["alarms"][0]["step"] == 3 and loop["bad_steps"] == 0
    # Finished, the run is left alone (tests/test_run_dir.py); without its summary, as one killed after its last
    # row, it resumes from the newest checkpoint
    (run_dir / "summary.json").unlink()
    again, again_rows = train(small_model_path, run_dir, *switch)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stdout + again.stderr
    assert [r["step"] for r in again_rows] == [0, 1, 2, 3, 4, 5]
    assert without(again_rows, "perf/") == without(first_rows, "perf/")
    assert all("correction/frac_tokens_truncated" in r for r in again_rows[4:])
    assert again_rows[5]["monitor/alarm"] == 1.0
