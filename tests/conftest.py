"""Shared test set-up: keep torch to few threads so tests run side by side on 2 cores."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.mosquitto import Broker, have_mosquitto, start_mosquitto
from tests.support.postgres import PostgresServer, PostgresUnavailable
from tests.support.postgres import postgres_server as postgres_server_of_this_host

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]

# The CPU by test file after --durations (make test is CPU-bound: where the CPU goes).
pytest_plugins = ["tests.support.cpu_report"]

# The files that take longest, longest first (`make test`'s --durations, summed per file). With
# `--dist loadfile --no-loadscope-reorder` xdist hands files out in collection order, one at a
# time as a process frees up: starting the long scenarios first keeps every process busy to
# the end instead of leaving one running the demo alone for its last five minutes.
LONGEST_FIRST = (
    "tests/agent/jobs/test_budget_runs.py",
    "tests/e2e/test_mission.py",
    "tests/exporters/test_zoo.py",
    "tests/agent/jobs/test_job_budget.py",
    "tests/benchmarks/test_quick_device_job.py",
    "tests/agent/jobs/test_device_job.py",
    "tests/security/test_daemon_bounds.py",
    "tests/fleet/learn/test_poisoned.py",
    "tests/benchmarks/test_quick_training.py",
    "tests/hpc_core/test_finders.py",
    "tests/agent/finetune/test_finetune.py",
    "tests/agent/jobs/test_yield_to_app.py",
    "tests/agent/jobs/detection/test_detection_job.py",
    "tests/fleet/rollout/test_rollout.py",
    "tests/agent/finetune/test_vit_finetune.py",
)

# The files that mostly wait (a Ray cluster's start, Slurm's daemons, a broker's or a server's
# timeouts, simulated devices' paced jobs: under 0.35 CPU-s a second of their wall time, the
# longest first). With three test processes or more, the last runs them and nothing else
# (tests.support.lanes) beside the CPU-bound files the others run. With fewer, they are spread
# among the other files, one every so many, so each waits beside processes that keep the cores
# busy: all started right after the longest files, the processes took them up at once and the
# cores fell to 0.8-1.2 busy for three minutes (``CPU_REPORT_JSON``'s spans).
MOSTLY_WAITING = (
    "tests/hpc_core/tune/test_ray.py",
    "tests/fleet/learn/test_learn.py",
    "tests/fleet/rollout/test_controls.py",
    "tests/agent/daemon/test_job_faults.py",
    "tests/launch/test_slurm.py",
    "tests/fleet/broker/test_tier.py",
    "tests/security/test_broker_identity.py",
    "tests/agent/daemon/test_lifecycle.py",
    "tests/security/test_http_framing.py",
    "tests/agent/daemon/test_events_telemetry.py",
    "tests/fleet/rollout/test_replicas.py",
    "tests/fleet/rollout/test_metrics.py",
    "tests/security/test_forged_identity.py",
    "tests/registry/test_hardening.py",
    "tests/agent/daemon/test_broker_auth.py",
    "tests/registry/test_lifetime.py",
    "tests/agent/mqtt/test_broker_security.py",
)


def file_order(files: list[str]) -> list[str]:
    """The order the files start in: :data:`LONGEST_FIRST`, then every other file in collection
    order with the :data:`MOSTLY_WAITING` ones spread among them: one after each
    ``len(others) / (len(waiting) + 2)`` files, so twice that many close the run."""
    longest = [f for f in LONGEST_FIRST if f in files]
    waiting = [f for f in MOSTLY_WAITING if f in files]
    others = [f for f in files if f not in LONGEST_FIRST and f not in MOSTLY_WAITING]
    gap = len(others) / (len(waiting) + 2)
    order, k = longest, 0
    for i, f in enumerate(others):
        while k < len(waiting) and i >= gap * (k + 1):
            order.append(waiting[k])
            k += 1
        order.append(f)
    return order + waiting[k:]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` with a lane of its own for :data:`MOSTLY_WAITING`."""
    if config.getoption("dist") != "loadfile":
        return None
    from tests.support.lanes import WaitingLaneScheduling

    return WaitingLaneScheduling(config, log, waiting=MOSTLY_WAITING)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Start the files in :func:`file_order`; a file's tests keep their order (a stable sort)."""
    # Each item's file resolved once (~1,700 items), for the order and for the sort.
    files = {id(item): Path(str(item.path)).resolve().relative_to(REPO).as_posix()
             for item in items}
    rank = {f: i for i, f in enumerate(file_order(list(dict.fromkeys(files.values()))))}
    items.sort(key=lambda item: rank[files[id(item)]])


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what the imports and the collection made (torch, every test module): the
    collector's full passes in these long-lived processes then skip it (in-process tests ~3 %
    less CPU; each program does the like: registry.lifetime)."""
    gc.collect()
    gc.freeze()


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    """Environment for a child Python that imports the project from this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    for k in list(env):
        if k.startswith("HPC_FAULT_"):
            del env[k]
    return env


@pytest.fixture
def python() -> str:
    return sys.executable


@pytest.fixture
def mosquitto(tmp_path: Path) -> Iterator[Callable[..., Broker]]:
    """Start real mosquitto brokers: ``mosquitto(**options)`` takes the options of
    ``tests.support.mosquitto.start_mosquitto`` and returns a Broker (host, port, stop(),
    start()); every broker started is stopped after the test. Skips without mosquitto."""
    if not have_mosquitto():
        pytest.skip("mosquitto is not installed (make services)")
    started: list[Broker] = []

    def start(name: str = "broker", **options: Any) -> Broker:
        broker = start_mosquitto(tmp_path / f"mosquitto-{name}", **options)
        started.append(broker)
        return broker

    yield start
    for broker in started:
        broker.stop()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One real PostgreSQL cluster for the session (skips where it cannot run)."""
    try:
        with postgres_server_of_this_host() as server:
            yield server
    except PostgresUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> str:
    """A fresh empty database in the session's cluster: its ``postgresql://`` URL."""
    return postgres_server.new_database()
