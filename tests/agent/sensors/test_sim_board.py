"""``sensors: sim`` with a state dir is one board: the daemon's telemetry, a fine-tune's governor
and ``agentctl sensors --state-dir`` read the same plant, which the job's CPU heats."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.daemon.device import Sensors
from agent.sensors import open_sensors
from agent.sensors import sim as sim_sensors
from agent.sensors.sim import BOARD_FILE, BoardState, SimBoard
from agent.sim.plant import plant_params
from device_profiles import load_profile

SIM = load_profile("sim")
NANO = load_profile("jetson-orin-nano-8gb")

# The fine-tune's side: the governor's backend, opened as agent.finetune.recipe opens it,
# read after every "step" of busy CPU until it used CPU_S (tests share the cores: a CPU
# budget heats the board alike however long it takes); the last reading and its wall time.
JOB = """\
import json, sys, time
from pathlib import Path
from agent.sensors import open_backend
from device_profiles import load_profile
with open_backend("sim", profile=load_profile("sim"), sim_time_scale=float(sys.argv[2]),
                  state_dir=Path(sys.argv[1])) as sensors:
    start = time.process_time()
    while time.process_time() - start < float(sys.argv[3]):
        sum(i * i for i in range(20000))
        r = sensors.read()
    wall = time.time()
print(json.dumps({"tj": r.temps_c["tj"], "wall": wall}), flush=True)
"""

# The daemon's side: its Sensors (telemetry), reading every 0.1 s while the job runs, and once
# more when told to on stdin.
DAEMON = """\
import json, sys, threading, time
from pathlib import Path
from agent.daemon.device import Sensors
sensors = Sensors("sim", state_dir=Path(sys.argv[1]))
first = sensors.read()["temps_c"]["tj"]
done = threading.Event()
def telemetry():
    while not done.wait(0.1):
        sensors.read()
threading.Thread(target=telemetry, daemon=True).start()
print("ready", flush=True)
sys.stdin.readline()
done.set()
tj, wall = sensors.read()["temps_c"]["tj"], time.time()
print(json.dumps({"first": first, "tj": tj, "wall": wall}), flush=True)
"""


def burn(cpu_s: float) -> None:
    """Use ``cpu_s`` of CPU: the heat a board's process puts in, however busy the host is."""
    start = time.process_time()
    while time.process_time() - start < cpu_s:
        sum(i * i for i in range(20000))


def settle(temp_c: float, steady_c: float, seconds: float) -> float:
    """The plant's temperature after ``seconds`` at a constant power (first-order RC)."""
    tau = plant_params(SIM).tau_s
    return steady_c + (temp_c - steady_c) * math.exp(-seconds / tau)


def test_the_daemon_reads_the_board_the_job_heats(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    scale = 200.0
    daemon = subprocess.Popen([sys.executable, "-c", DAEMON, str(tmp_path)], text=True,
                              env=subprocess_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert daemon.stdout is not None and daemon.stdin is not None
        assert daemon.stdout.readline().strip() == "ready"
        job = subprocess.run([sys.executable, "-c", JOB, str(tmp_path), str(scale), "1.0"],
                             capture_output=True, text=True, env=subprocess_env, timeout=60,
                             check=True)
        daemon.stdin.write("\n")
        daemon.stdin.flush()
        seen = json.loads(daemon.stdout.readline())
    finally:
        daemon.kill()
        daemon.wait()
    hot = json.loads(job.stdout)
    p = plant_params(SIM)
    idle_c, full_c = p.steady_state_c(0.0), p.ambient_c + p.r_c_per_w * p.train_w
    assert seen["first"] == pytest.approx(idle_c, abs=0.05)  # a new board idles
    assert hot["tj"] > idle_c + 5  # 1 s of CPU at 200x: the job heated the board
    # Between the job's last reading and the daemon's, the board ran for (wall gap x scale)
    # simulated seconds at some load in 0..1: it can only have cooled or heated that much.
    # A daemon on a board of its own would read the idle temperature.
    gap_s = (seen["wall"] - hot["wall"]) * scale
    assert settle(hot["tj"], idle_c, gap_s) - 0.5 <= seen["tj"]
    assert seen["tj"] <= settle(hot["tj"], full_c, gap_s) + 0.5
    state = BoardState.model_validate_json((tmp_path / BOARD_FILE).read_bytes())
    assert state.time_scale == scale and state.profile == "sim"


def test_agentctl_sensors_reads_a_devices_board(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    board = SimBoard(tmp_path, profile=NANO, time_scale=500.0)
    burn(0.3)
    board.sync(persist=True)
    # The board as written, and when: the command advances it from exactly there. (The wall
    # time taken after sync() returned was later by the file's write and fsync, up to a second
    # on a busy host: 500 simulated seconds, a thermal time constant, the bound set too high.)
    hot = BoardState.model_validate_json((tmp_path / BOARD_FILE).read_bytes())
    hot_c, hot_wall = hot.temp_c, hot.wall_s
    done = subprocess.run(
        [sys.executable, "-m", "agent.cli", "sensors", "--backend", "sim", "--state-dir",
         str(tmp_path), "--count", "1", "--json"],
        capture_output=True, text=True, env=subprocess_env, timeout=60, check=True)
    reading = json.loads(done.stdout)
    state = BoardState.model_validate_json((tmp_path / BOARD_FILE).read_bytes())
    # The device's board as it is: its profile and time scale, heated by this process.
    assert state.profile == NANO.name and state.time_scale == 500.0
    # Heated, then cooling while the command started (seconds at 500x: most of the heat goes
    # on a busy host); never below what idling since the burn would leave.
    params = plant_params(NANO)
    idle_c = params.steady_state_c(0.0)
    gap_s = (time.time() - hot_wall) * 500.0
    least = idle_c + (hot_c - idle_c) * math.exp(-gap_s / params.tau_s)
    assert hot_c > idle_c + 1
    assert least - 0.5 <= reading["temps_c"]["tj"] <= state.max_temp_c
    assert reading["temps_c"]["tj"] > idle_c


def test_a_board_is_its_file(tmp_path: Path) -> None:
    job = open_sensors("sim", profile=SIM, sim_time_scale=1000.0, state_dir=tmp_path)
    daemon = Sensors("sim", state_dir=tmp_path)
    idle = daemon.read()["temps_c"]["tj"]
    burn(0.3)
    written = BoardState.model_validate_json((tmp_path / BOARD_FILE).read_bytes()).wall_s
    before = time.monotonic()
    hot = job.read()
    seen = daemon.read()["temps_c"]["tj"]
    # Within PERSIST_S of the last write both advance the file's state in memory, by the
    # same rule from the same inputs: the same board. At 1000x every wall millisecond between
    # the two reads is a simulated second at some load in 0..1 (a busy host's scheduler can
    # put several there): the daemon reads the job's temperature carried that far, no further
    # -- give or take one clock tick of CPU: the load is the board's CPU ticks since the write
    # over the wall time since it, so a tick that lands between the two reads moves the
    # second one's load by 1 / (ticks a second x that time) over that whole time (a loaded CI
    # host read 0.65 degrees past the carried temperature, 0.15 past the 0.5 margin).
    gap_s = (time.monotonic() - before) * 1000.0
    since_write_s = max(time.time() - written, 1e-3)
    p = plant_params(SIM)
    idle_c, full_c = p.steady_state_c(0.0), p.ambient_c + p.r_c_per_w * p.train_w
    tick_c = (full_c - idle_c) / (sim_sensors._TICKS_PER_S * since_write_s)
    assert min(hot.temps_c["tj"], settle(hot.temps_c["tj"], idle_c, gap_s)) - 0.5 - tick_c \
        <= seen
    assert seen <= max(hot.temps_c["tj"], settle(hot.temps_c["tj"], full_c, gap_s)) + 0.5 \
        + tick_c
    assert hot.temps_c["tj"] > idle + 5 and hot.gpu_load_pct > 0
    # A reader that declares nothing (the daemon) keeps the board's profile and time scale.
    SimBoard(tmp_path)
    state = BoardState.model_validate_json((tmp_path / BOARD_FILE).read_bytes())
    assert state.time_scale == 1000.0 and list(state.processes) == [os.getpid()]
    job.close()
    daemon.close()


def test_idle_cools_and_the_file_is_the_state(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    board = SimBoard(tmp_path, profile=SIM, time_scale=1.0)
    path = tmp_path / BOARD_FILE
    state = BoardState.model_validate_json(path.read_bytes())
    state.temp_c = state.max_temp_c = 90.0
    state.wall_s -= 100.0  # 100 s ago, at 1x
    state.processes = {}  # nothing of this board runs: no load
    path.write_text(state.model_dump_json())
    cooled = board.sync()
    idle_c = plant_params(SIM).steady_state_c(0.0)
    assert cooled.temp_c == pytest.approx(settle(90.0, idle_c, 100.0), abs=0.05)
    assert cooled.time_s == pytest.approx(state.time_s + 100.0, abs=0.05)
    assert cooled.max_temp_c == 90.0
    # Written back (more than PERSIST_S since the last write): the file holds the new state.
    again = BoardState.model_validate_json(path.read_bytes())
    assert again.temp_c == pytest.approx(cooled.temp_c)

    # A board unread for a year advances a bounded time; a clock that stepped back, none.
    again.wall_s -= 365 * 86400
    path.write_text(again.model_dump_json())
    start = time.perf_counter()
    assert board.sync().temp_c == pytest.approx(idle_c, abs=1e-3)
    assert time.perf_counter() - start < 5.0
    before = BoardState.model_validate_json(path.read_bytes())
    monkeypatch.setattr(sim_sensors.time, "time", lambda: before.wall_s - 60.0)
    assert board.sync(persist=True).time_s == before.time_s


def test_a_reused_pid_is_not_the_boards_process(tmp_path: Path) -> None:
    board = SimBoard(tmp_path, profile=SIM)
    path = tmp_path / BOARD_FILE
    state = BoardState.model_validate_json(path.read_bytes())
    me = state.processes[os.getpid()]
    # Same pid, another start time: a process the kernel gave this pid later; and a gone one.
    state.processes = {os.getpid(): me.model_copy(update={"start_ticks": me.start_ticks + 1,
                                                          "cpu_ticks": 0}),
                       2**22 + 7: me}
    state.wall_s -= 10.0
    path.write_text(state.model_dump_json())
    plant = board.sync(persist=True)
    assert plant.last_load == 0.0  # neither counted: this process's own CPU would be > 0
    # Both leave; this process joins again as itself.
    after = BoardState.model_validate_json(path.read_bytes())
    assert list(after.processes) == [os.getpid()]
    assert after.processes[os.getpid()].start_ticks == me.start_ticks


def test_without_a_state_dir_a_board_of_its_own(tmp_path: Path) -> None:
    sensors = open_sensors("sim", profile=SIM)
    assert sensors.read().temps_c["tj"] == pytest.approx(plant_params(SIM).steady_state_c(0.0),
                                                         abs=0.5)
    assert not any(tmp_path.iterdir())
