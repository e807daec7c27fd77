"""What a fresh process of the device job pays before it works: CPU seconds of its imports.

Every step of a device job runs in a process of its own (the worker, the fine-tune's set-up,
each memory probe, the fine-tune, the export, the health check), and so do ``agentctl``,
``fleetctl`` and the daemon's commands; the test suite starts ~1,400 of them. Each is measured
as a fresh interpreter (``python -c``, ``--repeats`` times, the median of its user + system
CPU from ``getrusage``), one after the other:

1. the interpreter alone;
2. the worker's imports (``agent.jobs.worker``: torch-free) and ``fleetctl``'s (``fleet.cli``);
3. ``import torch``;
4. ``import torch`` and one optimizer built: ``torch.optim`` imports ``torch._dynamo`` when an
   optimizer is made (``add_param_group`` is wrapped by ``torch._disable_dynamo``), so every
   process that trains pays it;
5. the job models (``agent.jobs.spec``: the job, fine-tune, export and evaluate models) and the
   worker with each field's documentation read as it is now, when ``--help`` asks
   (``registry.validation.field_docs``), beside the baseline: the same imports with pydantic's
   ``use_attribute_docstrings`` on for every model, which reads the source of each class as
   it is created (on Python < 3.13 it walks the stack and tokenizes the class).

Target: the worker's imports (every job starts one, and its steps' children import the same
models) cost at most 0.9x the baseline's CPU.

    python benchmarks/process_start.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # before benchmarks/ itself (see benchmarks/harness.py)

from benchmarks.harness import cpu_line, fmt, parse_args, verdict  # noqa: E402

ATTRIBUTE_DOCSTRINGS = ("import pydantic; "
                        "pydantic.BaseModel.model_config['use_attribute_docstrings'] = True; ")
"""The baseline: every model inherits BaseModel's config, so this turns the option on for all
of them, as each model's own config had it."""
CASES: dict[str, str] = {
    "interpreter": "pass",
    "agent.jobs.worker (torch-free)": "import agent.jobs.worker",
    "fleet.cli": "import fleet.cli",
    "import torch": "import torch",
    "torch + an optimizer (torch._dynamo)":
        "import torch; torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)",
    "job models, docs read when asked": "import agent.jobs.spec",
    "job models, docs read as created": ATTRIBUTE_DOCSTRINGS + "import agent.jobs.spec",
    "agent.jobs.worker, docs read as created": ATTRIBUTE_DOCSTRINGS + "import agent.jobs.worker",
}
TARGET = 0.9


def cpu_of(code: str) -> float:
    """User + system CPU seconds of one fresh ``python -c CODE`` run from the repository."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7, help="fresh processes per case (median)")
    a = parse_args(ap, {"repeats": 1})
    if a.repeats < 1:
        ap.error("--repeats must be at least 1")
    print(f"host: {cpu_line()}")
    print(f"python {sys.version.split()[0]}; command: python benchmarks/process_start.py "
          f"--repeats {a.repeats}{' --quick' if a.quick else ''}\n")
    cpu_of("pass")  # the page cache warm for the interpreter before the first figure
    median: dict[str, float] = {}
    print(f"{'what a fresh process imports':<40} {'CPU s (median)':>14} {'min':>7} {'max':>7}")
    for name, code in CASES.items():
        runs = [cpu_of(code) for _ in range(a.repeats)]
        median[name] = statistics.median(runs)
        print(f"{name:<40} {fmt(median[name]):>14} {fmt(min(runs)):>7} {fmt(max(runs)):>7}")
    dynamo = median["torch + an optimizer (torch._dynamo)"] - median["import torch"]
    print(f"\ntorch._dynamo, imported by the first optimizer: +{fmt(dynamo)} CPU s a training "
          "process")
    pairs = (("job models", "job models, docs read when asked",
              "job models, docs read as created"),
             ("worker", "agent.jobs.worker (torch-free)",
              "agent.jobs.worker, docs read as created"))
    for what, now_key, before_key in pairs:
        now, before = median[now_key], median[before_key]
        print(f"{what}: {fmt(now)} CPU s with docs read when asked, {fmt(before)} read as each "
              f"model is created (saved {fmt(before - now)} s a process)")
    worker = median["agent.jobs.worker (torch-free)"]
    verdict("the worker's import CPU, docs read when asked / read as created",
            worker / median["agent.jobs.worker, docs read as created"], "<=", TARGET)
    return 0


if __name__ == "__main__":
    sys.exit(main())
