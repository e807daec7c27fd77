"""The names the contract puts in topics, file names and arguments: device ids, group names and
command ids, each checked against one pattern."""

from __future__ import annotations

import re

# Device ids and group names become topic levels and file names: no wildcards, separators or
# control characters, bounded length.
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
COMMAND_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
"""A command id: the job's store key, folder name (``jobs/ID``), log name and the worker's
``--job-id=ID``. No separators, no leading dot or dash (``..`` would be the state dir itself,
``-x`` an option to the worker), no wildcards."""


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
