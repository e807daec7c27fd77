"""Command-line flags derived from a pydantic job model: one source of truth for a job's knobs.

Every scalar field of the model (and of its nested section models) becomes a flag named after
its path (``recovery.steps`` -> ``--recovery-steps``), its help is the field's docstring, its
type and choices come from the annotation. A field may rename its flag or opt out through
``json_schema_extra`` (see :func:`flag`). Every job command also takes ``--config job.yaml``
(read with the same YAML 1.2 loader as training configs) and ``--set a.b=c``; precedence is
file < flags < ``--set``.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Union

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from hpc_core.config import ConfigError, apply_overrides, read_yaml
from registry.validation import field_docs, format_errors

DEST_PREFIX = "job:"
OFF = ("off", "none", "null")


class _Off:
    """What ``--flag off`` parses to: argparse's None already means "flag not given"."""


_OFF = _Off()


def flag(
    name: str | None = None, *, each_choice: bool = False, skip: bool = False, text: bool = False
) -> dict[str, Any]:
    """``json_schema_extra`` for a field: ``name`` renames its flag (``calib`` -> ``--calib``),
    ``each_choice`` gives a Literal field one switch per value (``--int8 | --fp16``), ``skip``
    leaves it to ``--config`` / ``--set``, ``text`` passes a section model its string form
    (``--prune 2:4``: the model parses it)."""
    return {"cli": {"name": name, "each_choice": each_choice, "skip": skip, "text": text}}


def _strip_optional(ann: Any) -> tuple[Any, bool]:
    if typing.get_origin(ann) in (Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return ann, False


def _leaves(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> Iterator[
    tuple[tuple[str, ...], FieldInfo, Any, bool, str]
]:
    """(path, field, bare annotation, optional, what it means) of every scalar field, depth
    first."""
    docs = field_docs(model)
    for name, field in model.model_fields.items():
        ann, optional = _strip_optional(field.annotation)
        if _cli(field).get("text"):
            yield (*prefix, name), field, str, optional, docs[name]
            continue
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            if not optional:
                yield from _leaves(ann, (*prefix, name))
            continue  # an optional section (e.g. data: DataConfig | None) is --config/--set only
        if ann in (int, float, str, bool, Path) or typing.get_origin(ann) is Literal:
            yield (*prefix, name), field, ann, optional, docs[name]


def _cli(field: FieldInfo) -> dict[str, Any]:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    return dict(extra.get("cli") or {})  # type: ignore[call-overload]


def flag_of(path: tuple[str, ...], field: FieldInfo) -> str:
    return "--" + (_cli(field).get("name") or "-".join(path).replace("_", "-"))


def _converter(ann: Any, optional: bool) -> Any:
    # Paths stay text here (pydantic makes them Paths): Path("http://h/x") would lose a slash.
    base = str if ann is Path else ann

    def convert(text: str) -> Any:
        if optional and text.lower() in OFF:
            return _OFF
        try:
            return base(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {base.__name__}" + (" or 'off'" if optional else "") + f", got {text!r}"
            ) from None

    convert.__name__ = base.__name__  # argparse names the type in its error messages
    return convert


def _help(field: FieldInfo, doc: str, optional: bool) -> str:
    text = " ".join(doc.split())
    default = field.get_default(call_default_factory=False)
    if default is not None and not field.is_required() and not isinstance(default, bool):
        text += f" (default {default})"
    if optional:
        text += " ('off' for none)"
    return text.replace("%", "%%")


def add_job_arguments(
    p: argparse.ArgumentParser, model: type[BaseModel], *, config_help: str | None = None
) -> None:
    """``--config``, ``--set`` and one flag per scalar field of ``model``."""
    io = p.add_argument_group("job file")
    io.add_argument(
        "--config",
        type=Path,
        metavar="FILE.yaml",
        help=config_help or f"job file with {model.__name__} fields; flags and --set override it",
    )
    io.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one field, e.g. --set gates.batch_size=8 (repeatable; YAML values)",
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for path, field, ann, optional, doc in _leaves(model):
        cli = _cli(field)
        if cli.get("skip"):
            continue
        section = path[0] if len(path) > 1 else "job"
        g = groups.get(section) or groups.setdefault(section, p.add_argument_group(section))
        dest = DEST_PREFIX + ".".join(path)
        if typing.get_origin(ann) is Literal and cli.get("each_choice"):
            ex = g.add_mutually_exclusive_group()
            for value in typing.get_args(ann):
                ex.add_argument(f"--{value}", dest=dest, action="store_const", const=value,
                                help=f"{path[-1]} = {value}")
            continue
        name = flag_of(path, field)
        if ann is bool:
            on = field.get_default() is not True
            flag_name = name if on else "--no-" + name.removeprefix("--")
            # A --no-X flag turns off what the field's text describes: say so first.
            what = _help(field, doc, False)
            g.add_argument(flag_name, dest=dest, action="store_const", const=on, default=None,
                           help=what if on else f"skip this (done by default): {what}")
            continue
        kwargs: dict[str, Any] = {"dest": dest, "default": None,
                                  "help": _help(field, doc, optional)}
        if typing.get_origin(ann) is Literal:
            kwargs["choices"] = list(typing.get_args(ann))
        else:
            kwargs["type"] = _converter(ann, optional)
            kwargs["metavar"] = path[-1].upper()
        g.add_argument(name, **kwargs)


def _set(tree: dict[str, Any], path: list[str], value: Any) -> None:
    for part in path[:-1]:
        tree = tree.setdefault(part, {})
    tree[path[-1]] = str(value) if isinstance(value, Path) else value


def job_tree(args: argparse.Namespace) -> dict[str, Any]:
    """The job as a dict: the ``--config`` file, then the flags given, then ``--set``."""
    tree: dict[str, Any] = read_yaml(args.config) if args.config is not None else {}
    for dest, value in vars(args).items():
        if dest.startswith(DEST_PREFIX) and value is not None:
            _set(tree, dest.removeprefix(DEST_PREFIX).split("."), None if value is _OFF else value)
    return apply_overrides(tree, list(args.overrides))


def flag_of_path(model: type[BaseModel], loc: tuple[Any, ...]) -> str | None:
    for path, field, _ann, _opt, _doc in _leaves(model):
        if path == tuple(str(x) for x in loc):
            return flag_of(path, field)
    return None


def validate_job(model: type[BaseModel], tree: dict[str, Any], source: str) -> Any:
    """The validated job, or ConfigError listing each error with its field path (and the flag
    that sets a missing field)."""
    try:
        return model.model_validate(tree)
    except ValidationError as e:
        lines = format_errors(e, model)
        for err in e.errors():
            if err["type"] == "missing":
                name = flag_of_path(model, tuple(err["loc"]))
                field = ".".join(map(str, err["loc"]))
                if name:
                    lines.append(f"  {name} is required (or set {field} in --config)")
        raise ConfigError(source, lines) from None
