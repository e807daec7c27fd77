"""Simulated devices that speak the agent's MQTT contract, many per process.

Each device has its own MQTT client (own client id, persistent session, retained status with
``conn_seq`` and an offline last will), answers ACCEPTED/REJECTED at once, runs one job at a
time with IN_PROGRESS, ends each command with exactly one terminal result, answers a repeated
id with DUPLICATE, and reports JobOutcome results (metrics before/after) with
model_committed / model_rolled_back events. The job itself is simulated: a duration, an
outcome and an accuracy delta per device.

All clients of a process share ONE thread driving paho's external-loop API through a
selector (epoll), so 1,000 devices cost one thread, not 1,000.

    python -m fleet.sim --port 1883 --username sim --password-file sim.password \
        --devices 1000 --group sim --job-duration-s 0.5
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import itertools
import json
import selectors
import signal
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from pydantic import BaseModel, ConfigDict, Field

from agent.mqtt.contract import (
    JOB_TYPES,
    CancelArgs,
    CommandRejected,
    ErrorInfo,
    Event,
    JobOutcome,
    JobProgress,
    ModelInfo,
    Result,
    Status,
    Telemetry,
    Topics,
    parse_command,
    utc_now,
)
from fleet.mqtt import BrokerConfig, connect_props, make_client

AGENT_VERSION = "sim-1"


class Behavior(BaseModel):
    """How one simulated device's jobs go."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    job_duration_s: float = Field(default=0.5, ge=0)
    fail: bool = False
    """finetune/deploy end FAILED (JOB_FAILED)."""
    gate_rollback: bool = False
    """The device's own gates refuse the new model: SUCCEEDED with outcome rolled_back."""
    reject: bool = False
    """finetune/deploy are REJECTED (BAD_ARGS) at once."""
    metric: str = "eval/acc"
    acc_before: float = 0.95
    acc_delta: float = 0.0
    """after - before of ``metric`` for a finished job (negative = the model got worse)."""
    rollback_duration_s: float = Field(default=0.05, ge=0)


class SimConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    devices: int = Field(default=10, ge=1, le=100_000)
    id_prefix: str = "sim"
    first_index: int = Field(default=0, ge=0)
    """Numbering starts here, so several processes (or certificates) share one id space."""
    groups: list[str] = Field(default_factory=lambda: ["sim"])
    model_name: str = "digits"
    model_version: str = "v1"
    behavior: Behavior = Field(default_factory=Behavior)
    fail_share: float = Field(default=0.0, ge=0, le=1)
    """This share of devices fails its jobs: every k-th by index (deterministic, so a test
    knows which ones; with 0.2 the 5th, 10th, ... device)."""
    overrides: dict[str, Behavior] = Field(default_factory=dict)
    """Per device id, replacing the behavior above."""
    telemetry_s: float = Field(default=0.0, ge=0)
    """Telemetry period (0: none)."""

    def device_ids(self) -> list[str]:
        last = self.first_index + self.devices
        width = max(4, len(str(last - 1)))
        return [f"{self.id_prefix}-{i:0{width}d}" for i in range(self.first_index, last)]

    def behavior_of(self, index: int, device: str) -> Behavior:
        if device in self.overrides:
            return self.overrides[device]
        fails = int((index + 1) * self.fail_share) > int(index * self.fail_share)
        return self.behavior.model_copy(update={"fail": True}) if fails else self.behavior


class _Job:
    __slots__ = ("args", "cancel", "error", "id", "result", "status", "type")

    def __init__(self, id_: str, type_: str, args: dict[str, Any]) -> None:
        self.id, self.type, self.args = id_, type_, args
        self.status = "ACCEPTED"
        self.result: dict[str, Any] | None = None
        self.error: ErrorInfo | None = None
        self.cancel = False


class SimDevice:
    """One device: its MQTT client, its job table (the idempotency record) and its model."""

    def __init__(self, fleet: SimFleet, device_id: str, behavior: Behavior) -> None:
        self.fleet = fleet
        self.id = device_id
        self.behavior = behavior
        self.groups = list(fleet.cfg.groups)
        self.conn_seq = 0
        self.boot_id = str(uuid.uuid4())
        self.model = ModelInfo(
            name=fleet.cfg.model_name, version=fleet.cfg.model_version, sequence=1, slot="a"
        )
        self.standby: ModelInfo | None = None
        self.jobs: dict[str, _Job] = {}
        self.queue: deque[str] = deque()
        self.running: str | None = None
        self.executed: list[str] = []
        """Ids of the jobs this device started, in order (a test's "ran twice?" record)."""
        self.duplicates = 0
        self.res_seq = itertools.count()
        self.evt_seq = itertools.count()
        self.tel_seq = itertools.count()
        self.online = False
        self.client: mqtt.Client | None = None

    # --- connection ---------------------------------------------------------------------

    def status(self, state: str) -> Status:
        return Status(
            state=state, device=self.id, conn_seq=self.conn_seq, boot_id=self.boot_id,
            agent_version=AGENT_VERSION, model=self.model, groups=self.groups, ts=utc_now(),
        )

    def connect(self) -> None:
        self.conn_seq += 1
        t = self.fleet.topics
        c = make_client(
            self.fleet.broker, self.id,
            will=(t.status(self.id), self.status("offline").to_payload()),
        )
        self.fleet.attach(c)
        c.on_connect = self._on_connect
        c.on_message = self._on_message
        c.on_disconnect = self._on_disconnect
        self.client = c
        c.connect(
            self.fleet.broker.host, self.fleet.broker.port, keepalive=60, clean_start=False,
            properties=connect_props(True),
        )

    def _on_connect(self, c: mqtt.Client, ud: Any, flags: Any, rc: Any, props: Any) -> None:
        if rc.is_failure:
            return
        t = self.fleet.topics
        subs = [(t.device_commands(self.id), 1)] + [(t.group_commands(g), 1) for g in self.groups]
        c.subscribe(subs)
        self.publish_status()
        self.online = True
        self.fleet.connected_count += 1

    def _on_disconnect(self, c: mqtt.Client, ud: Any, flags: Any, rc: Any, p: Any) -> None:
        if self.online:
            self.fleet.connected_count -= 1
        self.online = False

    def publish_status(self) -> None:
        assert self.client is not None
        self.client.publish(
            self.fleet.topics.status(self.id), self.status("online").to_payload(), 1, True
        )

    # --- messages out -------------------------------------------------------------------

    def send_result(self, job_id: str, status: str, **kw: Any) -> None:
        r = Result(id=job_id, device=self.id, status=status, seq=next(self.res_seq),
                   ts=utc_now(), **kw)  # type: ignore[arg-type]
        self.fleet.publish(self, self.fleet.topics.result(self.id), r.to_payload())

    def send_event(self, kind: str, data: dict[str, Any]) -> None:
        e = Event(device=self.id, kind=kind, seq=next(self.evt_seq), ts=utc_now(),  # type: ignore[arg-type]
                  data=data)
        self.fleet.publish(self, self.fleet.topics.event(self.id, kind), e.to_payload())

    def send_telemetry(self) -> None:
        job = None
        if self.running:
            job = JobProgress(id=self.running, stage=self.jobs[self.running].type)
        tel = Telemetry(ts=utc_now(), seq=next(self.tel_seq), temps_c={"cpu": 45.0},
                        power_mw=5000.0, job=job)
        if self.client is not None and self.online:
            self.client.publish(self.fleet.topics.telemetry(self.id), tel.to_payload(), 0)

    # --- commands in --------------------------------------------------------------------

    def _on_message(self, c: mqtt.Client, ud: Any, msg: mqtt.MQTTMessage) -> None:
        try:
            kind, target, type_ = self.fleet.topics.parse(msg.topic)
            self.handle(kind, target, type_ or "", msg.payload)
        except Exception as e:  # a bug in the simulation must not kill the shared loop
            self.fleet.errors.append(f"{self.id}: {e!r}")

    def handle(self, kind: str, target: str, type_: str, payload: bytes) -> None:
        try:
            cmd = parse_command(payload, type_)
        except CommandRejected as e:
            if e.command_id is None:
                return  # nothing to answer to: the contract's REJECTED needs an id
            status = "EXPIRED" if e.code == "EXPIRED" else "REJECTED"
            self.send_result(e.command_id, status,
                             error=ErrorInfo(code=e.code, message=e.message))  # type: ignore[arg-type]
            return
        mine = target == self.id if kind == "cmd" else target in self.groups
        if not mine:
            self.send_result(cmd.id, "REJECTED", error=ErrorInfo(
                code="WRONG_TARGET", message=f"addressed to {target}, this is {self.id}"))
            return
        old = self.jobs.get(cmd.id)
        if old is not None:
            self.duplicates += 1
            self.send_result(cmd.id, "DUPLICATE", result=old.result, error=old.error,
                             stored_status=old.status)
            return
        job = _Job(cmd.id, cmd.type, cmd.args)
        self.jobs[cmd.id] = job
        if cmd.type in JOB_TYPES and cmd.type != "rollback" and self.behavior.reject:
            self._finish(job, "REJECTED", error=ErrorInfo(
                code="BAD_ARGS", message="args.version: simulated refusal"))
            return
        self.send_result(cmd.id, "ACCEPTED")
        if cmd.type in JOB_TYPES:
            self.queue.append(cmd.id)
            self.fleet.call_later(0, self._next_job)
        elif cmd.type == "cancel":
            self._cancel(job, CancelArgs.model_validate(cmd.args).job_id)
        elif cmd.type == "set_power_mode":
            self._finish(job, "FAILED", error=ErrorInfo(
                code="UNAVAILABLE", message="the simulated board has no power modes"))
        else:  # ping, status
            self._finish(job, "SUCCEEDED", result=self.status("online").model_dump(mode="json"))

    def _finish(self, job: _Job, status: str, *, result: dict[str, Any] | None = None,
                error: ErrorInfo | None = None) -> None:
        job.status, job.result, job.error = status, result, error
        self.send_result(job.id, status, result=result, error=error)

    def _cancel(self, cancel_job: _Job, target_id: str) -> None:
        target = self.jobs.get(target_id)
        if target is None:
            self._finish(cancel_job, "FAILED", error=ErrorInfo(
                code="NOT_FOUND", message=f"no job {target_id!r} on {self.id}"))
            return
        if target.status not in ("ACCEPTED", "IN_PROGRESS"):
            self._finish(cancel_job, "FAILED", error=ErrorInfo(
                code="NOT_CANCELABLE", message=f"job {target_id!r} already {target.status}"))
            return
        if target.status == "ACCEPTED":
            self.queue.remove(target_id)
            self._finish(target, "CANCELED", error=ErrorInfo(code="CANCELED", message="canceled"))
        else:
            target.cancel = True  # stops at its next step, like the real job
        self._finish(cancel_job, "SUCCEEDED", result={"job_id": target_id})

    # --- the simulated job ----------------------------------------------------------------

    def _next_job(self) -> None:
        if self.running is not None or not self.queue:
            return
        job = self.jobs[self.queue.popleft()]
        self.running = job.id
        self.executed.append(job.id)
        job.status = "IN_PROGRESS"
        self.send_result(job.id, "IN_PROGRESS", progress=JobProgress(
            id=job.id, stage=job.type, pct=0.0))
        b = self.behavior
        duration = b.rollback_duration_s if job.type == "rollback" else b.job_duration_s
        self.fleet.call_later(duration, lambda: self._end_job(job))

    def _end_job(self, job: _Job) -> None:
        self.running = None
        try:
            if job.cancel:
                self._finish(job, "CANCELED", error=ErrorInfo(code="CANCELED", message="canceled"))
            elif job.type == "rollback":
                self._rollback(job)
            else:
                self._train_or_deploy(job)
        finally:
            self.fleet.call_later(0, self._next_job)

    def _rollback(self, job: _Job) -> None:
        if self.standby is None:
            self._finish(job, "FAILED", error=ErrorInfo(
                code="NOT_FOUND", message="no standby version to roll back to"))
            return
        prev, self.model, self.standby = self.model, self.standby, self.model
        out = JobOutcome(outcome="rolled_back", reason=job.args.get("reason") or "requested",
                         model=self.model, previous_model=prev)
        self.send_event("model_rolled_back", {"from": prev.version, "to": self.model.version})
        self.publish_status()
        self._finish(job, "SUCCEEDED", result=out.model_dump(mode="json", exclude_none=True))

    def _train_or_deploy(self, job: _Job) -> None:
        b = self.behavior
        if b.fail:
            self._finish(job, "FAILED", error=ErrorInfo(
                code="JOB_FAILED", message=f"step {job.type}: simulated failure"))
            return
        before = {b.metric: b.acc_before}
        after = {b.metric: round(b.acc_before + b.acc_delta, 6)}
        if b.gate_rollback:
            out = JobOutcome(outcome="rolled_back", reason="gate: accuracy below threshold",
                             metrics_before=before, metrics_after=after, model=self.model)
            self.send_event("model_rolled_back", {"reason": out.reason})
        else:
            prev = self.model
            version = str(job.args.get("version") or f"{prev.version}+ft")
            self.model = ModelInfo(
                name=prev.name, version=version, sequence=(prev.sequence or 0) + 1,
                slot="b" if prev.slot == "a" else "a",
            )
            self.standby = prev
            out = JobOutcome(outcome="committed", metrics_before=before, metrics_after=after,
                             model=self.model, previous_model=prev)
            self.send_event("model_committed", {"version": version, "job": job.id})
            self.publish_status()
        self._finish(job, "SUCCEEDED", result=out.model_dump(mode="json", exclude_none=True))


class SimFleet:
    """Many :class:`SimDevice` on one selector thread."""

    def __init__(self, cfg: SimConfig, broker: BrokerConfig) -> None:
        self.cfg = cfg
        self.broker = broker
        self.topics = Topics(broker.prefix)
        self.sel = selectors.DefaultSelector()
        self.timers: list[tuple[float, int, Callable[[], None]]] = []
        self._tseq = itertools.count()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self.sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._calls: deque[Callable[[], None]] = deque()
        self.devices = {
            d: SimDevice(self, d, cfg.behavior_of(cfg.first_index + i, d))
            for i, d in enumerate(cfg.device_ids())
        }
        self.connected_count = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- paho external loop ----------------------------------------------------------

    def attach(self, c: mqtt.Client) -> None:
        nodelay = c.on_socket_open

        def opened(client: mqtt.Client, ud: Any, sock: Any) -> None:
            if nodelay is not None:
                nodelay(client, ud, sock)
            self.sel.register(sock, selectors.EVENT_READ, client)

        def closed(client: mqtt.Client, ud: Any, sock: Any) -> None:
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(sock)

        def want_write(client: mqtt.Client, ud: Any, sock: Any) -> None:
            with contextlib.suppress(KeyError, ValueError):
                self.sel.modify(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, client)

        def done_write(client: mqtt.Client, ud: Any, sock: Any) -> None:
            with contextlib.suppress(KeyError, ValueError):
                self.sel.modify(sock, selectors.EVENT_READ, client)

        c.on_socket_open = opened
        c.on_socket_close = closed
        c.on_socket_register_write = want_write
        c.on_socket_unregister_write = done_write

    def publish(self, dev: SimDevice, topic: str, payload: bytes) -> None:
        # QoS 1 while disconnected stays in paho's memory and goes out after reconnect.
        if dev.client is not None:
            dev.client.publish(topic, payload, qos=1)

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self.timers, (time.monotonic() + delay_s, next(self._tseq), fn))

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> None:
        self._calls.append(fn)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _run(self) -> None:
        for d in self.devices.values():
            d.connect()
        last_misc = time.monotonic()
        last_tel = last_misc
        while not self._stop.is_set():
            now = time.monotonic()
            timeout = 0.2 if not self.timers else max(0.0, min(0.2, self.timers[0][0] - now))
            for key, mask in self.sel.select(timeout):
                client = key.data
                if client is None:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                    continue
                if mask & selectors.EVENT_READ:
                    client.loop_read()
                if mask & selectors.EVENT_WRITE:
                    client.loop_write()
            while self._calls:
                self._calls.popleft()()
            now = time.monotonic()
            while self.timers and self.timers[0][0] <= now:
                _, _, fn = heapq.heappop(self.timers)
                try:
                    fn()
                except Exception as e:
                    self.errors.append(repr(e))
            if now - last_misc >= 1.0:
                last_misc = now
                for d in self.devices.values():
                    if d.client is not None and d.client.loop_misc() != mqtt.MQTT_ERR_SUCCESS:
                        self._reconnect(d)
            if self.cfg.telemetry_s and now - last_tel >= self.cfg.telemetry_s:
                last_tel = now
                for d in self.devices.values():
                    d.send_telemetry()
        for d in self.devices.values():  # a clean exit says offline itself (no last will)
            if d.client is not None and d.online:
                off = d.status("offline").to_payload()
                d.client.publish(self.topics.status(d.id), off, 1, True)
                d.client.loop_write()
                d.client.disconnect()
                d.client.loop_write()

    def _reconnect(self, d: SimDevice) -> None:
        assert d.client is not None
        with contextlib.suppress(OSError):  # retried at the next misc tick (1 s)
            d.client.reconnect()

    def crash(self, device_id: str) -> None:
        """Drop a device's TCP connection without DISCONNECT: the broker sends its last will,
        and the device stays off until :meth:`revive`."""
        def do() -> None:
            d = self.devices[device_id]
            if d.client is not None:
                sock = d.client.socket()
                d.client.on_disconnect = None
                if d.online:
                    self.connected_count -= 1
                d.online = False
                if sock is not None:
                    self.sel.unregister(sock)
                    sock.close()
                d.client = None
        self.call_soon_threadsafe(do)

    def start(self, timeout_s: float = 60.0) -> SimFleet:
        self._thread = threading.Thread(target=self._run, name="sim-fleet", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while self.connected_count < len(self.devices):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {self.connected_count}/{len(self.devices)} simulated devices connected"
                )
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._stop.set()
        self.call_soon_threadsafe(lambda: None)
        if self._thread is not None:
            self._thread.join(10)

    def summary(self) -> dict[str, Any]:
        return {
            "devices": len(self.devices),
            "executed": {d.id: list(d.executed) for d in self.devices.values() if d.executed},
            "models": {d.id: d.model.version for d in self.devices.values()},
            "duplicates": sum(d.duplicates for d in self.devices.values()),
            "errors": self.errors,
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fleet.sim", description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=1883)
    ap.add_argument("--prefix", default=BrokerConfig().prefix)
    ap.add_argument("--username", help="broker account of every simulated device")
    ap.add_argument("--password-file", type=Path, help="file holding that account's password")
    ap.add_argument("--config", type=Path, help="SimConfig as JSON (flags below override)")
    ap.add_argument("--devices", type=int)
    ap.add_argument("--id-prefix")
    ap.add_argument("--first-index", type=int)
    ap.add_argument("--group", action="append", help="group of every device (repeatable)")
    ap.add_argument("--job-duration-s", type=float)
    ap.add_argument("--fail-share", type=float)
    ap.add_argument("--acc-delta", type=float)
    ap.add_argument("--telemetry-s", type=float, help="telemetry period (default: none)")
    ap.add_argument("--summary", type=Path, help="write executed jobs per device here at exit")
    a = ap.parse_args(argv)
    data: dict[str, Any] = json.loads(a.config.read_text()) if a.config else {}
    for key in ("devices", "id_prefix", "first_index", "fail_share", "telemetry_s"):
        if getattr(a, key) is not None:
            data[key] = getattr(a, key)
    if a.group:
        data["groups"] = a.group
    beh = data.setdefault("behavior", {})
    if a.job_duration_s is not None:
        beh["job_duration_s"] = a.job_duration_s
    if a.acc_delta is not None:
        beh["acc_delta"] = a.acc_delta
    cfg = SimConfig.model_validate(data)
    fleet = SimFleet(cfg, BrokerConfig(host=a.host, port=a.port, prefix=a.prefix,
                                       username=a.username, password_file=a.password_file))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    fleet.start()
    print(json.dumps({"event": "sim_ready", "devices": len(fleet.devices)}), flush=True)
    stop.wait()
    fleet.stop()
    if a.summary:
        a.summary.write_text(json.dumps(fleet.summary()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
