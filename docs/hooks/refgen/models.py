"""``reference/config/*``: every configuration file and job model, from its pydantic model
(field types, defaults and the docstring under each field); the training config is
``hpc_core.config.reference_markdown()`` itself."""

from __future__ import annotations

import inspect
import json
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from refgen import GENERATED_NOTE
from refgen.text import code, md_text, toc_slug
from registry.validation import field_docs

_SCALARS = {str: "string", int: "int", float: "float", bool: "bool", Path: "path",
            type(None): "null", Any: "any"}


def type_name(ann: Any) -> str:
    """A reader's name for a field's type."""
    if ann in _SCALARS:
        return _SCALARS[ann]
    origin = typing.get_origin(ann)
    args = typing.get_args(ann)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_name(a) for a in args)
    if origin in (list, tuple, set, frozenset, dict):
        inner = ", ".join("…" if a is Ellipsis else type_name(a) for a in args)
        return f"{origin.__name__}[{inner}]" if inner else origin.__name__
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann.__name__
    if isinstance(ann, type):
        return ann.__name__
    return str(ann).replace("typing.", "")


def _models_in(ann: Any) -> list[type[BaseModel]]:
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [ann]
    found: list[type[BaseModel]] = []
    for a in typing.get_args(ann):
        for m in _models_in(a):
            if m not in found:
                found.append(m)
    return found


def _field_default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        factory = field.default_factory
        if isinstance(factory, type) and issubclass(factory, BaseModel):
            return "see below"
        try:
            value = factory()  # type: ignore[call-arg]
        except TypeError:
            return "computed"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    return code(json.dumps(value, default=str, ensure_ascii=False))


def model_section(model: type[BaseModel], title: str, level: int = 2,
                  seen: set[type[BaseModel]] | None = None, expand: bool = True,
                  path: str = "", suffix: str = "") -> list[str]:
    """``model``'s fields as a table under ``title``, then (``expand``) each nested model's
    under its dotted key path (``path`` is the table's own, empty at the top) and ``suffix``
    (which tells apart tables of one page with the same path)."""
    seen = set() if seen is None else seen
    seen.add(model)
    docs = field_docs(model)
    heading = title if path or " " in title else f"`{title}`"
    out = [f"{'#' * min(level, 6)} {heading}", ""]
    if model.__doc__ and model.__doc__ is not BaseModel.__doc__:
        out += [md_text(inspect.cleandoc(model.__doc__)), ""]
    nested: list[tuple[str, type[BaseModel]]] = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        for sub in _models_in(field.annotation):
            if expand and sub not in seen and sub not in (m for _, m in nested):
                nested.append((key, sub))
    many = {k for k, _ in nested if sum(1 for k2, _ in nested if k2 == k) > 1}
    titles = {}
    for key, sub in nested:
        sub_path = f"{path}.{key}" if path else key
        titles[sub] = (sub_path, f"`{sub_path}`" + (f" ({sub.__name__})" if key in many else "")
                       + suffix)
    out += ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        key = field.alias or name
        meaning = docs[name]
        default = _field_default(field)
        below = [titles[m][1] for m in _models_in(field.annotation) if m in titles]
        if default == "see below" and below:
            default = f"[see below](#{toc_slug(below[0])})"
        out.append(f"| `{key}` | {type_name(field.annotation)} | {default} | "
                   f"{md_text(meaning)} |")
    out.append("")
    seen.update(titles)
    for sub, (sub_path, sub_title) in titles.items():
        out += model_section(sub, sub_title, level + 1, seen, path=sub_path, suffix=suffix)
    return out


def _config_page(title: str, intro: str, sections: list[tuple[str, type[BaseModel]]],
                 path: str = "", suffixes: bool = False) -> str:
    out = [GENERATED_NOTE, "", f"# {title}", "", intro, ""]
    for section_title, model in sections:
        out += model_section(model, section_title, 2, path=path,
                             suffix=f" ({section_title.split()[0]})" if suffixes else "")
    return "\n".join(out).rstrip() + "\n"


CONFIG_START = "<!-- config-docs:start -->"
CONFIG_END = "<!-- config-docs:end -->"


def training_config_page() -> str:
    from hpc_core.config import reference_markdown

    return "\n".join([
        GENERATED_NOTE, "", "# Training config (`hpc-train`)", "",
        "The YAML that `hpc-train train`, `tune`, `lr-find`, `batch-find`, `estimate` and "
        "`torchrun -m hpc_core.train` read (`configs/digits.yaml` is one). Every key, its "
        "default and meaning, generated from `hpc_core.config` (`hpc-train config-docs` "
        "prints the same). Unknown keys are errors; `--set a.b=c` overrides any key, values "
        "parsed as YAML.", "", CONFIG_START, reference_markdown().rstrip("\n"), CONFIG_END, "",
    ])


def config_pages() -> dict[str, str]:
    from agent.daemon.config import AgentConfig
    from agent.finetune.job import FinetuneJob
    from agent.jobs import spec
    from device_profiles.schema import DeviceProfile
    from exporters.job import ExportJob
    from hpc_core.tune.search_space import SearchSpace
    from registry.manifest import Manifest
    from registry.principals import PrincipalsFile
    pages = {"reference/config/training.md": training_config_page()}
    pages["reference/config/search-space.md"] = _config_page(
        "Search space (`hpc-train tune --space`)",
        "The space file of a hyperparameter search (`configs/space_digits.yaml` is one): the "
        "study's settings and each parameter, keyed by the config path it sets.",
        [("space", SearchSpace)])
    pages["reference/config/agent.md"] = _config_page(
        "Device config (`agent.yaml`)",
        "What `edge-agent --config` and `edge-agent validate` read (`systemd/agent.example."
        "yaml` is one). Any key can be overridden from the environment as "
        "`EDGE_AGENT_A__B=value` or with `--set a.b=value`. It is the device's only source of "
        "trust and of where to talk: a command never carries a key, a registry or a path.",
        [("agent.yaml", AgentConfig)])
    pages["reference/config/device-jobs.md"] = _config_page(
        "Device job commands",
        "What each job command may carry (`args` of an MQTT command, `fleetctl send ... "
        "--args`, `fleetctl rollout create --args`, `agentctl send --args`): an allow-list "
        "per job type, unknown fields refused (`REJECTED BAD_ARGS`). Data sets and caches are "
        "*names* the device resolves under its own folders.",
        [(f"{t} args", m) for t, m in spec.COMMAND_ARGS.items()], path="args", suffixes=True)
    pages["reference/config/jobs-resolved.md"] = _config_page(
        "Device jobs as the worker runs them",
        "The resolved spec of each job type: the command's args plus what the device's "
        "`agent.yaml` decides (paths, registry, keys). `agentctl finetune` in the foreground "
        "takes the `finetune` spec's fields as flags (`--config FILE --set a.b=c` too).",
        [(f"{t} job", m) for t, m in spec.SPECS.items()], suffixes=True)
    pages["reference/config/finetune.md"] = _config_page(
        "Fine-tune job (`python -m agent.finetune`)",
        "The fine-tune on its own, outside the device job: `python -m agent.finetune` takes "
        "one flag per field (`--config FILE --set a.b=c` too). Within a device job the same "
        "fields are the `finetune` section, less the paths the job decides.",
        [("finetune", FinetuneJob)])
    pages["reference/config/export.md"] = _config_page(
        "Export job (`agentctl export`, `python -m exporters`)",
        "Prune, quantize, export and gate: one flag per field, or `--config export.yaml` "
        "with `--set` overrides. Within a device job the same sections are `export`, less "
        "its paths.",
        [("export", ExportJob)])
    from fleet.broker.config import FleetInventory
    from fleet.learn.plan import LearnPlan
    from fleet.rollout.plan import RolloutPlan
    pages["reference/config/fleet.md"] = _config_page(
        "Fleet files (`fleetctl`)",
        "The rollout plan (`fleetctl rollout create --plan rollout.yaml`; every field is "
        "also a flag, and flags override the file), the fleet-learning plan (`fleetctl learn "
        "start`) and the inventory (`fleetctl broker-config --inventory`, `--inventory` / "
        "`FLEETCTL_INVENTORY` for every command that picks devices by group).",
        [("rollout plan", RolloutPlan), ("learn plan", LearnPlan),
         ("inventory", FleetInventory)])
    pages["reference/config/device-profile.md"] = _config_page(
        "Device profile",
        "One YAML per board in `device_profiles/` (`agentctl profiles` lists them): memory "
        "budget, power modes, thermal limits, precision, TensorRT features and the "
        "thermal/power plant estimate the simulator and the governor use.",
        [("profile", DeviceProfile)])
    pages["reference/config/registry.md"] = _config_page(
        "Registry files",
        "A version's signed `manifest.json` (what `hpc-train publish` and `agentctl upload` "
        "write and every pull verifies), and the principals file of `python -m "
        "registry.serve --principals` (what `add-principal` appends to).",
        [("manifest.json", Manifest), ("principals file", PrincipalsFile)])
    return pages
