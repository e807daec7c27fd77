"""Times in the contract: RFC 3339 in UTC with millisecond precision
(``2026-11-23T05:31:00.123Z``); a timestamp without a UTC offset is refused."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated

from pydantic import AfterValidator, PlainSerializer


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


def format_ts(ts: datetime) -> str:
    """RFC 3339, UTC, millisecond precision, ``Z`` suffix."""
    ts = ts.astimezone(timezone.utc)
    return ts.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ts.microsecond // 1000:03d}Z"


def _aware_utc(v: datetime) -> datetime:
    if v.tzinfo is None:
        raise ValueError("timestamps need a UTC offset (RFC 3339), e.g. 2026-11-23T05:31:00Z")
    return v.astimezone(timezone.utc)


Timestamp = Annotated[
    datetime, AfterValidator(_aware_utc), PlainSerializer(format_ts, when_used="json")
]
"""Arrives timezone-aware (naive is refused), leaves as RFC 3339 UTC."""
