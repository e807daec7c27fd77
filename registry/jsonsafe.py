"""Strict JSON for documents that come from outside (manifests, signatures, headers).

``json.loads`` alone accepts what a hostile server can turn into a crash or a hang: nesting
deep enough to raise ``RecursionError``, integers with a million digits (quadratic to parse
on Python 3.10), ``NaN``/``1e999``, and duplicate keys (two parsers may pick different
values). Each of these is refused here with a :class:`MalformedJsonError` naming the problem.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from typing import Any

from registry.errors import MalformedJsonError

MAX_DEPTH = 32
"""Deepest nesting of arrays and objects; manifests need 4."""
MAX_NUMBER_CHARS = 40
"""Longest number literal; an int64 has at most 20 characters."""

_STRING_RE = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = bytes.maketrans(b"", b"")
_DELTA = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def nesting_depth(data: bytes) -> int:
    """Deepest bracket nesting, ignoring brackets inside strings; never recurses."""
    outside = _STRING_RE.sub(b'""', data)
    brackets = outside.translate(_BRACKETS, delete=bytes(set(range(256)) - set(_DELTA)))
    return max(itertools.accumulate(_DELTA[b] for b in brackets), default=0)


def _number(text: str, kind: str) -> str:
    if len(text) > MAX_NUMBER_CHARS:
        raise MalformedJsonError(
            f"a {kind} literal of {len(text)} characters (at most {MAX_NUMBER_CHARS})"
        )
    return text


def _parse_int(text: str) -> int:
    return int(_number(text, "number"))


def _parse_float(text: str) -> float:
    value = float(_number(text, "number"))
    if not math.isfinite(value):
        raise MalformedJsonError(f"number {text} overflows to {value}")
    return value


def _parse_constant(name: str) -> Any:
    raise MalformedJsonError(f"{name} is not JSON (only finite numbers are accepted)")


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise MalformedJsonError(f"key {key[:64]!r} appears twice in one object")
        out[key] = value
    return out


def loads_strict(data: bytes, source: str, *, max_bytes: int | None = None) -> Any:
    """Parse ``data`` or raise MalformedJsonError (``source`` names it in the message)."""
    if max_bytes is not None and len(data) > max_bytes:
        raise MalformedJsonError(f"{source}: {len(data)} bytes, over the {max_bytes}-byte limit")
    depth = nesting_depth(data)
    if depth > MAX_DEPTH:
        raise MalformedJsonError(f"{source}: nested {depth} levels deep (at most {MAX_DEPTH})")
    try:
        return json.loads(
            data, object_pairs_hook=_object, parse_int=_parse_int, parse_float=_parse_float,
            parse_constant=_parse_constant,
        )
    except MalformedJsonError as e:
        raise MalformedJsonError(f"{source}: {e}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        # RecursionError cannot happen after the depth check; kept so no input ever escapes.
        raise MalformedJsonError(f"{source}: not valid JSON: {e}") from None
