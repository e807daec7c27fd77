"""``reference/mqtt-contract.md`` from the ``contract`` package (the topic table checked
against what ``Topics`` builds) and ``reference/oip.md`` from ``agent.runtime.oip`` (with its
bodies, checks and gRPC service: ``oip_codec``, ``oip_request``, ``oip_grpc``)."""

from __future__ import annotations

import inspect
import re
import typing

from pydantic import BaseModel

from refgen import GENERATED_NOTE
from refgen.models import model_section
from refgen.text import md_text, rst_inline


def _rst_table(doc: str) -> list[list[str]]:
    """The rows of the first simple reST table in ``doc``, each a list of cells."""
    lines = doc.splitlines()
    rules = [i for i, line in enumerate(lines) if re.fullmatch(r"\s*=+(\s+=+)+\s*", line)]
    if len(rules) < 3:
        raise RuntimeError("no reST table found")
    spans = [m.span() for m in re.finditer(r"=+", lines[rules[0]])]
    rows: list[list[str]] = []
    for line in lines[rules[1] + 1:rules[2]]:
        cells = [line[a:b if k + 1 < len(spans) else None].strip()
                 for k, (a, b) in enumerate(spans)]
        if cells[0]:
            rows.append(cells)
        elif rows:  # a continuation line
            rows[-1] = [f"{c} {n}".strip() for c, n in zip(rows[-1], cells, strict=True)]
    return rows


PLACEHOLDERS = {"device": "{id}", "type_": "{type}", "group": "{g}", "kind": "{kind}"}


def _topic_methods() -> dict[str, str]:
    from contract import Topics

    topics = Topics("{p}")
    built: dict[str, str] = {}
    for name, fn in inspect.getmembers(Topics, inspect.isfunction):
        if name.startswith("_") or name == "parse":
            continue
        params = [p for p in inspect.signature(fn).parameters if p != "self"]
        built[name] = getattr(topics, name)(*(PLACEHOLDERS[p] for p in params))
    return built


def _codes_comments() -> dict[str, str]:
    import contract.codes

    comments: dict[str, str] = {}
    for line in inspect.getsource(contract.codes).splitlines():
        m = re.match(r'\s*"(\w+)",\s*#\s*(.*)', line)
        if m:
            comments[m.group(1)] = m.group(2).strip()
    return comments


def contract_page() -> str:
    import contract
    import contract.messages
    import contract.topics

    rows = _rst_table(contract.topics.__doc__ or "")
    built = _topic_methods()
    by_topic = {v: k for k, v in built.items()}
    out = [GENERATED_NOTE, "", "# MQTT contract", "",
           md_text(rst_inline(inspect.cleandoc(contract.__doc__ or "").split("\n\n")[0])), "",
           f"Protocol version `{contract.PROTOCOL_VERSION}` (every message's `v`); default "
           f"prefix `{contract.DEFAULT_PREFIX}`; payloads UTF-8 JSON of at most "
           f"{contract.MAX_PAYLOAD_BYTES:,} bytes; times RFC 3339 in UTC "
           "(`2026-11-23T05:31:00.123Z`). The prose around it is in "
           "[the device daemon](../explanation/daemon.md).", "",
           "## Topics", "",
           "`{p}` is the prefix. Built only by `contract.Topics` (the method in the last "
           "column).", "",
           "| topic | QoS | retained | message | `Topics` method |", "|---|---|---|---|---|"]
    documented = set()
    for topic, qos, retained, message in rows:
        pattern = topic.strip("`")
        if pattern not in by_topic:
            raise RuntimeError(f"contract.topics documents {pattern}, which no Topics method "
                               "builds")
        documented.add(pattern)
        out.append(f"| `{pattern}` | {qos} | {retained} | {md_text(rst_inline(message))} | "
                   f"`{by_topic[pattern]}` |")
    filters = {k: v for k, v in built.items() if v not in documented}
    if any("+" not in v for v in filters.values()):
        missing = [v for v in filters.values() if "+" not in v]
        raise RuntimeError(f"Topics builds {missing}, which contract.topics does not document")
    out += ["", f"Telemetry carries a Message Expiry Interval of {contract.TELEMETRY_EXPIRY_S} s."
            " Subscription filters:", "", "| filter | `Topics` method |", "|---|---|"]
    out += [f"| `{v}` | `{k}` |" for k, v in filters.items()]
    out += ["", f"Command ids match `{contract.COMMAND_ID_RE.pattern}`: the id names the "
            "job's folder on the device.", ""]

    out += ["## Codes", ""]
    comments = _codes_comments()
    out += ["### Command types", "", "| type | how it runs |", "|---|---|"]
    for t in contract.COMMAND_TYPES:
        how = ("queued job: ACCEPTED, IN_PROGRESS, then one terminal status"
               if t in contract.JOB_TYPES else "answered at once: ACCEPTED, then its terminal "
               "status")
        out.append(f"| `{t}` | {how} |")
    out += ["", "### Result statuses", "", "| status | terminal |", "|---|---|"]
    for s in typing.get_args(contract.ResultStatus):
        out.append(f"| `{s}` | {'yes' if s in contract.TERMINAL_STATUSES else ''} |")
    out += ["", "Exactly one terminal status ends every command (DUPLICATE answers a repeat, "
            "not the command; DEFERRED asks for the same id again after `recheck_after_s`).", "",
            "### Event kinds", ""]
    out += [", ".join(f"`{k}`" for k in typing.get_args(contract.EventKind)), ""]
    out += ["### Error codes", "", "| code | meaning | retryable |", "|---|---|---|"]
    for c in typing.get_args(contract.ErrorCode):
        out.append(f"| `{c}` | {md_text(comments.get(c, ''))} | "
                   f"{'yes' if c in contract.RETRYABLE_CODES else ''} |")
    out += ["", "## Messages", "",
            "Every message model of `contract.messages`; unknown fields are refused on the "
            "way in.", ""]
    for name, cls in vars(contract.messages).items():
        if (isinstance(cls, type) and issubclass(cls, BaseModel) and cls is not BaseModel
                and cls.__module__ == "contract.messages" and name in contract.__all__):
            out += model_section(cls, name, 3, expand=False)
    return "\n".join(out).rstrip() + "\n"


def oip_page() -> str:
    from agent.runtime import oip

    doc = inspect.cleandoc(oip.__doc__ or "")
    paras = doc.split("\n\n")
    endpoints: list[list[str]] = []
    for line in paras[1].splitlines():
        m = re.match(r"(GET|POST)\s+(\S+)\s*(.*)", line.strip())
        if m:
            endpoints.append([m.group(1), m.group(2), m.group(3)])
        elif endpoints:
            endpoints[-1][2] = f"{endpoints[-1][2]} {line.strip()}".strip()
    if not endpoints:
        raise RuntimeError("agent.runtime.oip lists no endpoint")
    out = [GENERATED_NOTE, "", "# Open Inference Protocol (`agentctl serve`)", "",
           md_text(paras[0]), "",
           "`agentctl serve --model NAME --port 8000` (or `--unix-socket PATH`) serves the "
           "committed model this way: see [agentctl serve](cli/agentctl.md#agentctl-serve) for "
           "its flags and examples. `tritonclient.http` works unchanged.", "",
           "## Endpoints", "", "| method | path | answer |", "|---|---|---|"]
    out += [f"| {m} | `{p}` | {md_text(rst_inline(d))} |" for m, p, d in endpoints]
    out += [""]
    for para in paras[2:]:
        out += [md_text(rst_inline(para)), ""]
    out += model_section(oip.OipLimits, "OipLimits", 2)
    out += _oip_sections()
    return "\n".join(out).rstrip() + "\n"


def _markdown(para: str) -> list[str]:
    """A docstring paragraph as Markdown: a ``- `` list item by item, else one line."""
    if not para.lstrip().startswith("- "):
        return [md_text(rst_inline(para)), ""]
    items = re.split(r"^\s*- ", para, flags=re.M)[1:]
    return [f"- {md_text(rst_inline(item))}" for item in items] + [""]


def _oip_sections() -> list[str]:
    """The bodies and their checks (``oip_codec``, ``oip_request``), then the gRPC service
    (``oip_grpc``): its method table, its notes and :class:`GrpcLimits`."""
    from agent.runtime import oip_codec, oip_grpc, oip_request

    out: list[str] = []
    for title, module in (("Request and response bodies", oip_codec),
                          ("What a request may carry", oip_request)):
        out += [f"## {title}", ""]
        for para in inspect.cleandoc(module.__doc__ or "").split("\n\n"):
            out += _markdown(para)
    paras = inspect.cleandoc(oip_grpc.__doc__ or "").split("\n\n")
    methods: list[list[str]] = []
    for line in paras[1].splitlines():
        m = re.match(r"\s*([A-Z]\w+)\s{2,}(.*)", line)
        if m:
            methods.append([m.group(1), m.group(2)])
        elif methods:
            methods[-1][1] = f"{methods[-1][1]} {line.strip()}"
    if not methods:
        raise RuntimeError("agent.runtime.oip_grpc lists no method")
    out += ["## gRPC", "", md_text(rst_inline(paras[0])), "", "| method | answer |", "|---|---|"]
    out += [f"| `{name}` | {md_text(rst_inline(text))} |" for name, text in methods]
    out += [""]
    for para in paras[2:]:
        out += _markdown(para)
    return out + model_section(oip_grpc.GrpcLimits, "GrpcLimits", 3)
