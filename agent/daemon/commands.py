"""One inbound command, from MQTT or the control socket: validate, persist, answer, hand off.

Runs on paho's network thread, so it never blocks on a job: a job command is stored QUEUED
and the runner is woken; a cheap command (ping, status, cancel, set_power_mode) is answered
here in milliseconds. Every outcome is a :class:`~contract.Result`; nothing raises out of
:meth:`CommandHandler.handle` (a bug becomes REJECTED INTERNAL).

The ``id`` is the idempotency key across both stores: jobs live in the job store, every other
command (and every rejection of a non-job command) in the ledger's ``commands`` table
(:mod:`agent.daemon.ledger`, in the outbox database), so a repeat gets DUPLICATE with where
the original stands (until the record is pruned: ``limits.keep_*``).

A job command's args are the job's allow-list resolved against this device's own settings
(:func:`~agent.daemon.jobspec.resolve_command_args`): trust and paths come from agent.yaml,
never from the command. At most ``limits.max_queued_jobs`` jobs wait; one more is REJECTED and
not stored. A ``deploy`` from the fleet that arrives while the device fine-tunes or throttles
is answered DEFERRED, not stored either (:mod:`agent.daemon.deferral`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from agent.daemon.announce import Announcer, error_info, job_status
from agent.daemon.config import LimitsConfig
from agent.daemon.deferral import defer_reason
from agent.daemon.jobspec import resolve_command_args
from agent.jobs.resolve import DeviceSettings
from agent.jobs.store import JobStore, QueueFull
from agent.mqtt.outbox import Tx
from contract import (
    JOB_TYPES,
    CancelArgs,
    Command,
    CommandRejected,
    Result,
    SetPowerModeArgs,
    error_from_validation,
    parse_command,
)

log = logging.getLogger("agent.daemon")


class CommandHandler:
    def __init__(
        self, store: JobStore, announcer: Announcer, *,
        status: Callable[[], dict[str, Any]],
        cancel: Callable[[str], tuple[str, dict[str, Any] | None]],
        set_power_mode: Callable[[str], tuple[str, dict[str, Any]]],
        wake_runner: Callable[[], None],
        settings: DeviceSettings, limits: LimitsConfig,
    ) -> None:
        self.store = store
        self.ann = announcer
        self._status = status
        self._cancel = cancel
        self._set_power_mode = set_power_mode
        self._wake = wake_runner
        self._settings = settings
        self._max_queued = limits.max_queued_jobs
        self._recheck_s = limits.defer_recheck_s

    # -- entry point ----------------------------------------------------------------------

    def handle(
        self, payload: bytes, topic_type: str, *, source: str = "mqtt",
        reply: dict[str, Any] | None = None, wrong_target: str | None = None,
        bad_envelope: str | None = None,
    ) -> list[Result]:
        """``wrong_target``/``bad_envelope``: why the transport already condemned this command
        (another device's topic, an unusable response topic); it is REJECTED with that."""
        try:
            return self._handle(payload, topic_type, source, reply, wrong_target, bad_envelope)
        except Exception as e:  # the daemon survives its own bugs and says so
            log.exception("command on cmd/%s failed inside the daemon", topic_type)
            error = {"code": "INTERNAL", "message": f"{type(e).__name__}: {e}"[:500],
                     "retryable": True}
            try:
                self.ann.event("error", {"what": f"command on cmd/{topic_type} failed inside "
                                         "the daemon", "error": error})
            except Exception:
                log.exception("error event not stored")
            return self.ann.send(lambda tx: [self.ann.put_result(
                tx, "", "REJECTED", reply=reply, record=False, error=error)])

    def _handle(
        self, payload: bytes, topic_type: str, source: str, reply: dict[str, Any] | None,
        wrong_target: str | None, bad_envelope: str | None,
    ) -> list[Result]:
        try:
            cmd = parse_command(payload, topic_type)
        except CommandRejected as e:
            return self._refuse(e, topic_type, source, reply)
        try:
            if wrong_target:
                raise CommandRejected("WRONG_TARGET", wrong_target)
            if bad_envelope:
                raise CommandRejected("BAD_ENVELOPE", bad_envelope)
            spec = (resolve_command_args(cmd.type, cmd.args, self._settings)
                    if cmd.type in JOB_TYPES else None)
        except CommandRejected as e:
            e.command_id = cmd.id
            return self._refuse(e, topic_type, source, reply)
        except ValidationError as e:
            err = error_from_validation(e)
            return self._refuse(CommandRejected(err.code, err.message, cmd.id), topic_type,
                                source, reply)
        dup = self._duplicate(cmd.id, reply)
        if dup is not None:
            return dup
        if spec is not None:
            return self._submit_job(cmd, spec, source, reply)
        return self._cheap(cmd, reply)

    # -- refusals and duplicates ----------------------------------------------------------

    def _refuse(
        self, e: CommandRejected, topic_type: str, source: str, reply: dict[str, Any] | None
    ) -> list[Result]:
        status = "EXPIRED" if e.code == "EXPIRED" else "REJECTED"
        error = {"code": e.code, "message": e.message, "retryable": False}
        cid = e.command_id
        if cid is None:  # nothing to key it on: answer, keep no record
            return self.ann.send(lambda tx: [self.ann.put_result(
                tx, "", status, reply=reply, error=error, record=False)])
        dup = self._duplicate(cid, reply)
        if dup is not None:
            return dup
        if topic_type in JOB_TYPES and status == "REJECTED":
            self.store.reject(cid, topic_type, error, source=source, reply=reply)

        def build(tx: Tx) -> list[Result]:
            if not (topic_type in JOB_TYPES and status == "REJECTED"):
                self.ann.ledger.record_command(tx, cid, topic_type, status, None, error)
            return [self.ann.put_result(tx, cid, status, reply=reply, error=error)]

        return self.ann.send(build)

    def _duplicate(self, cid: str, reply: dict[str, Any] | None) -> list[Result] | None:
        rec = self.store.get(cid)
        if rec is not None:
            announced = self.ann.ledger.announced(cid)
            if "ACCEPTED" not in announced and rec.state.value not in ("REJECTED",) and not (
                announced - {"ACCEPTED"}
            ):
                # Stored but never acknowledged: the daemon died inside on_message and the
                # broker redelivered. This is the original, not a repeat.
                self.ann.announce_job(rec)
                self._wake()
                return []
            stored, result, error = job_status(rec), rec.result, rec.error
        else:
            cmd = self.ann.ledger.stored_command(cid)
            if cmd is None:
                return None
            stored, result, error = cmd.status, cmd.result, cmd.error
        return self.ann.send(lambda tx: [self.ann.put_result(
            tx, cid, "DUPLICATE", reply=reply, result=result, error=error_info(error),
            stored_status=stored, record=False)])

    # -- jobs -----------------------------------------------------------------------------

    def _submit_job(
        self, cmd: Command, spec: dict[str, Any], source: str, reply: dict[str, Any] | None
    ) -> list[Result]:
        why = None if self._recheck_s is None else defer_reason(
            cmd.type, source, self._status().get("job"),
            lambda jid: rec.type if (rec := self.store.get(jid)) else None)
        if why is not None:
            # Not stored: the same id sent again after the recheck time is a new delivery.
            log.info("command %s deferred: %s", cmd.id, why)
            error = {"code": "UNAVAILABLE", "retryable": True, "message": why}
            return self.ann.send(lambda tx: [self.ann.put_result(
                tx, cmd.id, "DEFERRED", reply=reply, error=error, record=False,
                recheck_after_s=self._recheck_s)])
        stored_reply = dict(reply or {})
        if cmd.expires_at is not None:
            stored_reply["expires_at"] = cmd.expires_at.timestamp()
        try:
            rec, created = self.store.submit(
                cmd.id, cmd.type, spec, timeout_s=cmd.timeout_s, source=source,
                reply=stored_reply or None, max_queued=self._max_queued,
            )
        except QueueFull as e:
            # Not stored, so the same id is accepted once the queue has room (retryable).
            error = {"code": "UNAVAILABLE", "retryable": True,
                     "message": f"queue full: {e} (limits.max_queued_jobs)"}
            return self.ann.send(lambda tx: [self.ann.put_result(
                tx, cmd.id, "REJECTED", reply=reply, error=error, record=False)])
        if not created:  # a concurrent twin (socket and MQTT at once)
            return self._duplicate(cmd.id, reply) or []
        res = self.ann.announce_job(rec)
        self._wake()
        return [res] if res else []

    # -- cheap commands -------------------------------------------------------------------

    def _cheap(self, cmd: Command, reply: dict[str, Any] | None) -> list[Result]:
        status, result, error = "SUCCEEDED", None, None
        if cmd.type == "ping":
            result = {"pong": True, "received_ts": time.time()}
        elif cmd.type == "status":
            result = self._status()
        elif cmd.type == "cancel":
            status, error = self._cancel(CancelArgs.model_validate(cmd.args).job_id)
            result = None if error else {"job_id": cmd.args["job_id"]}
        elif cmd.type == "set_power_mode":
            status, out = self._set_power_mode(SetPowerModeArgs.model_validate(cmd.args).mode)
            result, error = (out, None) if status == "SUCCEEDED" else (None, out)

        def build(tx: Tx) -> list[Result]:
            self.ann.ledger.record_command(tx, cmd.id, cmd.type, status, result, error)
            return [self.ann.put_result(tx, cmd.id, "ACCEPTED", reply=reply),
                    self.ann.put_result(tx, cmd.id, status, reply=reply, result=result,
                                        error=error)]

        # ping and status change nothing: their answers skip the fsync (see Outbox.tx).
        return self.ann.send(build, durable=cmd.type not in ("ping", "status"))
