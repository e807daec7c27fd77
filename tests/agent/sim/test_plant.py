"""The simulated plant against its own closed-form physics."""

from __future__ import annotations

import math

import pytest

from agent.sensors.sim import SimBackend
from agent.sim.plant import BoardShutdown, SimClock, SimPlant, plant_params
from device_profiles import load_profile

NANO = load_profile("jetson-orin-nano-8gb")


def test_starts_at_idle_steady_state() -> None:
    plant = SimPlant(NANO, ambient_c=35.0)
    assert plant.temp_c == pytest.approx(35.0 + 4.8 * 4.0)


def test_first_order_step_response() -> None:
    """From idle, full load for one time constant covers 1 - 1/e of the way."""
    plant = SimPlant(NANO, ambient_c=30.0)  # steady state 97.2 C: never reaches the throttle
    p = plant.params
    t0, t_ss = plant.temp_c, p.steady_state_c(1.0)
    plant.advance(p.tau_s, 1.0)
    assert plant.temp_c == pytest.approx(t_ss - (t_ss - t0) / math.e, abs=1e-6)
    assert not plant.throttled and plant.throttled_s == 0


def test_duty_cycle_settles_at_the_analytic_steady_state() -> None:
    plant = SimPlant(NANO, ambient_c=35.0)
    duty = 0.6
    step = plant.params.step_time_s
    pause = step * (1 - duty) / duty
    while plant.time_s < 10 * plant.params.tau_s:
        plant.run_step()
        plant.advance(pause, 0.0)
    # Ripple of a 0.5 s cycle on a 480 s time constant is far below 0.1 C.
    assert plant.temp_c == pytest.approx(plant.params.steady_state_c(duty), abs=0.1)
    assert plant.energy_j / plant.time_s == pytest.approx(plant.params.power_w(duty), rel=1e-3)


def test_best_constant_duty_hits_the_target_exactly() -> None:
    p = plant_params(NANO, ambient_c=35.0)
    d = p.best_constant_duty(85.0)
    assert 0.6 < d < 0.7
    assert p.steady_state_c(d) == pytest.approx(85.0)
    assert p.best_constant_duty(85.0, power_cap_w=8.0) == pytest.approx((8.0 - 4.0) / 10.0)
    assert plant_params(NANO, ambient_c=15.0).best_constant_duty(85.0) == 1.0


def test_board_throttles_at_99_slows_steps_and_releases() -> None:
    plant = SimPlant(NANO, ambient_c=35.0)
    normal_step = plant.params.step_time_s
    while not plant.throttled:
        plant.run_step()
    # Engages at a poll boundary once the trip is crossed: within one second's rise.
    assert 99.0 <= plant.temp_c < 99.1
    assert plant.run_step() == pytest.approx(normal_step / 0.6)
    assert plant.power_w == pytest.approx(4.0 + 10.0 * 0.36)
    while plant.throttled:
        plant.run_step()
    assert plant.temp_c <= 97.0 + 1e-9  # released 2 C below the trip
    assert plant.max_temp_c < 99.2


def test_critical_temperature_shuts_the_board_down() -> None:
    # 75 C air: even throttled (7.6 W) the board settles at 111.5 C, past the 104.5 C trip.
    plant = SimPlant(NANO, ambient_c=75.0, initial_c=100.0)
    with pytest.raises(BoardShutdown):
        plant.advance(3600.0, 1.0)
    assert plant.throttled and plant.temp_c >= 104.5
    assert plant.shutdown
    with pytest.raises(BoardShutdown):
        plant.run_step()


def test_power_modes_change_power_and_speed() -> None:
    plant = SimPlant(NANO, ambient_c=35.0, mode="15W")
    slow = plant.params.step_time_s
    plant.set_mode("MAXN_SUPER")
    assert plant.mode == "MAXN_SUPER"
    assert plant.params.train_w == 25.0
    assert plant.params.step_time_s == pytest.approx(slow * 0.61)


def test_sim_clock_and_backend() -> None:
    plant = SimPlant(NANO, ambient_c=35.0)
    clock = SimClock(plant)
    sensors = SimBackend(plant, noise_c=0.0)
    plant.run_step()
    hot = sensors.read()
    assert hot.total_power_mw == pytest.approx(14000.0)
    assert hot.temps_c["tj"] == pytest.approx(plant.temp_c)
    assert hot.temps_c["cpu"] == pytest.approx(plant.temp_c - 0.6)
    assert hot.power_mode == "15W" and hot.timestamp_s == plant.time_s
    clock.sleep(30.0)
    assert clock.now() == pytest.approx(30.0 + plant.params.step_time_s)
    idle = sensors.read()
    assert idle.total_power_mw == pytest.approx(4000.0)
    assert idle.temps_c["tj"] < hot.temps_c["tj"]


def test_sensor_noise_is_seeded() -> None:
    a = SimBackend(SimPlant(NANO), noise_c=0.5, seed=3)
    b = SimBackend(SimPlant(NANO), noise_c=0.5, seed=3)
    ra, rb = a.read(), b.read()
    assert ra.temps_c == rb.temps_c
    assert ra.temps_c["tj"] != pytest.approx(SimPlant(NANO).temp_c, abs=1e-6)
