"""The names a command may give: each becomes a folder name under one of the device's own
roots (data_root, the state dir, the registry), so none may be a path."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator

from registry.names import check_model_name, check_version

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""A name a command gives for something the device keeps under a root of its own."""


def _name(v: str) -> str:
    if not NAME_RE.fullmatch(v):
        raise ValueError(
            f"{v!r} is not a name: 1-128 of A-Z a-z 0-9 . _ -, starting with a letter or "
            "digit; a command names things under the device's own folders, never a path"
        )
    return v


Name = Annotated[str, AfterValidator(_name)]
# The registry's own rules: both become folder names in the state dir and the registry.
ModelName = Annotated[str, AfterValidator(check_model_name)]
Version = Annotated[str, AfterValidator(check_version)]
