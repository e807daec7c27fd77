"""The documentation: the site builds strictly, its generated reference matches the code, and
every command block marked runnable in README.md and docs/ runs.

A runnable block is a fenced block right after a ``<!-- runnable -->`` line (blank lines
between are allowed): each runs as one ``bash -euo pipefail`` script from the repository root,
with the environment's console scripts on PATH, and must exit 0 within its timeout
(docs/contributing.md).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from hpc_core.config import reference_markdown

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MARKER = "<!-- runnable -->"
RUNNABLE = re.compile(r"^<!-- runnable -->[ \t]*\n(?:[ \t]*\n)*```[^\n]*\n(.*?)^```", re.S | re.M)
BLOCK_TIMEOUT_S = 180
"""A hang's bound, not a speed test: the longest block (a detector's one-step run from a local
weights file) takes ~30 s on an idle core and twice that beside the rest of the suite."""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    bin_dir = str(Path(sys.executable).parent)  # hpc-train, agentctl, ... of this environment
    env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH")] if p)
    env.pop("COLUMNS", None)
    env["NO_MKDOCS_2_WARNING"] = "1"
    return env


def _hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_reference",
                                                  DOCS / "hooks" / "reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(p for p in DOCS.rglob("*.md")
                                        if "hooks" not in p.relative_to(DOCS).parts)]


def _runnable_blocks() -> list[tuple[str, str]]:
    blocks = []
    for path in _markdown_files():
        text = path.read_text()
        for m in RUNNABLE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            blocks.append((f"{path.relative_to(ROOT)}:{line}", m.group(1)))
    return blocks


BLOCKS = _runnable_blocks()


def test_site_builds_strictly(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = _env()
    env.pop("PYTHONPATH")  # as `make docs` runs it: the hook itself puts this checkout first
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
         "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (f"mkdocs build --strict failed:\n{r.stdout[-3000:]}\n"
                               f"{r.stderr[-6000:]}")
    for page in ("index.html", "tutorial/demo.html", "reference/cli/hpc-train.html",
                 "reference/cli/edge-agent.html", "reference/config/training.html",
                 "reference/mqtt-contract.html", "reference/oip.html",
                 "explanation/threats.html", "benchmarks/index.html"):
        assert (site / page).is_file(), page
    # every console script (and python -m tool) has its generated page, sub-commands included
    hook = _hook()
    for command in [*hook.console_scripts(), *(c for c, _ in hook.MODULE_COMMANDS)]:
        page = site / "reference/cli" / f"{hook.slug(command.removeprefix('python -m '))}.html"
        assert page.is_file(), f"no CLI reference page for {command}"
    html = (site / "reference/cli/fleetctl.html").read_text()
    assert "fleetctl rollout create" in html and "--max-metric-drop" in html
    assert "edge-agent validate" in (site / "reference/cli/edge-agent.html").read_text()
    assert "rolled_back" in (site / "reference/job-state-machine.html").read_text()
    # the config reference on the site is the code's: a key and its default, as rendered
    training = (site / "reference/config/training.html").read_text()
    assert "global_batch_size" in training and "max_nan_rollbacks" in training


def test_training_config_page_is_the_code_reference() -> None:
    hook = _hook()
    page = hook.training_config_page()
    block = page.split(hook.CONFIG_START + "\n")[1].split(hook.CONFIG_END)[0]
    assert block.strip() == reference_markdown().strip(), "the generated page drifted"


def test_every_runnable_marker_has_its_block() -> None:
    markers = sum(len(re.findall(rf"^{MARKER}[ \t]*$", p.read_text(), re.M))
                  for p in _markdown_files())
    assert markers == len(BLOCKS), "a <!-- runnable --> line not followed by a fenced block"
    assert len(BLOCKS) >= 5


def test_readme_links_into_the_docs_resolve() -> None:
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(((?!https?:|#|mailto:)[^)#\s]+)", text)
    assert links
    for link in links:
        assert (ROOT / link).exists(), f"README links to {link}, which does not exist"


@pytest.mark.parametrize("where, script", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_runnable_block(where: str, script: str) -> None:
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, env=_env(),
                       stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=BLOCK_TIMEOUT_S)
    assert r.returncode == 0, (f"{where}: exit {r.returncode}\n{script}\n"
                               f"stdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-3000:]}")
