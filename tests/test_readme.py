"""The README's promise: its first commands. (The config reference it used to carry is the
docs site's generated page now; tests/docs/test_docs.py holds it to the code.)"""

from __future__ import annotations

import re
from pathlib import Path

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_readme_starts_with_the_two_commands() -> None:
    first_block = re.search(r"```bash\n(.*?)```", README, re.S)
    assert first_block is not None
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands == ["make demo", "make test"]


def test_readme_stays_short() -> None:
    assert len(README.splitlines()) <= 250, "the README is an entry point: move detail to docs/"
