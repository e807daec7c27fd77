"""Inbound command validation: :func:`parse_command` checks every command at the boundary, so
a bad payload becomes a REJECTED result with a code, never an exception in a callback."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from contract.codes import COMMAND_TYPES, PROTOCOL_VERSION
from contract.errors import CommandRejected, field_errors
from contract.ids import COMMAND_ID_RE
from contract.messages import CHEAP_ARGS, Command
from contract.times import format_ts, utc_now

MAX_PAYLOAD_BYTES = 64 * 1024
"""Commands larger than this are REJECTED (TOO_LARGE) before they are parsed."""


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
        raise CommandRejected("BAD_ENVELOPE", field_errors(e), cid) from None
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
            raise CommandRejected("BAD_ARGS", field_errors(e, "args"), cmd.id) from None
    if cmd.expires_at is not None and cmd.expires_at <= (now or utc_now()):
        raise CommandRejected(
            "EXPIRED", f"expired at {format_ts(cmd.expires_at)}", cmd.id
        )
    return cmd
