"""The reference pages of the documentation, generated from the code at build time.

mkdocs loads this module as a hook (``hooks:`` in mkdocs.yml); :func:`on_files` adds every page
of :func:`pages` to the site, so the reference cannot drift from what the commands, models and
contract really are:

- ``reference/cli/*``: every command line, walked from the argparse parsers. The console
  scripts are read from pyproject.toml's ``[project.scripts]`` and each entry point's module
  is asked for ``build_parser()`` (and, where ``main()`` dispatches a command before it,
  ``subcommand_parsers()``), so moving a module moves nothing here; ``python -m`` tools are
  named in :data:`MODULE_COMMANDS`.
- ``reference/config/*``: every configuration file and job model, from the pydantic models
  (field types, defaults and the docstring under each field); the training config is
  ``hpc_core.config.reference_markdown()`` itself (tests/docs checks it).
- ``reference/mqtt-contract.md``: topics, messages and codes from the ``contract`` package.
- ``reference/oip.md``: the Open Inference Protocol endpoints ``agentctl serve`` answers.
- ``reference/job-state-machine.md``: the device job's transitions, from ``agent.jobs.machine``.

Anything the generator cannot place (a script without ``build_parser``, a topic row that no
``Topics`` method builds) raises, which fails the build.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

HOOKS = Path(__file__).resolve().parent
ROOT = HOOKS.parents[1]


def checkout_first() -> None:
    """Import the packages from the checkout this site is built from, ahead of any installed
    copy (mkdocs restores sys.path after loading a hook, so this runs at build time too)."""
    for path in (str(ROOT), str(HOOKS)):
        if path not in sys.path:
            sys.path.insert(0, path)
    import hpc_core

    where = Path(hpc_core.__file__).resolve()
    if ROOT not in where.parents:
        raise RuntimeError(f"hpc_core was imported from {where}, not from {ROOT}")


checkout_first()

from refgen.cli import MODULE_COMMANDS, cli_pages, console_scripts  # noqa: E402
from refgen.contract import contract_page, oip_page  # noqa: E402
from refgen.jobs import job_machine_page  # noqa: E402
from refgen.models import CONFIG_END, CONFIG_START, config_pages, training_config_page  # noqa: E402
from refgen.text import slug  # noqa: E402

__all__ = ["CONFIG_END", "CONFIG_START", "MODULE_COMMANDS", "console_scripts", "on_files",
           "pages", "slug", "training_config_page"]


def pages() -> dict[str, str]:
    """Every generated page: path under docs/ -> Markdown."""
    checkout_first()
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # usage lines wrap the same on every terminal
    try:
        out = cli_pages()
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    out.update(config_pages())
    out["reference/mqtt-contract.md"] = contract_page()
    out["reference/oip.md"] = oip_page()
    out["reference/job-state-machine.md"] = job_machine_page()
    return out


IMAGES = {"img/governor.png": "benchmarks/out/governor.png"}
"""Figures the benchmarks write outside docs/: site path -> repository path."""


def on_files(files: Any, config: Any) -> Any:
    """mkdocs hook: add the generated pages (and the benchmarks' figures) to the site."""
    from mkdocs.structure.files import File

    for path, content in pages().items():
        existing = files.get_file_from_path(path)
        if existing is not None:
            raise RuntimeError(f"docs/{path} is generated: remove the file")
        files.append(File.generated(config, path, content=content))
    for path, source in IMAGES.items():
        files.append(File.generated(config, path, abs_src_path=str(ROOT / source)))
    return files


if __name__ == "__main__":  # python docs/hooks/reference.py OUT_DIR: the pages, to read
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "site-reference")
    generated = pages()
    for rel, text in generated.items():
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        (target / rel).write_text(text)
    print(f"{len(generated)} pages in {target}")
