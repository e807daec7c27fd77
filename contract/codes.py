"""The contract's closed vocabularies: protocol version, command types, result statuses, event
kinds and error codes. Plain names and frozensets, so any side can check a value without a
model."""

from __future__ import annotations

from typing import Literal

PROTOCOL_VERSION = 1

CommandType = Literal[
    "ping", "status", "finetune", "deploy", "rollback", "evaluate", "cancel", "set_power_mode"
]
COMMAND_TYPES: tuple[str, ...] = CommandType.__args__  # type: ignore[attr-defined]
JOB_TYPES = frozenset({"finetune", "deploy", "rollback", "evaluate"})
"""Commands that run as a queued job (one at a time); the rest are answered at once."""

ResultStatus = Literal[
    "ACCEPTED",
    "REJECTED",
    "DUPLICATE",
    "EXPIRED",
    "IN_PROGRESS",
    "SUCCEEDED",
    "FAILED",
    "CANCELED",
    "TIMED_OUT",
    "DEFERRED",
]
TERMINAL_STATUSES = frozenset(
    {"REJECTED", "EXPIRED", "SUCCEEDED", "FAILED", "CANCELED", "TIMED_OUT"}
)
"""Exactly one of these ends every command (DUPLICATE answers a repeat, not the command).

DEFERRED is none of them: the device keeps no record of a command it defers (it is busy
fine-tuning, or throttled) and asks the sender to send the same id again after the result's
``recheck_after_s``; that repeat is a new delivery, not a DUPLICATE."""
DEFER_RECHECK_S = (1.0, 3600.0)
"""Bounds of a DEFERRED result's ``recheck_after_s`` (seconds)."""

EventKind = Literal["throttle", "model_committed", "model_rolled_back", "error"]

ErrorCode = Literal[
    "BAD_JSON",  # not UTF-8 JSON, or not an object
    "TOO_LARGE",  # payload > MAX_PAYLOAD_BYTES
    "BAD_ENVELOPE",  # v/id/type/issued_at missing or wrong
    "UNSUPPORTED_VERSION",  # v is not PROTOCOL_VERSION
    "UNKNOWN_TYPE",  # the topic's {type} is not a command
    "TYPE_MISMATCH",  # envelope type differs from the topic's
    "BAD_ARGS",  # args do not validate for the type; the message names the field
    "WRONG_TARGET",  # addressed to another device or a group this device is not in
    "EXPIRED",  # expires_at is in the past when the command arrives
    "NOT_FOUND",  # cancel of an unknown job, rollback with no standby version
    "NOT_CANCELABLE",  # cancel of a job that already ended
    "UNAVAILABLE",  # the device cannot do this now (e.g. no power modes on this board)
    "JOB_FAILED",  # a step of the job failed; the message names it
    "TIMED_OUT",  # timeout_s passed
    "CANCELED",
    "INTERNAL",  # a bug: the daemon survived it, the message says what
]
RETRYABLE_CODES = frozenset({"UNAVAILABLE", "TIMED_OUT", "INTERNAL"})
