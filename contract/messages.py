"""The contract's messages as versioned pydantic models: :class:`Status`, :class:`Telemetry`,
:class:`Command` (and the arg models of the commands answered at once), :class:`Result`
(with :class:`JobOutcome`, what a job reports) and :class:`Event`.

Every model refuses unknown fields; payloads are UTF-8 JSON (:meth:`Message.to_payload`,
:meth:`Message.from_payload`), times RFC 3339 in UTC (:data:`~contract.times.Timestamp`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from contract.codes import DEFER_RECHECK_S, CommandType, ErrorCode, EventKind, ResultStatus
from contract.ids import COMMAND_ID_RE, check_command_id
from contract.times import Timestamp


class Message(BaseModel):
    """The base of every message: unknown fields refused, JSON bytes in and out."""

    model_config = ConfigDict(extra="forbid")

    def to_payload(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode()

    @classmethod
    def from_payload(cls, payload: bytes | str) -> Any:
        return cls.model_validate_json(payload)


# --- status (retained) -------------------------------------------------------------------


class ModelInfo(Message):
    name: str
    version: str
    sequence: int | None = None
    """The registry's signed, monotonically increasing number for this model name."""
    slot: Literal["a", "b"] | None = None


class Status(Message):
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


class MemInfo(Message):
    used_mb: float
    total_mb: float


class GovernorInfo(Message):
    state: str
    duty: float | None = None
    reason: str | None = None


class ServingInfo(Message):
    """The application's serving of one model on the device (every serving process summed;
    latency the worst process's, over its last window)."""

    version: str | None = None
    processes: int = Field(ge=0)
    requests: int = Field(ge=0)
    """Since each process started serving."""
    failed: int = Field(ge=0)
    window_requests: int = Field(ge=0)
    p50_ms: float | None = None
    p99_ms: float | None = None
    slo_ms: float | None = None


class JobProgress(Message):
    id: str
    stage: str
    """The device job's current step: pull, finetune, export, stage, health, commit, ..."""
    step: int | None = None
    total: int | None = None
    pct: float | None = None
    detail: dict[str, Any] | None = None
    """Stage-specific: governor state, memory plan, export attempt, ..."""


class Telemetry(Message):
    v: Literal[1] = 1
    ts: Timestamp
    seq: int = Field(ge=0)
    temps_c: dict[str, float] = Field(default_factory=dict)
    power_mw: float | None = None
    mem: MemInfo | None = None
    gpu_util: float | None = None
    governor: GovernorInfo | None = None
    job: JobProgress | None = None
    serving: dict[str, ServingInfo] | None = Field(default=None, max_length=64)
    """Model name -> how the application serves it (absent: nothing serving)."""


# --- commands ----------------------------------------------------------------------------


class Command(Message):
    """The envelope; ``args`` are validated per type by the device
    (:func:`~contract.validation.parse_command` checks the cheap commands' args, the job
    commands' are checked against the device's job spec)."""

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


class PingArgs(Message):
    pass


class StatusArgs(Message):
    pass


class CancelArgs(Message):
    job_id: str = Field(min_length=1, max_length=128, pattern=COMMAND_ID_RE.pattern)
    """The id of the command whose job to cancel (queued: dropped; running: stopped at the
    next step boundary or optimizer step)."""


class SetPowerModeArgs(Message):
    mode: str = Field(min_length=1, max_length=64)
    """A power mode name of this board (see the device profile, read from nvpmodel)."""


class RollbackArgs(Message):
    name: str | None = None
    """Model name (default: the only installed model)."""
    reason: str | None = Field(default=None, max_length=500)


CHEAP_ARGS: dict[str, type[Message]] = {
    "ping": PingArgs,
    "status": StatusArgs,
    "cancel": CancelArgs,
    "set_power_mode": SetPowerModeArgs,
    "rollback": RollbackArgs,
}
"""Arg models checked at the boundary; ``finetune`` and ``deploy`` args are the device job's
spec."""


# --- results and events ------------------------------------------------------------------


class ErrorInfo(Message):
    code: ErrorCode
    message: str
    retryable: bool = False


class Result(Message):
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
    recheck_after_s: float | None = Field(
        default=None, ge=DEFER_RECHECK_S[0], le=DEFER_RECHECK_S[1])
    """On DEFERRED only, and required there: send the same command again after this many
    seconds (1 to 3600). ``error`` (code UNAVAILABLE) says why the device is busy."""

    @model_validator(mode="after")
    def _deferred(self) -> Result:
        if self.status == "DEFERRED" and self.recheck_after_s is None:
            raise ValueError("recheck_after_s: required on a DEFERRED result (1 to 3600 s)")
        if self.status != "DEFERRED" and self.recheck_after_s is not None:
            raise ValueError(f"recheck_after_s: only a DEFERRED result carries it, "
                             f"not {self.status}")
        return self


class UploadInfo(Message):
    name: str
    version: str
    parent: str | None = None


class JobOutcome(Message):
    """What a finetune or deploy job reports on success; the fleet's ML health reads it."""

    model_config = ConfigDict(extra="allow")

    outcome: Literal["committed", "rolled_back", "unchanged"]
    reason: str | None = None
    """Why it rolled back (or stayed unchanged)."""
    metrics_before: dict[str, float] = Field(default_factory=dict)
    """Held-out device metrics of the model active before the job (e.g. eval/acc)."""
    metrics_after: dict[str, float] = Field(default_factory=dict)
    """The same metrics of the new model on the same data."""
    gate_metric: str | None = Field(default=None, max_length=64)
    """The key of metrics_before/after the device's gates compare, its model's task's metric
    (eval/acc for a classifier, eval/map for a detector); null from an agent that predates
    it, whose models were classifiers (eval/acc)."""
    model: ModelInfo | None = None
    """The active model after the job."""
    previous_model: ModelInfo | None = None
    uploaded: UploadInfo | None = None

    def metric_drop(self, name: str) -> float | None:
        """before - after (positive = worse), or None when either side is missing."""
        if name in self.metrics_before and name in self.metrics_after:
            return self.metrics_before[name] - self.metrics_after[name]
        return None


class Event(Message):
    v: Literal[1] = 1
    device: str
    kind: EventKind
    seq: int = Field(ge=0)
    ts: Timestamp
    data: dict[str, Any] = Field(default_factory=dict)
