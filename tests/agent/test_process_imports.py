"""The processes a device starts most often import neither torch nor numpy until their work
needs them: the daemon, ``agentctl``'s parser and each step child's module as it starts (a
test run starts ~400 of them; numpy and the spool's modules were 0.1-0.25 CPU-s of each start:
``python benchmarks/process_start.py``, case 8)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Every step module but the fine-tune's, whose child trains (torch) on data the worker
# snapshots from the spool (numpy) as the step starts.
STEPS = ("pull", "stage", "health", "export", "evaluate", "switch", "commit", "upload",
         "personalize")

PROBE = (
    "import importlib, json, sys\n"
    "found = {}\n"
    "for name in sys.argv[1:]:\n"
    "    importlib.import_module(name)\n"
    "    if name == 'agent.cli':\n"
    "        sys.modules[name].build_parser()\n"
    "    found[name] = sorted({m.split('.')[0] for m in sys.modules} & {'numpy', 'torch'})\n"
    "print(json.dumps(found))\n"
)


def test_the_daemon_agentctl_and_the_step_children_start_without_numpy_or_torch() -> None:
    """In one process, in order: what each import added is what the next one would find, so
    the first module to pull numpy in is the one named."""
    modules = ["agent.jobs.spec", "agent.daemon.main", "agent.cli",
               *(f"agent.jobs.steps.{s}" for s in STEPS)]
    p = subprocess.run([sys.executable, "-c", PROBE, *modules], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    found = json.loads(p.stdout.strip().splitlines()[-1])
    assert found == {m: [] for m in modules}, found
