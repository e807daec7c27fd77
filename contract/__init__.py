"""The MQTT contract between a device's ``edge-agent`` and the fleet: topics and messages.

Defined once, in this package, as versioned pydantic models; the daemon produces and the fleet
consumes them. The package imports neither torch nor paho (the fleet controller imports it, and
so does the daemon's idle main loop), nor anything of ``agent``, ``fleet``, ``hpc_core``,
``exporters`` or ``registry`` (``lint-imports`` holds it to that), and it validates every
inbound command at the boundary so a bad payload becomes a REJECTED result with a code, never
an exception in a callback.

==========================  =================================================================
module                      what it holds
==========================  =================================================================
:mod:`contract.topics`      the topic table (QoS, retained, expiry) and :class:`Topics`
:mod:`contract.messages`    Status, Telemetry, Command and its args, Result, JobOutcome, Event
:mod:`contract.codes`       protocol version, command types, result statuses, event kinds,
                            error codes
:mod:`contract.ids`         device ids, group names and command ids, and their checks
:mod:`contract.times`       RFC 3339 UTC timestamps
:mod:`contract.validation`  :func:`parse_command`, the inbound check, and the payload limit
:mod:`contract.errors`      :class:`CommandRejected` and how a failed validation is worded
==========================  =================================================================

Every public name is importable from here: ``from contract import Topics, Result``.
Times are RFC 3339 in UTC (``2026-11-23T05:31:00.123Z``); payloads are UTF-8 JSON.
"""

from __future__ import annotations

from contract.codes import (
    COMMAND_TYPES,
    DEFER_RECHECK_S,
    JOB_TYPES,
    PROTOCOL_VERSION,
    RETRYABLE_CODES,
    TERMINAL_STATUSES,
    CommandType,
    ErrorCode,
    EventKind,
    ResultStatus,
)
from contract.errors import CommandRejected, error_from_validation
from contract.ids import COMMAND_ID_RE, check_command_id, check_id
from contract.messages import (
    CHEAP_ARGS,
    CancelArgs,
    Command,
    ErrorInfo,
    Event,
    GovernorInfo,
    JobOutcome,
    JobProgress,
    MemInfo,
    Message,
    ModelInfo,
    PingArgs,
    Result,
    RollbackArgs,
    ServingInfo,
    SetPowerModeArgs,
    Status,
    StatusArgs,
    Telemetry,
    UploadInfo,
)
from contract.times import Timestamp, format_ts, utc_now
from contract.topics import DEFAULT_PREFIX, TELEMETRY_EXPIRY_S, Topics
from contract.validation import MAX_PAYLOAD_BYTES, parse_command

__all__ = [
    "CHEAP_ARGS",
    "COMMAND_ID_RE",
    "COMMAND_TYPES",
    "DEFAULT_PREFIX",
    "DEFER_RECHECK_S",
    "JOB_TYPES",
    "MAX_PAYLOAD_BYTES",
    "PROTOCOL_VERSION",
    "RETRYABLE_CODES",
    "TELEMETRY_EXPIRY_S",
    "TERMINAL_STATUSES",
    "CancelArgs",
    "Command",
    "CommandRejected",
    "CommandType",
    "ErrorCode",
    "ErrorInfo",
    "Event",
    "EventKind",
    "GovernorInfo",
    "JobOutcome",
    "JobProgress",
    "MemInfo",
    "Message",
    "ModelInfo",
    "PingArgs",
    "Result",
    "ResultStatus",
    "RollbackArgs",
    "ServingInfo",
    "SetPowerModeArgs",
    "Status",
    "StatusArgs",
    "Telemetry",
    "Timestamp",
    "Topics",
    "UploadInfo",
    "check_command_id",
    "check_id",
    "error_from_validation",
    "format_ts",
    "parse_command",
    "utc_now",
]
