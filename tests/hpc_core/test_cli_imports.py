"""``hpc-train`` builds its parser without torch: the commands that do not train (tune's
driver, aggregate, ``--help``) start in a fraction of a second, and each command imports torch
only when it runs something that needs it."""

from __future__ import annotations

import subprocess
import sys

from tests.agent.jobs.conftest import REPO


def test_the_cli_and_its_commands_import_no_torch() -> None:
    code = ("import sys\n"
            "import hpc_core.cli, hpc_core.estimate, hpc_core.lr_find, hpc_core.train\n"
            "hpc_core.cli.build_parser()\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)
