"""ActiveModel: follows commits through real A/B slots under concurrent load with no failed
request, drains the old engine, keeps serving when a new version fails to load, defers to
hold_updates, reports its stats, and refuses what it cannot run with the reason."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.runtime import active_model as am
from agent.runtime.active_model import ActiveModel, NoSpoolError
from agent.runtime.engine_outputs import EngineOutputs, TensorSpec
from agent.runtime.latency import LatencyWindow, percentiles
from agent.runtime.stats import read_stats
from exporters.ort_runner import NO_SPINNING
from registry.errors import NoActiveModelError
from tests.agent.runtime.conftest import MODEL, Device, served_version

ZERO = np.zeros((2, 1, 8, 8), np.float32)


def wait_for(cond: Any, timeout_s: float = 10.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_swaps_under_concurrent_load_fail_no_request_and_serve_every_version(
        device: Device) -> None:
    device.install(1)
    versions = range(2, 9)  # seven commits, alternating slots a/b
    with ActiveModel(device.state, MODEL, poll_s=0.02, threads=1) as model:
        stop = threading.Event()
        seen: list[Counter[int]] = [Counter() for _ in range(4)]
        errors: list[BaseException] = []

        def client(i: int) -> None:
            x = np.zeros((1 + i, 1, 8, 8), np.float32)
            while not stop.is_set():
                try:
                    seen[i][served_version(model.predict(x))] += 1
                except BaseException as e:
                    errors.append(e)
                    return

        clients = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in clients:
            t.start()
        try:
            for k in versions:
                device.install(k)  # stage into the standby slot, then the atomic commit
                wait_for(lambda k=k: sum(c[k] for c in seen) >= 20, what=f"v{k} served")
        finally:
            stop.set()
            for t in clients:
                t.join()
        stats = model.stats()
    assert errors == []
    total = sum(seen, Counter())
    assert set(total) == {1, *versions}, total
    assert stats.failed == 0 and stats.swaps == len(versions)
    assert stats.requests == sum(total.values())


def test_two_commits_between_polls_are_seen_through_the_slot_marker(device: Device) -> None:
    device.install(1)
    with ActiveModel(device.state, MODEL, poll_s=0.3) as model:
        assert model.version == "1"
        # v2 goes to slot b, v3 back to slot a: `current` reads slots/a again, another version.
        device.install(2)
        device.install(3)
        assert (device.state / "models/digits/current").readlink() == Path("slots/a")
        wait_for(lambda: model.version == "3", what="v3")
        assert served_version(model.predict(ZERO)) == 3


class GatedEngine:
    """An engine whose calls wait for a gate: a request held in flight on demand."""

    name, platform, providers, notes = "fake", "onnxruntime_onnx", ("fake",), ()
    input_name, output_name = "input", "logits"
    input_shape, output_shape = (-1, 1, 8, 8), (-1, 10)
    outputs = (TensorSpec("logits", "FP32", (-1, 10)),)

    def __init__(self, version: int) -> None:
        self.version = version
        self.gate = threading.Event()
        self.gate.set()
        self.closed = 0

    def __call__(self, x: np.ndarray) -> EngineOutputs:
        assert self.closed == 0, "called after close"
        self.gate.wait(10)
        out = np.zeros((len(x), 10), np.float32)
        out[:, 0] = self.version
        return EngineOutputs(logits=out)

    def close(self) -> None:
        self.closed += 1


def test_requests_in_flight_finish_on_the_old_engine_which_is_then_released(
        device: Device, monkeypatch: pytest.MonkeyPatch) -> None:
    engines: dict[int, GatedEngine] = {}

    def fake_engine_for(slot: Path, providers: Any, *, threads: int = 0,
                        spin: bool = True) -> GatedEngine:
        version = int((slot / "COMPLETE").read_text().split('"version": "')[1].split('"')[0])
        engines[version] = GatedEngine(version)
        return engines[version]

    monkeypatch.setattr(am, "engine_for", fake_engine_for)
    device.install(1)
    with ActiveModel(device.state, MODEL, poll_s=0.02) as model:
        old = engines[1]
        old.gate.clear()
        answer: list[int] = []
        held = threading.Thread(target=lambda: answer.append(served_version(model.predict(ZERO))))
        held.start()
        wait_for(lambda: model._current is not None and model._current.inflight == 1,
                 what="the request in flight")
        device.install(2)
        wait_for(lambda: model.version == "2", what="the swap")
        assert served_version(model.predict(ZERO)) == 2  # new requests: the new engine
        assert old.closed == 0  # still running one request
        old.gate.set()
        held.join()
        assert answer == [1] and old.closed == 1  # finished on v1, then v1 was released
    assert engines[2].closed == 1  # close() released the last one


def test_a_version_that_fails_to_load_leaves_the_old_one_serving(device: Device) -> None:
    device.install(1)
    with ActiveModel(device.state, MODEL, poll_s=0.02) as model:
        device.install(2, onnx_file=False)  # committed without an ONNX artefact
        wait_for(lambda: model.load_failures == 1, what="the load failure")
        assert model.version == "1" and served_version(model.predict(ZERO)) == 1
        assert "no artefacts/model.onnx" in (model.last_error or "")
        device.install(3)
        wait_for(lambda: model.version == "3", what="v3")
        assert model.load_failures == 1 and model.stats().failed == 0


def test_no_committed_model_is_a_clear_error_until_one_is(device: Device) -> None:
    with ActiveModel(device.state, MODEL, poll_s=0.02) as model:
        assert model.version is None and not model.wait_ready(0.05)
        with pytest.raises(NoActiveModelError, match=r"no committed version of 'digits'.*"
                           r"wait_ready"):
            model.predict(ZERO)
        threading.Timer(0.1, device.install, args=(1,)).start()
        assert model.wait_ready(10)
        assert served_version(model.predict(ZERO)) == 1


def test_hold_updates_keeps_the_version_until_the_block_ends(device: Device) -> None:
    device.install(1)
    with ActiveModel(device.state, MODEL, poll_s=0.02) as model:
        with model.hold_updates():
            device.install(2)
            time.sleep(0.3)  # fifteen polls
            assert model.version == "1" and served_version(model.predict(ZERO)) == 1
        wait_for(lambda: model.version == "2", what="v2 after the hold")


def test_stats_are_written_about_once_a_second_and_removed_on_close(device: Device) -> None:
    device.install(1)
    with ActiveModel(device.state, MODEL, slo_ms=20, stats_interval_s=0.05) as model:
        for _ in range(10):
            model.predict(ZERO)
        wait_for(lambda: any(s.requests == 10 for s in read_stats(device.state, MODEL)),
                 what="the stats file")
        (s,) = read_stats(device.state, MODEL)
        assert (s.version, s.slo_ms, s.failed, s.window_requests) == ("1", 20, 0, 10)
        assert s.p50_ms is not None and s.p99_ms is not None and s.p50_ms <= s.p99_ms
    assert read_stats(device.state, MODEL) == []
    with pytest.raises(ValueError, match="slo_ms"):
        ActiveModel(device.state, MODEL, slo_ms=0)


def test_bad_input_is_refused_with_the_reason_and_serving_goes_on(device: Device) -> None:
    device.install(1)
    with ActiveModel(device.state, MODEL) as model:
        with pytest.raises(ValueError, match=r"\[2, 3, 8, 8\] does not fit the model's N.1.8.8"):
            model.predict(np.zeros((2, 3, 8, 8), np.float32))
        with pytest.raises(ValueError, match="float32"):
            model.predict(np.zeros((2, 1, 8, 8)))
        assert served_version(model.predict(ZERO)) == 1
        assert model.stats().failed == 2


def _spinning(model: ActiveModel) -> bool:
    """Whether the served session's intra-op threads spin between runs (ONNX Runtime's
    default: no ``allow_spinning`` entry, or "1")."""
    assert model._current is not None
    return _session_spins(model._current.engine.session)  # type: ignore[attr-defined]


def _session_spins(session: Any) -> bool:
    options = session.get_session_options()
    try:
        return options.get_session_config_entry(NO_SPINNING[0]) != "0"
    except RuntimeError:  # no such entry
        return True


def test_served_sessions_sleep_between_requests_unless_asked_to_spin(device: Device) -> None:
    """A spinning ONNX Runtime pool kept a core ~80 % busy serving 20 requests/s (python
    benchmarks/ort_spin.py): the runtime's threads sleep unless ``spin``. Both answer alike."""
    device.install(1)
    with ActiveModel(device.state, MODEL, threads=2) as model:
        assert served_version(model.predict(ZERO)) == 1
        assert not _spinning(model)
    with ActiveModel(device.state, MODEL, threads=2, spin=True) as model:
        assert served_version(model.predict(ZERO)) == 1
        assert _spinning(model)


def test_the_health_check_scores_a_version_in_a_session_that_does_not_spin(
        device: Device) -> None:
    """The device job's health check scores the staged version in the runtime that serves it
    (``agent.jobs.steps.health.runner_for``), threads asleep between runs as the served
    session's are: no core spins beside the application while a job checks its model."""
    from agent.jobs.steps.health import runner_for

    slot = device.stage(1)
    engine, runtime = runner_for(slot.path)
    assert runtime.startswith("onnxruntime"), runtime
    assert not _session_spins(engine.session)
    assert served_version(np.asarray(engine(ZERO))) == 1


class ListSpool:
    def __init__(self) -> None:
        self.items: list[tuple[np.ndarray, int | None, np.ndarray | None]] = []

    def record(self, x: np.ndarray, *, label: int | None = None,
               logits: np.ndarray | None = None) -> int:
        self.items.append((x, label, logits))
        return len(self.items)


def test_record_scores_the_sample_and_hands_it_to_the_spool(device: Device) -> None:
    device.install(1)
    spool = ListSpool()
    with ActiveModel(device.state, MODEL, spool=spool) as model:
        assert model.record(ZERO, label=3) == 1
        _, label, logits = spool.items[0]
        assert label == 3 and logits is not None and served_version(logits) == 1
    with ActiveModel(device.state, MODEL) as model, pytest.raises(NoSpoolError, match="spool"):
        model.record(ZERO)


def test_latency_window_keeps_the_window_and_ranks_the_nearest_sample() -> None:
    w = LatencyWindow(max_samples=1000)
    for i in range(200):  # one sample per 0.1 s, 1..200 ms
        w.add(float(i + 1), now=i * 0.1)
    recent = w.recent(10.0, now=19.9)  # the last 10 s: samples at t >= 9.9, i.e. 100..200 ms
    assert recent == [float(i + 1) for i in range(99, 200)]
    assert percentiles(recent) == (150.0, 199.0, 101)  # nearest rank: ceil(q * n)
    assert percentiles([]) == (None, None, 0)
    assert w.recent(10.0, now=100.0) == []  # everything left the window
    bounded = LatencyWindow(max_samples=3)
    for ms in (1.0, 2.0, 3.0, 4.0):
        bounded.add(ms, now=0.0)
    assert bounded.recent(1.0, now=0.5) == [2.0, 3.0, 4.0]
