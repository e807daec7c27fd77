"""``reference/cli/*``: every command line, walked from its argparse parser.

The console scripts are read from pyproject.toml's ``[project.scripts]``; each entry point's
module is asked for ``build_parser()`` (and, where ``main()`` dispatches a command before it,
``subcommand_parsers()``), so moving a module moves nothing here. ``python -m`` tools are
named in :data:`MODULE_COMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import re
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

from refgen import GENERATED_NOTE, ROOT
from refgen.text import block, code, md_text, slug

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib  # type: ignore[no-redef]

MODULE_COMMANDS: list[tuple[str, str]] = [
    ("python -m registry.serve", "registry.serve"),
    ("python -m exporters", "exporters"),
]
"""``python -m`` tools: (command, module); a package's ``__main__`` is asked for
``build_parser``."""


def console_scripts(root: Path = ROOT) -> dict[str, str]:
    """``[project.scripts]`` of pyproject.toml: command -> ``module:function``."""
    with (root / "pyproject.toml").open("rb") as f:
        return dict(tomllib.load(f)["project"]["scripts"])


def _call_builder(builder: Callable[..., argparse.ArgumentParser],
                  prog: str) -> argparse.ArgumentParser:
    params = inspect.signature(builder).parameters
    return builder(prog) if params else builder()


def command_parsers() -> list[tuple[str, argparse.ArgumentParser,
                                    dict[str, argparse.ArgumentParser]]]:
    """(command, its parser, the commands its main dispatches before that parser) for every
    console script and every :data:`MODULE_COMMANDS` entry."""
    found: list[tuple[str, str]] = []
    for script, target in console_scripts().items():
        found.append((script, target.split(":")[0]))
    for command, module in MODULE_COMMANDS:
        spec = importlib.util.find_spec(module)
        if spec is None:
            raise RuntimeError(f"{command}: no module {module}")
        found.append((command, f"{module}.__main__" if spec.submodule_search_locations
                      else module))
    out = []
    for command, module_name in found:
        module = importlib.import_module(module_name)
        builder = getattr(module, "build_parser", None)
        if builder is None:
            raise RuntimeError(f"{command}: {module_name} has no build_parser(); the CLI "
                               "reference reaches every parser through it")
        extra = getattr(module, "subcommand_parsers", None)
        out.append((command, _call_builder(builder, command), extra() if extra else {}))
    return out


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str,
                                                                     argparse.ArgumentParser]]:
    """(name, help, parser) of each sub-command, aliases once."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            seen: set[int] = set()
            for name, sub in action.choices.items():
                if id(sub) in seen:
                    continue
                seen.add(id(sub))
                yield name, helps.get(name, ""), sub


def _formatter(parser: argparse.ArgumentParser) -> argparse.HelpFormatter:
    return parser._get_formatter()


def _raw(parser: argparse.ArgumentParser) -> bool:
    return issubclass(parser.formatter_class, argparse.RawDescriptionHelpFormatter)


def _prose(text: str, raw: bool) -> list[str]:
    """Paragraphs; a raw-formatted text with indented lines (examples) stays preformatted."""
    text = textwrap.dedent(text).strip("\n")
    if raw and any(line[:1].isspace() for line in text.splitlines()):
        return block(text)
    return [md_text(para) + "\n" for para in re.split(r"\n\s*\n", text) if para.strip()]


def _expand(parser: argparse.ArgumentParser, text: str) -> str:
    """``%(prog)s`` as argparse itself fills it in."""
    return text.replace("%(prog)s", parser.prog)


def _default(action: argparse.Action) -> str:
    d = action.default
    if d is None or d is argparse.SUPPRESS or isinstance(action, (
            argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction,
            argparse._VersionAction, argparse._CountAction)):
        return ""
    if isinstance(d, (list, tuple)) and not d:
        return ""
    if isinstance(d, Path):
        d = str(d)
    return code(str(d)) if not isinstance(d, str) else code(d) if d else '`""`'


def _options(parser: argparse.ArgumentParser) -> list[str]:
    fmt = _formatter(parser)
    out: list[str] = []
    for group in parser._action_groups:
        rows = []
        for action in group._group_actions:
            if action.help is argparse.SUPPRESS or isinstance(
                    action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            invocation = fmt._format_action_invocation(action)
            meaning = fmt._expand_help(action) if action.help else ""
            if action.choices is not None and not isinstance(action.choices, dict):
                listed = ", ".join(str(c) for c in action.choices)
                if listed not in meaning:
                    meaning = f"{meaning} (one of: {listed})".strip()
            if action.required and action.option_strings:
                meaning = f"required. {meaning}".strip()
            rows.append(f"| {code(invocation)} | {_default(action)} | {md_text(meaning)} |")
        if not rows:
            continue
        title = f"**{md_text(group.title or 'options')}**"
        if group.description:
            title += f": {md_text(group.description)}"
        out += [title, "", "| option | default | meaning |", "|---|---|---|", *rows, ""]
    return out


def _command_section(name: str, parser: argparse.ArgumentParser, level: int,
                     summary: str) -> list[str]:
    out = [f"{'#' * min(level, 6)} `{name}`", ""]
    if parser.description:
        out += _prose(_expand(parser, parser.description), _raw(parser))
    elif summary:
        out += [md_text(summary), ""]
    out += block(parser.format_usage().removeprefix("usage: ").strip())
    subs = list(_subcommands(parser))
    if subs:
        out += ["| command | what it does |", "|---|---|"]
        out += [f"| [{code(f'{name} {n}')}](#{slug(f'{name} {n}')}) | {md_text(h)} |"
                for n, h, _ in subs]
        out.append("")
    out += _options(parser)
    if parser.epilog:
        out += _prose(_expand(parser, parser.epilog), _raw(parser))
    for sub_name, sub_help, sub in subs:
        out += _command_section(f"{name} {sub_name}", sub, level + 1, sub_help)
    return out


def cli_page(command: str, parser: argparse.ArgumentParser,
             extra: dict[str, argparse.ArgumentParser]) -> str:
    out = [GENERATED_NOTE, "", f"# {command}", ""]
    out.append(f"Every option of `{command}`, from its argparse definition; "
               f"`{command} --help` prints the same.\n")
    body = _command_section(command, parser, 2, "")
    body[0] = f"## `{command}`"
    out += body
    for sub_name, sub in extra.items():
        out += _command_section(f"{command} {sub_name}", sub, 2, "")
    return "\n".join(out).rstrip() + "\n"


def cli_pages() -> dict[str, str]:
    pages: dict[str, str] = {}
    index = [GENERATED_NOTE, "", "# Command lines", "",
             "Generated from the argparse parsers at build time: the console scripts of "
             "`pyproject.toml` (`[project.scripts]`) and the `python -m` tools.", "",
             "| command | what it is |", "|---|---|"]
    for command, parser, extra in command_parsers():
        path = f"reference/cli/{slug(command.removeprefix('python -m '))}.md"
        pages[path] = cli_page(command, parser, extra)
        first = (parser.description or "").strip().split("\n\n")[0]
        index.append(f"| [{code(command)}]({Path(path).name}) | {md_text(first)} |")
    pages["reference/cli/index.md"] = "\n".join(index) + "\n"
    return pages
