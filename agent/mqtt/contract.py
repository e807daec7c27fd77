"""The MQTT contract between a device's ``edge-agent`` and the fleet: topics and messages.

Defined once, here, as versioned pydantic models; the daemon produces and the fleet consumes
them. This module imports neither torch nor paho (the fleet controller imports it, and so does
the daemon's idle main loop), and it validates every inbound command at the boundary so a bad
payload becomes a REJECTED result with a code, never an exception in a callback.

Topics, with ``{p}`` the prefix (default ``fleet/v1``):

==================================  =====  ========  ==========================================
topic                               QoS    retained  message
==================================  =====  ========  ==========================================
``{p}/dev/{id}/status``             1      yes       :class:`Status` (also the last will)
``{p}/dev/{id}/telemetry``          0      no        :class:`Telemetry` (with message expiry)
``{p}/dev/{id}/cmd/{type}``         1      no        :class:`Command` to one device
``{p}/group/{g}/cmd/{type}``        1      no        :class:`Command` to every device in g
``{p}/dev/{id}/res``                1      no        :class:`Result`, one or more per command
``{p}/dev/{id}/evt/{kind}``         1      no        :class:`Event`
==================================  =====  ========  ==========================================

Times are RFC 3339 in UTC (``2026-11-23T05:31:00.123Z``); payloads are UTF-8 JSON.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    field_validator,
)

PROTOCOL_VERSION = 1
DEFAULT_PREFIX = "fleet/v1"
MAX_PAYLOAD_BYTES = 64 * 1024
"""Commands larger than this are REJECTED (TOO_LARGE) before they are parsed."""
TELEMETRY_EXPIRY_S = 60
"""Message Expiry Interval on telemetry: a stale reading is worse than none."""

# Device ids and group names become topic levels and file names: no wildcards, separators or
# control characters, bounded length.
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
COMMAND_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
"""A command id: the job's store key, folder name (``jobs/ID``), log name and the worker's
``--job-id=ID``. No separators, no leading dot or dash (``..`` would be the state dir itself,
``-x`` an option to the worker), no wildcards."""

CommandType = Literal[
    "ping", "status", "finetune", "deploy", "rollback", "cancel", "set_power_mode"
]
COMMAND_TYPES: tuple[str, ...] = CommandType.__args__  # type: ignore[attr-defined]
JOB_TYPES = frozenset({"finetune", "deploy", "rollback"})
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
]
TERMINAL_STATUSES = frozenset(
    {"REJECTED", "EXPIRED", "SUCCEEDED", "FAILED", "CANCELED", "TIMED_OUT"}
)
"""Exactly one of these ends every command (DUPLICATE answers a repeat, not the command)."""

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


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


def format_ts(ts: datetime) -> str:
    """RFC 3339, UTC, millisecond precision, ``Z`` suffix."""
    ts = ts.astimezone(timezone.utc)
    return ts.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ts.microsecond // 1000:03d}Z"


def check_id(value: str, what: str = "device id") -> str:
    """A device id or group name that is safe as a topic level and a file name."""
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise ValueError(
            f"{what} {value!r} is not valid: use 1-64 characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit"
        )
    return value


def check_command_id(value: str, what: str = "id") -> str:
    """A command id that is safe as a store key, a folder and file name and an argument."""
    if not isinstance(value, str) or not COMMAND_ID_RE.fullmatch(value):
        raise ValueError(
            f"{what} {value!r} is not valid: use 1-128 characters from A-Z a-z 0-9 . _ : -, "
            "starting with a letter or digit"
        )
    return value


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    def to_payload(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode()

    @classmethod
    def from_payload(cls, payload: bytes | str) -> Any:
        return cls.model_validate_json(payload)


def _aware_utc(v: datetime) -> datetime:
    if v.tzinfo is None:
        raise ValueError("timestamps need a UTC offset (RFC 3339), e.g. 2026-11-23T05:31:00Z")
    return v.astimezone(timezone.utc)


Timestamp = Annotated[
    datetime, AfterValidator(_aware_utc), PlainSerializer(format_ts, when_used="json")
]
"""Arrives timezone-aware (naive is refused), leaves as RFC 3339 UTC."""


# --- status (retained) -------------------------------------------------------------------


class ModelInfo(_Message):
    name: str
    version: str
    sequence: int | None = None
    """The registry's signed, monotonically increasing number for this model name."""
    slot: Literal["a", "b"] | None = None


class Status(_Message):
    v: Literal[1] = 1
    state: Literal["online", "offline"]
    device: str
    conn_seq: int = Field(ge=0)
    """Grows with each connection, so a late last will never hides a newer 'online'."""
    boot_id: str
    """/proc/sys/kernel/random/boot_id: tells a reboot from a reconnect."""
    agent_version: str
    model: ModelInfo | None = None
    groups: list[str] = Field(default_factory=list)
    ts: Timestamp


# --- telemetry (QoS 0, expiring) ---------------------------------------------------------


class MemInfo(_Message):
    used_mb: float
    total_mb: float


class GovernorInfo(_Message):
    state: str
    duty: float | None = None
    reason: str | None = None


class JobProgress(_Message):
    id: str
    stage: str
    """The device job's current step: pull, finetune, export, stage, health, commit, ..."""
    step: int | None = None
    total: int | None = None
    pct: float | None = None
    detail: dict[str, Any] | None = None
    """Stage-specific: governor state, memory plan, export attempt, ..."""


class Telemetry(_Message):
    v: Literal[1] = 1
    ts: Timestamp
    seq: int = Field(ge=0)
    temps_c: dict[str, float] = Field(default_factory=dict)
    power_mw: float | None = None
    mem: MemInfo | None = None
    gpu_util: float | None = None
    governor: GovernorInfo | None = None
    job: JobProgress | None = None


# --- commands ----------------------------------------------------------------------------


class Command(_Message):
    """The envelope; ``args`` are validated per type by the device (:func:`parse_command`
    checks the cheap commands' args here, the job commands' against the device's job spec)."""

    v: Literal[1] = 1
    id: str = Field(min_length=1, max_length=128)
    """Idempotency key: a repeat gets DUPLICATE and the stored status/result. 1-128 of
    ``A-Z a-z 0-9 . _ : -``, starting with a letter or digit (:data:`COMMAND_ID_RE`)."""
    type: CommandType
    issued_at: Timestamp
    expires_at: Timestamp | None = None
    """Not started after this instant: EXPIRED instead."""
    timeout_s: float | None = Field(default=None, gt=0)
    """From IN_PROGRESS to a terminal status; past it the job ends TIMED_OUT."""
    args: dict[str, Any] = Field(default_factory=dict)

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        return check_command_id(v)


class PingArgs(_Message):
    pass


class StatusArgs(_Message):
    pass


class CancelArgs(_Message):
    job_id: str = Field(min_length=1, max_length=128, pattern=COMMAND_ID_RE.pattern)
    """The id of the command whose job to cancel (queued: dropped; running: stopped at the
    next step boundary or optimizer step)."""


class SetPowerModeArgs(_Message):
    mode: str = Field(min_length=1, max_length=64)
    """A power mode name of this board (see the device profile, read from nvpmodel)."""


class RollbackArgs(_Message):
    name: str | None = None
    """Model name (default: the only installed model)."""
    reason: str | None = Field(default=None, max_length=500)


CHEAP_ARGS: dict[str, type[_Message]] = {
    "ping": PingArgs,
    "status": StatusArgs,
    "cancel": CancelArgs,
    "set_power_mode": SetPowerModeArgs,
    "rollback": RollbackArgs,
}
"""Arg models checked here; ``finetune`` and ``deploy`` args are the device job's spec."""


# --- results and events ------------------------------------------------------------------


class ErrorInfo(_Message):
    code: ErrorCode
    message: str
    retryable: bool = False


class Result(_Message):
    v: Literal[1] = 1
    id: str
    """The command's id; ``""`` on a REJECTED for a command whose id could not be read (not
    JSON, no usable ``id``): such a command is answered but never stored."""
    device: str
    status: ResultStatus
    seq: int = Field(ge=0)
    """Per-device counter over all results: orders them across reconnects."""
    ts: Timestamp
    progress: JobProgress | None = None
    result: dict[str, Any] | None = None
    """On SUCCEEDED (and DUPLICATE of a finished command); a job's is a JobOutcome."""
    error: ErrorInfo | None = None
    stored_status: ResultStatus | None = None
    """On DUPLICATE: where the original command stands (ACCEPTED, IN_PROGRESS or its terminal
    status), so a sender that lost track (a restarted fleet controller) knows without waiting."""


class UploadInfo(_Message):
    name: str
    version: str
    parent: str | None = None


class JobOutcome(_Message):
    """What a finetune or deploy job reports on success; the fleet's ML health reads it."""

    model_config = ConfigDict(extra="allow")

    outcome: Literal["committed", "rolled_back", "unchanged"]
    reason: str | None = None
    """Why it rolled back (or stayed unchanged)."""
    metrics_before: dict[str, float] = Field(default_factory=dict)
    """Held-out device metrics of the model active before the job (e.g. eval/acc)."""
    metrics_after: dict[str, float] = Field(default_factory=dict)
    """The same metrics of the new model on the same data."""
    model: ModelInfo | None = None
    """The active model after the job."""
    previous_model: ModelInfo | None = None
    uploaded: UploadInfo | None = None

    def metric_drop(self, name: str) -> float | None:
        """before - after (positive = worse), or None when either side is missing."""
        if name in self.metrics_before and name in self.metrics_after:
            return self.metrics_before[name] - self.metrics_after[name]
        return None


class Event(_Message):
    v: Literal[1] = 1
    device: str
    kind: EventKind
    seq: int = Field(ge=0)
    ts: Timestamp
    data: dict[str, Any] = Field(default_factory=dict)


# --- topics ------------------------------------------------------------------------------


class Topics:
    """Every topic of the contract for one prefix; the only place topic strings are built."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        if not prefix or prefix.startswith("/") or prefix.endswith("/") or any(
            c in prefix for c in "+#\x00"
        ):
            raise ValueError(f"MQTT prefix {prefix!r}: no leading/trailing '/', no + # NUL")
        self.prefix = prefix

    def status(self, device: str) -> str:
        return f"{self.prefix}/dev/{device}/status"

    def telemetry(self, device: str) -> str:
        return f"{self.prefix}/dev/{device}/telemetry"

    def command(self, device: str, type_: str) -> str:
        return f"{self.prefix}/dev/{device}/cmd/{type_}"

    def group_command(self, group: str, type_: str) -> str:
        return f"{self.prefix}/group/{group}/cmd/{type_}"

    def result(self, device: str) -> str:
        return f"{self.prefix}/dev/{device}/res"

    def event(self, device: str, kind: str) -> str:
        return f"{self.prefix}/dev/{device}/evt/{kind}"

    # Subscription filters.
    def device_commands(self, device: str) -> str:
        return f"{self.prefix}/dev/{device}/cmd/+"

    def group_commands(self, group: str) -> str:
        return f"{self.prefix}/group/{group}/cmd/+"

    def all_status(self) -> str:
        return f"{self.prefix}/dev/+/status"

    def all_results(self) -> str:
        return f"{self.prefix}/dev/+/res"

    def all_telemetry(self) -> str:
        return f"{self.prefix}/dev/+/telemetry"

    def all_events(self) -> str:
        return f"{self.prefix}/dev/+/evt/+"

    def parse(self, topic: str) -> tuple[str, str, str | None]:
        """``(kind, device_or_group, sub)``: kind is status | telemetry | cmd | group_cmd |
        res | evt; sub is the command type or event kind. ValueError for a foreign topic."""
        head = self.prefix + "/"
        if not topic.startswith(head):
            raise ValueError(f"topic {topic!r} is not under {self.prefix!r}")
        parts = topic[len(head):].split("/")
        match parts:
            case ["dev", dev, ("status" | "telemetry" | "res") as kind]:
                return kind, dev, None
            case ["dev", dev, "cmd", type_]:
                return "cmd", dev, type_
            case ["dev", dev, "evt", kind]:
                return "evt", dev, kind
            case ["group", group, "cmd", type_]:
                return "group_cmd", group, type_
        raise ValueError(f"topic {topic!r} is not part of the contract")


# --- inbound command validation ----------------------------------------------------------


class CommandRejected(Exception):
    """A command that fails validation; ``command_id`` is set when the id could be read, so the
    REJECTED result can name it."""

    def __init__(self, code: str, message: str, command_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.command_id = command_id


def _field_errors(e: ValidationError, root: str = "") -> str:
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err["loc"])
        path = f"{root}.{loc}" if root and loc else (root or loc or "(payload)")
        parts.append(f"{path}: {err['msg']}")
    more = len(e.errors()) - 5
    return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")


def _guess_id(obj: Any) -> str | None:
    """The id of a command that failed validation, when it is one a record may be keyed on."""
    cid = obj.get("id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) and COMMAND_ID_RE.fullmatch(cid) else None


def parse_command(payload: bytes, topic_type: str, now: datetime | None = None) -> Command:
    """Validate one inbound command as the device sees it on ``.../cmd/{topic_type}``.

    Raises :class:`CommandRejected` with a code and a message naming the field. Expiry is
    checked last so an expired command still has a readable id for its EXPIRED result.
    """
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise CommandRejected(
            "TOO_LARGE", f"payload is {len(payload)} bytes; the limit is {MAX_PAYLOAD_BYTES}"
        )
    try:
        obj = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CommandRejected("BAD_JSON", f"payload is not UTF-8 JSON: {e}") from None
    if not isinstance(obj, dict):
        raise CommandRejected("BAD_JSON", "payload must be a JSON object")
    cid = _guess_id(obj)
    if topic_type not in COMMAND_TYPES:
        raise CommandRejected(
            "UNKNOWN_TYPE",
            f"unknown command type {topic_type!r}; known: {', '.join(COMMAND_TYPES)}",
            cid,
        )
    if obj.get("v") != PROTOCOL_VERSION:
        raise CommandRejected(
            "UNSUPPORTED_VERSION",
            f"v={obj.get('v')!r}: this device speaks v={PROTOCOL_VERSION}",
            cid,
        )
    try:
        cmd = Command.model_validate(obj)
    except ValidationError as e:
        raise CommandRejected("BAD_ENVELOPE", _field_errors(e), cid) from None
    if cmd.type != topic_type:
        raise CommandRejected(
            "TYPE_MISMATCH",
            f"type {cmd.type!r} does not match the topic's cmd/{topic_type}",
            cmd.id,
        )
    arg_model = CHEAP_ARGS.get(cmd.type)
    if arg_model is not None:
        try:
            arg_model.model_validate(cmd.args)
        except ValidationError as e:
            raise CommandRejected("BAD_ARGS", _field_errors(e, "args"), cmd.id) from None
    if cmd.expires_at is not None and cmd.expires_at <= (now or utc_now()):
        raise CommandRejected(
            "EXPIRED", f"expired at {format_ts(cmd.expires_at)}", cmd.id
        )
    return cmd


def error_from_validation(e: ValidationError, root: str = "args") -> ErrorInfo:
    """BAD_ARGS for a job spec that does not validate, naming the field."""
    return ErrorInfo(code="BAD_ARGS", message=_field_errors(e, root))
