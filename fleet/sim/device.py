"""One simulated device (``SimDevice``): the agent's side of the MQTT contract without the agent.
It answers ACCEPTED/REJECTED (or DEFERRED, when its behavior says it is busy) at once, runs one
job at a time with IN_PROGRESS, ends each command with exactly one terminal result, answers a
repeated id with DUPLICATE (its job table is the idempotency record), and reports JobOutcome
results with model_committed / model_rolled_back events; the job itself is a timer on the
shared loop of its ``SimFleet``. A device knows its fleet only as a ``SimHost`` (the loop, the
broker and the counters they share), so ``fleet.sim.fleet`` imports this module and never the
other way round.
"""

from __future__ import annotations

import itertools
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import paho.mqtt.client as mqtt

from contract import (
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
from fleet.sim.config import Behavior, SimConfig

AGENT_VERSION = "sim-1"
DEFERRABLE = frozenset({"finetune", "deploy", "evaluate"})
"""The jobs a busy device defers (``Behavior.defer``); a rollback or cancel never waits."""


class SimHost(Protocol):
    """What a device uses of the fleet that runs it (``fleet.sim.fleet.SimFleet``): the shared
    config, broker and topics, the one loop (its timers and its sockets), and the counters a
    test reads."""

    cfg: SimConfig
    broker: BrokerConfig
    topics: Topics
    connected_count: int
    errors: list[str]

    def broker_for(self, device_id: str) -> BrokerConfig: ...

    def attach(self, c: mqtt.Client) -> None: ...

    def publish(self, dev: SimDevice, topic: str, payload: bytes) -> None: ...

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> None: ...


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

    def __init__(self, host: SimHost, device_id: str, behavior: Behavior) -> None:
        self.host = host
        self.id = device_id
        self.behavior = behavior
        self.groups = list(host.cfg.groups)
        self.conn_seq = 0
        self.boot_id = str(uuid.uuid4())
        self.model = ModelInfo(
            name=host.cfg.model_name, version=host.cfg.model_version, sequence=1, slot="a"
        )
        self.standby: ModelInfo | None = None
        self.jobs: dict[str, _Job] = {}
        self.queue: deque[str] = deque()
        self.running: str | None = None
        self.executed: list[str] = []
        """Ids of the jobs this device started, in order (a test's "ran twice?" record)."""
        self.duplicates = 0
        self.deferred: dict[str, int] = {}
        """Per command id, how often this device answered it DEFERRED."""
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
        t = self.host.topics
        c = make_client(
            self.host.broker_for(self.id), self.id,
            will=(t.status(self.id), self.status("offline").to_payload()),
        )
        self.host.attach(c)
        c.on_connect = self._on_connect
        c.on_message = self._on_message
        c.on_disconnect = self._on_disconnect
        self.client = c
        c.connect(
            self.host.broker.host, self.host.broker.port, keepalive=60, clean_start=False,
            properties=connect_props(True),
        )

    def _on_connect(self, c: mqtt.Client, ud: Any, flags: Any, rc: Any, props: Any) -> None:
        if rc.is_failure:
            return
        t = self.host.topics
        subs = [(t.device_commands(self.id), 1)] + [(t.group_commands(g), 1) for g in self.groups]
        c.subscribe(subs)
        self.publish_status()
        self.online = True
        self.host.connected_count += 1

    def _on_disconnect(self, c: mqtt.Client, ud: Any, flags: Any, rc: Any, p: Any) -> None:
        if self.online:
            self.host.connected_count -= 1
        self.online = False

    def publish_status(self) -> None:
        assert self.client is not None
        self.client.publish(
            self.host.topics.status(self.id), self.status("online").to_payload(), 1, True
        )

    # --- messages out -------------------------------------------------------------------

    def send_result(self, job_id: str, status: str, **kw: Any) -> None:
        r = Result(id=job_id, device=self.id, status=status, seq=next(self.res_seq),
                   ts=utc_now(), **kw)  # type: ignore[arg-type]
        self.host.publish(self, self.host.topics.result(self.id), r.to_payload())

    def send_event(self, kind: str, data: dict[str, Any]) -> None:
        e = Event(device=self.id, kind=kind, seq=next(self.evt_seq), ts=utc_now(),  # type: ignore[arg-type]
                  data=data)
        self.host.publish(self, self.host.topics.event(self.id, kind), e.to_payload())

    def send_telemetry(self) -> None:
        job = None
        if self.running:
            job = JobProgress(id=self.running, stage=self.jobs[self.running].type)
        tel = Telemetry(ts=utc_now(), seq=next(self.tel_seq), temps_c={"cpu": 45.0},
                        power_mw=5000.0, job=job)
        if self.client is not None and self.online:
            self.client.publish(self.host.topics.telemetry(self.id), tel.to_payload(), 0)

    # --- commands in --------------------------------------------------------------------

    def _on_message(self, c: mqtt.Client, ud: Any, msg: mqtt.MQTTMessage) -> None:
        try:
            kind, target, type_ = self.host.topics.parse(msg.topic)
            self.handle(kind, target, type_ or "", msg.payload)
        except Exception as e:  # a bug in the simulation must not kill the shared loop
            self.host.errors.append(f"{self.id}: {e!r}")

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
        if cmd.type in DEFERRABLE and self.deferred.get(cmd.id, 0) < self.behavior.defer:
            # Busy: no record kept, so the same id sent again later is a new delivery.
            self.deferred[cmd.id] = self.deferred.get(cmd.id, 0) + 1
            self.send_result(cmd.id, "DEFERRED", recheck_after_s=self.behavior.defer_recheck_s,
                             error=ErrorInfo(code="UNAVAILABLE", retryable=True,
                                             message="simulated: a fine-tune job is running"))
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
            self.host.call_later(0, self._next_job)
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
        self.host.call_later(duration, lambda: self._end_job(job))

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
            self.host.call_later(0, self._next_job)

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
