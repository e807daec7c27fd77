"""Results and events leave the device through here: persisted in the outbox, then published.

Each ``Result`` gets the next per-device ``seq`` in the same transaction that stores it and
records what was announced (the ledger's ``announced`` table, :mod:`agent.daemon.ledger`), so
after a crash the daemon knows exactly which states it still owes: a job's ACCEPTED and its one
terminal status are announced once and only once, however often the daemon restarts.
"""

from __future__ import annotations

import base64
import logging
import threading
from collections.abc import Callable
from typing import Any

from agent.daemon.ledger import Ledger
from agent.jobs.store import JobRecord, JobState
from agent.mqtt.outbox import Outbox, Tx
from contract import (
    TERMINAL_STATUSES,
    ErrorInfo,
    Event,
    JobProgress,
    Result,
    Topics,
    utc_now,
)

log = logging.getLogger("agent.daemon")

Listener = Callable[[Result], None]


def job_status(rec: JobRecord) -> str:
    """The contract status a stored job stands at (a job that expired in the queue is stored
    FAILED with error code EXPIRED, and announced EXPIRED)."""
    if rec.state is JobState.QUEUED:
        return "ACCEPTED"
    if rec.state is JobState.FAILED and (rec.error or {}).get("code") == "EXPIRED":
        return "EXPIRED"
    return rec.state.value


def reply_of(response_topic: str | None, correlation: bytes | None) -> dict[str, Any] | None:
    if not response_topic:
        return None
    out: dict[str, Any] = {"response_topic": response_topic}
    if correlation:
        out["correlation_data_b64"] = base64.b64encode(correlation).decode()
    return out


class Announcer:
    def __init__(
        self, outbox: Outbox, topics: Topics, device: str, flush: Callable[[], Any]
    ) -> None:
        self.outbox = outbox
        self.ledger = Ledger(outbox)
        self.topics = topics
        self.device = device
        self._flush = flush
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()

    # -- listeners (control socket clients following a command) ---------------------------

    def listen(self, fn: Listener) -> None:
        with self._lock:
            self._listeners.append(fn)

    def unlisten(self, fn: Listener) -> None:
        with self._lock:
            if fn in self._listeners:
                self._listeners.remove(fn)

    def _notify(self, results: list[Result]) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for r in results:
            for fn in listeners:
                try:
                    fn(r)
                except Exception:
                    log.exception("result listener failed")

    # -- results --------------------------------------------------------------------------

    def put_result(
        self, tx: Tx, id: str, status: str, *, reply: dict[str, Any] | None = None,
        result: dict[str, Any] | None = None, error: dict[str, Any] | None = None,
        progress: dict[str, Any] | None = None, stored_status: str | None = None,
        record: bool = True, recheck_after_s: float | None = None,
    ) -> Result:
        """Add one result to the outbox inside ``tx`` (and to the reply topic, if any);
        ``recheck_after_s``: a DEFERRED's time to send the command again."""
        res = Result(
            id=id, device=self.device, status=status,  # type: ignore[arg-type]
            seq=tx.next_seq("res"), ts=utc_now(),
            progress=JobProgress.model_validate(progress) if progress else None,
            result=result, error=ErrorInfo.model_validate(error) if error else None,
            stored_status=stored_status,  # type: ignore[arg-type]
            recheck_after_s=recheck_after_s,
        )
        payload = res.to_payload()
        tx.put(self.topics.result(self.device), payload)
        if reply and reply.get("response_topic"):
            props = {k: v for k, v in reply.items() if k == "correlation_data_b64"}
            tx.put(reply["response_topic"], payload, props=props or None)
        if record and status != "IN_PROGRESS":
            self.ledger.mark_announced(tx, id, status)
        return res

    def send(self, build: Callable[[Tx], list[Result]], durable: bool = True) -> list[Result]:
        """Run ``build`` in one outbox transaction, then publish and tell the listeners."""
        with self.outbox.tx(durable) as tx:
            results = build(tx)
        self._flush()
        self._notify(results)
        return results

    def announce_job(
        self, rec: JobRecord, progress: dict[str, Any] | None = None
    ) -> Result | None:
        """Announce where a stored job stands, unless that state was already announced;
        a terminal status is announced at most once per job."""

        def build(tx: Tx) -> list[Result]:
            status = job_status(rec)
            done = self.ledger.announced(rec.id, tx)
            if done & TERMINAL_STATUSES:
                return []
            out = []
            if "ACCEPTED" not in done and status != "REJECTED":
                out.append(self.put_result(tx, rec.id, "ACCEPTED", reply=rec.reply))
            if status == "ACCEPTED":
                return out
            if status == "IN_PROGRESS":
                out.append(self.put_result(tx, rec.id, "IN_PROGRESS", reply=rec.reply,
                                           progress=_progress(rec.id, progress or rec.progress)))
                return out
            out.append(self.put_result(tx, rec.id, status, reply=rec.reply, result=rec.result,
                                       error=error_info(rec.error)))
            # In the same transaction as the terminal result: announced once, like it.
            evt = outcome_event(rec)
            if evt is not None:
                self.put_event(tx, *evt)
            return out

        results = self.send(build)
        return results[-1] if results else None

    # -- events ---------------------------------------------------------------------------

    def put_event(self, tx: Tx, kind: str, data: dict[str, Any]) -> Event:
        evt = Event(device=self.device, kind=kind,  # type: ignore[arg-type]
                    seq=tx.next_seq("evt"), ts=utc_now(), data=data)
        tx.put(self.topics.event(self.device, kind), evt.to_payload())
        return evt

    def event(self, kind: str, data: dict[str, Any]) -> None:
        """Persist and publish one event (QoS 1, through the outbox like results)."""
        def build(tx: Tx) -> list[Result]:
            self.put_event(tx, kind, data)
            return []

        self.send(build)


def outcome_event(rec: JobRecord) -> tuple[str, dict[str, Any]] | None:
    """model_committed / model_rolled_back for a finished job whose outcome changed (or kept,
    after a failed check) the active model; None for every other ending."""
    res = rec.result or {}
    kind = {"committed": "model_committed", "rolled_back": "model_rolled_back"}.get(
        str(res.get("outcome")))
    if kind is None or not rec.terminal:
        return None
    data = {"job_id": rec.id, "job_type": rec.type, "status": job_status(rec)}
    data.update({k: res[k] for k in ("model", "previous_model", "reason", "metrics_before",
                                     "metrics_after", "uploaded") if res.get(k) is not None})
    return kind, data


def _progress(job_id: str, p: dict[str, Any] | None) -> dict[str, Any] | None:
    if not p:
        return None
    try:
        return JobProgress.model_validate({**p, "id": job_id}).model_dump(exclude_none=True)
    except Exception:  # a progress shape the contract does not know: keep the stage only
        return {"id": job_id, "stage": str(p.get("stage", "running"))}


def error_info(err: dict[str, Any] | None) -> dict[str, Any] | None:
    if not err:
        return None
    try:
        return ErrorInfo.model_validate(
            {k: err[k] for k in ("code", "message", "retryable") if k in err}
        ).model_dump()
    except Exception:
        return {"code": "INTERNAL", "message": str(err)[:500], "retryable": False}
