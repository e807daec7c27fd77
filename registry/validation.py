"""Strict pydantic models, and their validation errors told one per line.

Unknown keys are errors (``extra="forbid"``), and every error is reported with its dotted
field path and a hint (:func:`format_errors`): a manifest, a training config, a device
profile, a job file all read the same way. Torch-free, like the rest of the registry.
"""

from __future__ import annotations

import difflib
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError


class StrictModel(BaseModel):
    # Field docstrings become descriptions: they feed `hpc-train config-docs` and the README.
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True
    )


def _model_at(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class that owns the field at ``loc[:-1]``."""
    model: type[BaseModel] = root
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        ann = _section(getattr(field, "annotation", None))
        if ann is None:
            return None
        model = ann
    return model


def _section(annotation: Any) -> type[BaseModel] | None:
    """The config model a field holds: ``X`` for ``X`` and for an optional ``X | None``."""
    for a in (annotation, *typing.get_args(annotation)):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def format_errors(err: ValidationError, root: type[BaseModel]) -> list[str]:
    """One line per error of ``err`` (raised validating ``root``): its dotted path, what is
    wrong and a hint (the closest known key, the value given)."""
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        path = ".".join(str(p) for p in loc) or "(top level)"
        kind = e["type"]
        msg = e["msg"].removeprefix("Value error, ")
        hint = ""
        if kind == "extra_forbidden":
            owner = _model_at(root, loc)
            known = list(owner.model_fields) if owner else []
            close = difflib.get_close_matches(str(loc[-1]), known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
            msg = "unknown key"
        elif kind == "missing":
            hint = "add this field"
        elif (
            kind.endswith("_parsing")
            or kind.endswith("_type")
            or kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal")
        ):
            hint = f"got {e.get('input')!r}"
        lines.append(f"  {path}: {msg}" + (f" ({hint})" if hint else ""))
    return lines
