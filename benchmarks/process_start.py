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
   it is created (on Python < 3.13 it walks the stack and tokenizes the class);
6. the collector: a process that trained (torch, a small CNN, two AdamW steps, as a probe
   or a fine-tune) and the worker, each whole, with
   ``registry.lifetime.skip_startup_and_exit_collections()`` first (what every entry point
   calls: no full collections while the imports grow the heap, none at exit) beside the same
   process with CPython's defaults;
7. a process that exports a small CNN to ONNX twice (the dynamo exporter, as an export step
   does), with the exporter's torchlib functions listed reading each op's domain
   (``exporters.onnx_export.list_torchlib_ops_without_parsing``) beside onnxscript's own
   listing, which re-parses ~500 functions' source on every export;
8. the daemon's imports, a stage child's and ``agentctl``'s parser, each beside the same with
   the spool's index (and numpy with it) imported first, as every process that read a job
   spec did until the index was imported only where a submitted spool is counted (the two
   interleaved, one process each in turn).

Targets: the worker's imports (every job starts one, and its steps' children import the same
models) cost at most 0.9x the baseline's CPU; a process that trained costs at most 0.9x the
defaults' CPU with the start-up's and the exit's collections skipped; the two exports cost at
most 0.95x the baseline's CPU with each op's domain read (most of such a process is its
imports: torch, torch._dynamo, onnxscript); the daemon's imports cost at most 0.8x with the
spool's index left out.

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
TRAIN = ("import torch; from torch import nn; torch.manual_seed(0); "
         "m = nn.Sequential(nn.Conv2d(1, 16, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 14 * 14, "
         "10)); opt = torch.optim.AdamW(m.parameters()); x = torch.randn(32, 1, 16, 16); "
         "y = torch.randint(0, 10, (32,))\n"
         "for _ in range(2):\n"
         "    opt.zero_grad(); nn.functional.cross_entropy(m(x), y).backward(); opt.step()")
"""A process that trained: torch, torch._dynamo (the optimizer's), a model and two steps."""
EXPORT = ("import tempfile; from pathlib import Path; import torch; from torch import nn; "
          "from exporters.onnx_export import export_onnx; torch.manual_seed(0); "
          "m = nn.Sequential(nn.Conv2d(1, 16, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 14 * 14, "
          "10))\n"
          "with tempfile.TemporaryDirectory() as d:\n"
          "    for i in range(2):\n"
          "        export_onnx(m, Path(d) / f'{i}.onnx', (1, 16, 16))")
"""A process that exports twice (the dynamo exporter), as an export step does (the float graph,
then the part INT8 quantizes)."""
ONNXSCRIPT_LISTING = "import exporters.onnx_export as e; e._listing_installed = False; "
"""The baseline: the listing marked as not installable, so the exporter lists its torchlib
functions its own way (onnxscript's ``get_torchlib_ops``, on every export)."""
SKIP = ("from registry.lifetime import skip_startup_and_exit_collections; "
        "skip_startup_and_exit_collections(); ")
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
    "trained, the collector's defaults": TRAIN,
    "trained, start-up and exit collections skipped": SKIP + TRAIN,
    "agent.jobs.worker, start-up and exit collections skipped":
        SKIP + "import agent.jobs.worker",
    "two ONNX exports, onnxscript's listing each time": ONNXSCRIPT_LISTING + EXPORT,
    "two ONNX exports, the op's domain read": EXPORT,
}
SPOOL_FIRST = "import agent.spool.index; "
"""The baseline of case 8: the spool's index (numpy with it) imported first, as the job spec
imported it."""
LIGHT = {"the daemon": "import agent.daemon.main",
         "a stage child": "import agent.jobs.steps.stage",
         "agentctl's parser": "import agent.cli; agent.cli.build_parser()"}
"""Case 8, each measured interleaved with its baseline (a fraction of a second apart, so the
host's drift between them is small)."""
TARGET = 0.9
EXIT_TARGET = 0.9
EXPORT_TARGET = 0.95
DAEMON_TARGET = 0.8


def cpu_of(code: str, python: str = sys.executable) -> float:
    """User + system CPU seconds of one fresh ``python -c CODE`` run from the repository
    (``python``: this interpreter unless another is given)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([python, "-c", code], cwd=REPO, check=True)
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
    print(f"{'what a fresh process imports':<56} {'CPU s (median)':>14} {'min':>7} {'max':>7}")
    for name, code in CASES.items():
        runs = [cpu_of(code) for _ in range(a.repeats)]
        median[name] = statistics.median(runs)
        print(f"{name:<56} {fmt(median[name]):>14} {fmt(min(runs)):>7} {fmt(max(runs)):>7}")
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
    ratios = {}
    defaults = {"trained": "trained, the collector's defaults",
                "agent.jobs.worker": "agent.jobs.worker (torch-free)"}  # the same process
    for what, default_key in defaults.items():
        default = median[default_key]
        skipped = median[f"{what}, start-up and exit collections skipped"]
        ratios[what] = skipped / default
        print(f"{what}, whole process: collections skipped / defaults {fmt(ratios[what])}x "
              f"(saved {fmt(default - skipped)} CPU s a process)")
    listed = (median["two ONNX exports, the op's domain read"]
              / median["two ONNX exports, onnxscript's listing each time"])
    print(f"two ONNX exports, whole process: the op's domain read / onnxscript's listing "
          f"{fmt(listed)}x")
    light = {}
    for k, code in LIGHT.items():
        first, now = [], []
        for _ in range(a.repeats):
            first.append(cpu_of(SPOOL_FIRST + code))
            now.append(cpu_of(code))
        light[k] = statistics.median(now) / statistics.median(first)
        print(f"{k}: {fmt(statistics.median(now))} CPU s as now, "
              f"{fmt(statistics.median(first))} with the spool's index first: {fmt(light[k])}x")
    worker = median["agent.jobs.worker (torch-free)"]
    verdict("the worker's import CPU, docs read when asked / read as created",
            worker / median["agent.jobs.worker, docs read as created"], "<=", TARGET,
            also=[(f"a trained process's CPU, collections skipped <= {EXIT_TARGET}x",
                   ratios["trained"] <= EXIT_TARGET),
                  (f"two ONNX exports' CPU, the op's domain read <= {EXPORT_TARGET}x",
                   listed <= EXPORT_TARGET),
                  (f"the daemon's import CPU, the spool's index left out <= {DAEMON_TARGET}x",
                   light["the daemon"] <= DAEMON_TARGET)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
