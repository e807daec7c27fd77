"""Strict pydantic models: their validation errors told one per line, and what each field means.

Unknown keys are errors (``extra="forbid"``), and every error is reported with its dotted
field path and a hint (:func:`format_errors`): a manifest, a training config, a device
profile, a job file all read the same way. Torch-free, like the rest of the registry.

A model documents each field with the string under it (the house style); ``--help`` and the
documentation site read that text with :func:`field_docs` when they need it, one parse per
source file. pydantic's ``use_attribute_docstrings`` would read it too, but as each class is
created, in every process that imports the model: on Python < 3.13 it walks the call stack and
tokenizes every class, ~0.1 CPU-s in each process that imports the job models (every step of a
device job is one), for text only ``--help`` shows.
"""

from __future__ import annotations

import ast
import difflib
import functools
import inspect
import itertools
import sys
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError


class StrictModel(BaseModel):
    # The string under each field says what it means: `hpc-train config-docs` and the docs
    # read it (field_docs).
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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


def _strings_under_fields(body: list[ast.stmt]) -> dict[str, str]:
    """``name: T`` (or ``name: T = ...``) directly followed by a string: name -> the string."""
    found: dict[str, str] = {}
    for stmt, nxt in itertools.pairwise(body):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            found[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return found


@functools.lru_cache(maxsize=128)
def _classes_in(path: str) -> dict[str, dict[str, str]]:
    """Every class defined in the file at ``path`` (nested ones by dotted name, as
    ``__qualname__`` names them): its fields' strings. Unreadable: none."""
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return {}
    classes: dict[str, dict[str, str]] = {}

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                classes[prefix + node.name] = _strings_under_fields(node.body)
                visit(node.body, f"{prefix}{node.name}.")

    visit(tree.body, "")
    return classes


def _own_strings(cls: type) -> dict[str, str]:
    path = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return _classes_in(path).get(cls.__qualname__, {}) if path else {}


def field_docs(model: type[BaseModel]) -> dict[str, str]:
    """Each field of ``model`` -> what it means: its ``Field(description=...)`` where it has one,
    else the string under it in the source of the nearest class of ``model``'s bases that
    declares it, else ``""`` (a model made by ``create_model`` has no source: give its fields a
    description)."""
    strings: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if isinstance(cls, type) and issubclass(cls, BaseModel) and cls is not BaseModel:
            strings.update(_own_strings(cls))
    return {name: field.description or strings.get(name, "")
            for name, field in model.model_fields.items()}
