"""The README's promises: its first commands, and a config reference that matches the code."""

from __future__ import annotations

import re
from pathlib import Path

from hpc_core.config import reference_markdown

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_readme_starts_with_the_two_commands() -> None:
    first_block = re.search(r"```bash\n(.*?)```", README, re.S)
    assert first_block is not None
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands == ["make demo", "make test"]


def test_config_reference_is_in_sync() -> None:
    block = README.split("<!-- config-docs:start -->\n")[1].split("<!-- config-docs:end -->")[0]
    assert block.strip() == reference_markdown().strip(), "run: hpc-train config-docs"
