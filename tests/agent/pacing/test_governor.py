"""The governor on the simulated plant (hours of simulated time in well under a second each),
its state machine, and its hook inside a real hpc_core.Trainer."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agent.pacing.controller import AppLatency, Decision, GovernorEvent, GovernorState, PIController
from agent.pacing.governor import Governor, GovernorConfig
from agent.pacing.hook import GovernorHook, ThreadYield
from agent.sensors.reading import Reading
from agent.sensors.sim import SimBackend
from agent.sim.app import ContendedApp
from agent.sim.baselines import BangBangGovernor
from agent.sim.job import simulate_job
from agent.sim.plant import SimClock, SimPlant
from device_profiles import load_profile

NANO = load_profile("jetson-orin-nano-8gb")
TARGET = NANO.thermal.throttle_target_c  # 85 C


# ---------------------------------------------------------------------------------------------
# The acceptance scenario: Orin Nano 8GB in a sealed 35 C enclosure, 30 minutes.


def test_governor_holds_target_at_near_optimal_throughput() -> None:
    r = simulate_job(NANO, control="governor", duration_s=1800, ambient_c=35.0, noise_c=0.2)
    assert r.duration_s >= 1800
    assert r.max_temp_c <= TARGET + 1.0, f"peak {r.max_temp_c:.2f} C"
    # Best constant duty under the target, from the plant's steady state (analytic).
    d_star = r.best_constant_duty()
    assert d_star == pytest.approx(((TARGET - 35.0) / 4.8 - 4.0) / (14.0 - 4.0))
    assert r.steps_per_s >= 0.9 * d_star / r.params.step_time_s
    # and it never leans on the board's own throttle
    assert r.board_throttled_s == 0.0
    assert r.stop_reason is None and not r.shutdown


def test_without_a_governor_the_board_hits_its_own_throttle() -> None:
    r = simulate_job(NANO, control="none", duration_s=1800, ambient_c=35.0)
    assert r.max_temp_c >= NANO.thermal.board_throttle_c
    assert r.board_throttled_s > 0
    assert r.time_above_target_s > 600  # most of the second half


def test_robust_to_a_wrong_plant_estimate_and_hotter_air() -> None:
    """Gains come from the profile, but the real enclosure is worse: 25% more thermal
    resistance, half the heat capacity and 40 C air."""
    plant_cfg = NANO.plant.model_copy(update={"thermal_resistance_c_per_w": 6.0,
                                              "heat_capacity_j_per_c": 50.0})
    real = NANO.model_copy(update={"plant": plant_cfg})
    r = simulate_job(real, control="governor", ambient_c=40.0,
                     governor_cfg=GovernorConfig.from_profile(NANO))
    assert r.max_temp_c <= TARGET + 1.0
    assert r.relative_throughput() >= 0.9


def test_follows_an_ambient_step() -> None:
    """The enclosure warms from 30 to 40 C mid-job (sun on the box): the target still holds."""
    plant = SimPlant(NANO, ambient_c=30.0)
    sensors = SimBackend(plant, noise_c=0.2, seed=1)
    clock = SimClock(plant)
    hook = GovernorHook(Governor(GovernorConfig.from_profile(NANO)), sensors, clock=clock)
    trainer = _RecordingTrainer()
    duties_before = []
    while plant.time_s < 3600:
        if plant.time_s > 1800 and plant.params.ambient_c == 30.0:
            plant.set_ambient(40.0)
        plant.run_step()
        hook.on_step_end(trainer, hook.record.steps + 1, {})
        if 1500 < plant.time_s < 1800:
            duties_before.append(hook.last.duty)
    assert plant.max_temp_c <= TARGET + 1.0
    # After the step the duty settles lower, near the new optimum.
    d_new = plant.params.best_constant_duty(TARGET)
    assert hook.last.duty == pytest.approx(d_new, abs=0.06)
    assert sum(duties_before) / len(duties_before) > d_new + 0.1


def test_power_cap_limits_average_power() -> None:
    cfg = GovernorConfig.from_profile(NANO, power_cap_mw=9000.0)
    plant = SimPlant(NANO, ambient_c=25.0)  # cool air: only the cap binds
    sensors, clock = SimBackend(plant, noise_c=0.2), SimClock(plant)
    gov = Governor(cfg)
    hook = GovernorHook(gov, sensors, clock=clock)
    trainer = _RecordingTrainer()
    while plant.time_s < 600:
        plant.run_step()
        hook.on_step_end(trainer, hook.record.steps + 1, {})
    e0, t0 = plant.energy_j, plant.time_s
    while plant.time_s < 1200:
        plant.run_step()
        hook.on_step_end(trainer, hook.record.steps + 1, {})
    avg_w = (plant.energy_j - e0) / (plant.time_s - t0)
    assert 8.5 <= avg_w <= 9.0 * 1.02
    assert gov.limit == "power" and gov.state == GovernorState.THROTTLED
    assert any("over cap 9.0 W" in e.reason for e in gov.events)


# ---------------------------------------------------------------------------------------------
# States and events


class _RecordingTrainer:
    def __init__(self) -> None:
        self.stops: list[str] = []
        self.saves = 0

    def request_stop(self, reason: str) -> None:
        self.stops.append(reason)

    def save(self) -> None:
        self.saves += 1


def test_pause_checkpoints_waits_and_resumes() -> None:
    """A board already at 96 C (over the 95 C soft limit): checkpoint, wait, resume below 88."""
    plant = SimPlant(NANO, ambient_c=35.0, initial_c=96.0)
    sensors, clock = SimBackend(plant, noise_c=0.0), SimClock(plant)
    gov = Governor(GovernorConfig.from_profile(NANO))
    hook = GovernorHook(gov, sensors, clock=clock, poll_s=1.0)
    trainer = _RecordingTrainer()
    plant.run_step()
    hook.on_step_end(trainer, 1, {})
    assert trainer.saves == 1 and not trainer.stops
    assert plant.temp_c < NANO.thermal.resume_below_c  # the hook slept until it cooled
    assert hook.record.waited_s > 60
    kinds = [(e.old, e.new) for e in gov.events]
    assert kinds[:2] == [("NORMAL", "PAUSED"), ("PAUSED", "THROTTLED")]
    assert "soft limit 95.0 C" in gov.events[0].reason
    assert "below resume point 88.0 C" in gov.events[1].reason
    # Resumes gently, then runs on without pausing again.
    for step in range(2, 3000):
        plant.run_step()
        hook.on_step_end(trainer, step, {})
    assert gov.state != GovernorState.PAUSED and trainer.saves == 1
    assert plant.max_temp_c < NANO.thermal.soft_pause_c + 1.5


def test_pause_can_stop_the_trainer_instead() -> None:
    plant = SimPlant(NANO, ambient_c=35.0, initial_c=96.0)
    hook = GovernorHook(Governor(GovernorConfig.from_profile(NANO)), SimBackend(plant),
                        clock=SimClock(plant), on_pause="stop")
    trainer = _RecordingTrainer()
    plant.run_step()
    hook.on_step_end(trainer, 1, {})
    assert len(trainer.stops) == 1 and "soft limit" in trainer.stops[0]
    assert hook.record.waited_s == 0


def test_gives_up_waiting_after_max_wait() -> None:
    # 70 C air: idle settles at 89.2 C, never below the 88 C resume point.
    plant = SimPlant(NANO, ambient_c=70.0, initial_c=96.0)
    hook = GovernorHook(Governor(GovernorConfig.from_profile(NANO)), SimBackend(plant),
                        clock=SimClock(plant), max_wait_s=600)
    trainer = _RecordingTrainer()
    plant.run_step()
    hook.on_step_end(trainer, 1, {})
    assert trainer.stops and "without cooling down" in trainer.stops[0]


class _DeadSensors:
    name = "dead"

    def read(self) -> Reading:
        return Reading(timestamp_s=0.0)

    def close(self) -> None:
        pass


def test_lost_sensors_fall_back_to_a_safe_duty() -> None:
    gov = Governor(GovernorConfig.from_profile(NANO, sensor_timeout_s=30.0, fallback_duty=0.4))
    hot = Reading(timestamp_s=0.0, temps_c={"tj": 60.0}, total_power_mw=14000.0)
    assert gov.update(hot, 0.0).duty == 1.0
    assert gov.update(_DeadSensors().read(), 10.0).duty == 1.0  # brief gap: hold
    d = gov.update(_DeadSensors().read(), 45.0)
    assert d.duty == 0.4 and d.limit == "sensor" and d.state == GovernorState.THROTTLED
    assert [e.kind for e in gov.events].count("sensor") == 1
    gov.update(hot, 50.0)
    assert (gov.events[-1].kind, gov.events[-1].new) == ("sensor", "ok")
    assert gov.state == GovernorState.THROTTLED  # full speed again, NORMAL after the dwell
    gov.update(hot, 61.0)
    assert gov.state == GovernorState.NORMAL


def test_a_machine_without_thermal_sensors_is_not_slowed_down() -> None:
    gov = Governor(GovernorConfig.from_profile(NANO, sensor_timeout_s=30.0))
    for t in range(0, 120, 5):
        d = gov.update(_DeadSensors().read(), float(t))
        assert d.duty == 1.0 and d.state == GovernorState.NORMAL
    assert [(e.kind, e.reason) for e in gov.events] == [
        ("sensor", "no temperature sensor on this machine: thermal pacing off")]
    # A power cap still binds on power readings alone.
    capped = Governor(GovernorConfig.from_profile(NANO, power_cap_mw=9000.0))
    capped.update(Reading(0.0, total_power_mw=4000.0), 0.0, "idle")
    assert capped.update(Reading(1.0, total_power_mw=14000.0), 1.0).duty == pytest.approx(0.5)


def test_pi_anti_windup() -> None:
    """Hours at full speed on a cool board leave nothing to unwind: the first error of the
    other sign pulls the output below the limit at once."""
    pi = PIController(kp=0.2, ti_s=240.0, lo=0.05, hi=1.0)
    for _ in range(36000):
        assert pi.update(error=20.0, dt_s=1.0) == 1.0
    assert pi.integral <= 1.0
    assert pi.update(error=-1.0, dt_s=1.0) < 1.0
    # Without the clamp the integral would hold 36000 * 0.2 * 20 / 240 = 600 duty-units.


def test_events_are_few_and_explained() -> None:
    r = simulate_job(NANO, control="governor", noise_c=0.5, seed=7)
    assert 1 <= len(r.events) <= 4, r.events  # NORMAL -> THROTTLED once; noise does not chatter
    assert all(isinstance(e, GovernorEvent) and e.reason for e in r.events)


def test_mode_switch_moves_to_a_more_efficient_mode() -> None:
    fixed = simulate_job(NANO, control="governor", mode="MAXN_SUPER")
    switching = simulate_job(NANO, control="governor", mode="MAXN_SUPER", allow_mode_switch=True)
    switches = [e for e in switching.events if e.kind == "power_mode"]
    assert switches and switches[0].old == "MAXN_SUPER" and switches[0].new != "MAXN_SUPER"
    assert "sustainable" in switches[0].reason
    assert switching.max_temp_c <= TARGET + 1.0
    assert switching.steps_per_s > 1.1 * fixed.steps_per_s


def test_mode_switch_needs_permission_and_a_switcher() -> None:
    cfg = GovernorConfig.from_profile(NANO, allow_mode_switch=True)
    with pytest.raises(ValueError, match="needs the device profile and a mode switcher"):
        Governor(cfg)


def test_bangbang_baseline() -> None:
    r = simulate_job(NANO, control="bangbang", bangbang_hysteresis_c=2.0)
    assert TARGET - 0.5 < r.max_temp_c < TARGET + 1.0
    assert len(r.events) > 10  # it cycles all the time
    gov = BangBangGovernor(80.0, 2.0)
    assert gov.update(Reading(0.0, temps_c={"tj": 80.1}), 0.0).duty == 0.0
    assert gov.update(Reading(1.0, temps_c={"tj": 79.0}), 1.0).duty == 0.0
    assert gov.update(Reading(2.0, temps_c={"tj": 77.9}), 2.0).duty == 1.0


def test_config_rejects_inconsistent_limits() -> None:
    with pytest.raises(ValueError, match="resume_below_c"):
        GovernorConfig.from_profile(NANO, resume_below_c=96.0)
    with pytest.raises(ValueError, match="extra"):
        GovernorConfig.from_profile(NANO, target=80)


# ---------------------------------------------------------------------------------------------
# The hook inside the real training loop


class _OffsetClock:
    """Real time plus the time we pretend to have slept: pauses are recorded, not waited."""

    def __init__(self) -> None:
        self.slept: list[float] = []

    def now(self) -> float:
        return time.monotonic() + sum(self.slept)

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


class _HalfDuty:
    def __init__(self) -> None:
        self.state = GovernorState.THROTTLED
        self.events: list[GovernorEvent] = []
        self.target_c = 85.0

    def update(self, reading: Reading, now_s: float, phase: str = "active",
               latency: AppLatency | None = None) -> Decision:
        return Decision(0.5, self.state, "thermal", "tj", 84.0, 9000.0)


class _FixedSensors:
    name = "fixed"

    def __init__(self, temp_c: float) -> None:
        self.temp_c = temp_c

    def read(self) -> Reading:
        return Reading(time.time(), temps_c={"tj": self.temp_c}, total_power_mw=9000.0)

    def close(self) -> None:
        pass


def _trainer(tmp_path: Path, hooks: list, steps: int):
    from hpc_core.config import config_from_dict
    from hpc_core.trainer import Trainer

    cfg = config_from_dict({
        "run": {"name": "paced", "output_dir": str(tmp_path / "run"), "seed": 0},
        "data": {"source": "digits"},
        "model": {"name": "mlp", "kwargs": {"hidden": [32]}},
        "training": {"global_batch_size": 32, "max_steps": steps, "device": "cpu"},
        "checkpoint": {"best_metric": None, "save_final": False},
        "logging": {"progress": "off", "log_every_steps": 1},
    })
    return Trainer(cfg, hooks=hooks)


def test_hook_paces_a_real_trainer(tmp_path: Path) -> None:
    clock = _OffsetClock()
    hook = GovernorHook(_HalfDuty(), _FixedSensors(84.0), clock=clock, idle_read_min_s=1e9,
                        record_every_s=0.0)
    result = _trainer(tmp_path, [hook], steps=8).train()
    assert result.final_step == 8 and hook.record.steps == 8
    # Duty 0.5: after every step but the first (no step time yet) a pause as long as the step.
    assert len(clock.slept) == 7 and all(s > 0 for s in clock.slept)
    assert hook.record.paced_s == pytest.approx(sum(clock.slept))
    assert hook.record.compute_s > 0
    assert [m["step"] for m in hook.record.metrics] == list(range(1, 9))
    assert all("train/loss" in m for m in hook.record.metrics)


def test_hook_stops_a_real_trainer_at_the_soft_limit(tmp_path: Path) -> None:
    gov = Governor(GovernorConfig.from_profile(NANO))
    hook = GovernorHook(gov, _FixedSensors(96.0), clock=_OffsetClock(), on_pause="stop")
    trainer = _trainer(tmp_path, [hook], steps=50)
    result = trainer.train()
    assert result.final_step == 1
    assert result.stopped_reason.startswith("requested: governor paused")
    assert result.checkpoint_dir is not None and result.checkpoint_dir.exists()


# ---------------------------------------------------------------------------------------------
# Training yields to the application's latency (a second measured variable beside temperature)


def _co_run(app: ContendedApp, *, seconds: float, yield_to_app: bool, ambient_c: float = 20.0,
            threads: ThreadYield | None = None,
            ) -> tuple[GovernorHook, list[tuple[float, float, float]]]:
    """Train next to ``app`` for ``seconds`` of simulated time; returns the hook and the
    (time, app p99, duty) trace. With ``threads``: a step on its reduced thread count takes
    a fifth of the application's cores."""
    plant = SimPlant(NANO, ambient_c=ambient_c)
    hook = GovernorHook(Governor(GovernorConfig.from_profile(NANO)), SimBackend(plant),
                        clock=SimClock(plant),
                        latency=(lambda: app.report(plant.time_s)) if yield_to_app else None,
                        threads=threads)
    trainer = _RecordingTrainer()
    trace = []
    while plant.time_s < seconds:
        contention = 0.2 if threads is not None and threads.reduced else 1.0
        app.trained(plant.time_s + plant.params.step_time_s, plant.params.step_time_s,
                    contention)
        plant.run_step()
        hook.on_step_end(trainer, hook.record.steps + 1, {})
        assert hook.last is not None
        trace.append((plant.time_s, app.p99_ms(plant.time_s), hook.last.duty))
    return hook, trace


def test_training_yields_to_the_applications_p99_slo() -> None:
    # 10 ms alone, 30 ms next to training at full duty; the objective is 20 ms.
    app = ContendedApp(base_p99_ms=10.0, slowdown=2.0, slo_ms=20.0)
    hook, trace = _co_run(app, seconds=600, yield_to_app=True)
    settled = [(p99, duty) for t, p99, duty in trace if t > 120]
    assert max(p99 for p99, _ in settled) <= 20.0, "p99 over the SLO after settling"
    mean_duty = sum(d for _, d in settled) / len(settled)
    # The setpoint is 18 ms (10% under the SLO): duty (18 / 10 - 1) / 2 = 0.4.
    assert mean_duty == pytest.approx(0.4, abs=0.08)
    gov = hook.controller
    assert isinstance(gov, Governor) and gov.limit == "latency"
    assert gov.state == GovernorState.THROTTLED
    assert any("application p99" in e.reason for e in gov.events)
    assert hook.record.yielded_s > 0.5 * 600 * (1 - mean_duty)
    # Full speed until the first windows report contention: the start overshoots.
    assert hook.record.worst_p99_ms is not None and hook.record.worst_p99_ms > 20.0

    # The same job without yielding breaks the SLO for as long as it runs.
    app_off = ContendedApp(base_p99_ms=10.0, slowdown=2.0, slo_ms=20.0)
    _, trace_off = _co_run(app_off, seconds=600, yield_to_app=False)
    assert min(p99 for t, p99, _ in trace_off if t > 120) > 25.0
    assert all(duty == 1.0 for t, _, duty in trace_off if t > 120)  # cool air: full speed


def test_training_gives_up_cores_before_time_and_takes_them_back_when_nobody_serves() -> None:
    """The same application and SLO as above, with a trainer that can run on fewer threads:
    it hands the application its cores first, so the SLO holds at a far higher duty, and it
    takes them back once nobody has reported for the hold time."""
    app = ContendedApp(base_p99_ms=10.0, slowdown=2.0, slo_ms=20.0)
    app.stops_serving_s = 600.0
    calls: list[int] = []
    threads = ThreadYield(calls.append, full=6, give=5, hold_s=30.0)
    hook, trace = _co_run(app, seconds=800, yield_to_app=True, threads=threads)
    settled = [(p99, duty) for t, p99, duty in trace if 120 < t < 600]
    assert max(p99 for p99, _ in settled) <= 20.0, "p99 over the SLO after settling"
    # Without the threads the duty settles at 0.4 (the test above); with them at full speed.
    assert sum(d for _, d in settled) / len(settled) > 0.9
    assert calls[0] == 1 and calls[-1] == 6  # one thread while constrained, all six after
    assert not threads.reduced
    # A steady application needs its cores: the hold doubles each time they were handed back
    # too soon (30, 60, 120, 240 s...), so a handful of switches, not one every window.
    assert len(calls) <= 10, calls
    assert 0 < hook.record.fewer_threads_s < 600
    # No threads to give: a one-thread trainer is never asked to change.
    single: list[int] = []
    _co_run(ContendedApp(base_p99_ms=10.0, slowdown=2.0, slo_ms=20.0), seconds=200,
            yield_to_app=True, threads=ThreadYield(single.append, full=1))
    assert single == []


def test_training_pauses_while_the_app_is_over_its_slo_at_any_duty_and_resumes() -> None:
    app = ContendedApp(base_p99_ms=10.0, slowdown=2.0, slo_ms=20.0)
    # From 200 s to 400 s the application's own burst (+15 ms) breaks the SLO at any training
    # duty; at 600 s the application stops serving (no reports).
    app.burst(200.0, 400.0, 15.0)
    app.stops_serving_s = 600.0
    hook, trace = _co_run(app, seconds=800, yield_to_app=True)
    gov = hook.controller
    assert isinstance(gov, Governor)
    assert any("training yields" in e.reason for e in gov.events)
    assert hook.record.waited_s > 100  # yielded completely for most of the burst
    steps_in_burst = [t for t, _, _ in trace if 260 < t < 400]
    assert len(steps_in_burst) < 0.05 * 140 / NANO.plant.step_time_s
    after = [(p99, d) for t, p99, d in trace if 480 < t < 600]
    assert after and max(p99 for p99, _ in after) <= 20.0 and min(d for _, d in after) > 0
    assert all(d == 1.0 for t, _, d in trace if t > 640)  # nobody serving: full speed
    assert gov.state == GovernorState.NORMAL
    # The record shows the application's p99 while it reports, and none after it stopped.
    served = [x["app_p99_ms"] for x in hook.record.samples if 480 < x["t_s"] < 600]
    assert served and all(p is not None for p in served)
    assert all(x["app_p99_ms"] is None for x in hook.record.samples if x["t_s"] > 640)


def test_the_hotter_limit_wins_over_latency_and_the_other_way_round() -> None:
    # A hot enclosure: the thermal loop asks for less than the latency loop would allow.
    app = ContendedApp(base_p99_ms=10.0, slowdown=0.5, slo_ms=20.0)  # 15 ms at full duty
    hook, _ = _co_run(app, seconds=1800, yield_to_app=True, ambient_c=40.0)
    gov = hook.controller
    assert isinstance(gov, Governor) and gov.limit == "thermal"
    assert hook.record.yielded_s == 0.0
    # An application well inside its SLO is never named the limit, not even while the duty
    # climbs back after a thermal dip.
    assert not [x for x in hook.record.samples if x["limit"] == "latency"]


def test_after_a_thermal_dip_an_app_inside_its_slo_does_not_hold_the_duty_down() -> None:
    # Hot for a minute (the thermal loop cuts the duty), then cool: the duty climbs back at
    # the thermal loop's pace. The application (5 ms, SLO 20 ms) never asked for less, so
    # the latency loop must not have been dragged down with the thermal one and then name
    # itself the limit while it ramps back.
    gov = Governor(GovernorConfig.from_profile(NANO))
    app = AppLatency(5.0, 20.0)
    t = 0.0
    for _ in range(200):
        t += 0.3
        gov.update(Reading(t, temps_c={"tj": TARGET + 3.0}), t, "active", app)
    assert gov.duty < 0.5 and gov.limit == "thermal"
    limits = []
    for _ in range(400):
        t += 0.3
        d = gov.update(Reading(t, temps_c={"tj": TARGET - 30.0}), t, "active", app)
        limits.append(d.limit)
    assert "latency" not in limits, limits
    assert gov.duty == 1.0
