"""Which CPython runs the project: the same work under two builds of one Python version.

Every step of a device job, every command and the whole test suite run on the interpreter
``.venv`` was made from (``make setup``: ``PYTHON``, by default the distribution's
``/usr/bin/python3``). Builds of one version differ in speed: Debian's and Ubuntu's are
compiled with profile-guided optimization and link libpython into the executable, while one
built from source without ``--enable-optimizations`` (pyenv's default) calls every function
of the interpreter through the shared library's indirections.

Each case runs as a fresh ``python -c`` process under both interpreters, in alternating order,
``--repeats`` times (the median of each one's user + system CPU from ``getrusage``). Both read
this virtual environment's packages (the other one through ``site.addsitedir``), so only the
interpreter differs:

1. pure Python: a JSON round trip of a small document, 20,000 times;
2. the job models: ``agent.jobs.spec`` imported and a device job validated 2,000 times
   (pydantic);
3. a process that trained: torch, a small CNN, two AdamW steps (``torch._dynamo`` comes with
   the first optimizer), as a memory probe or a fine-tune;
4. a process that exports a small CNN to ONNX twice (the dynamo exporter: tracing is Python).

Target: the interpreter this environment runs on costs at most 0.9x the other's CPU
(geometric mean over the cases). Run from a ``.venv`` made from a source build, the ratio is
above 1: that is the figure for moving to the other one.

    python benchmarks/interpreter.py [--other /usr/bin/python3.11] [--repeats 5]

Without ``--other`` the first interpreter of this Python version found on ``PATH`` (and
``/usr/bin``) that is another build is taken; with none, this one is compared with itself.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # before benchmarks/ itself (see benchmarks/harness.py)

from benchmarks.harness import cpu_line, fmt, parse_args, verdict  # noqa: E402
from benchmarks.process_start import EXPORT, SKIP, TRAIN, cpu_of  # noqa: E402

PURE = ("import json\n"
        "doc = {'id': 'job-1', 'steps': [{'name': n, 'status': 'done', 'outputs': {'x': 1.5}} "
        "for n in ('pull', 'finetune', 'export', 'stage', 'health')], 'tags': list(range(20))}\n"
        "for _ in range({n}):\n"
        "    json.loads(json.dumps(doc))")
MODELS = ("from agent.jobs.spec import DeviceJob\n"
          "raw = {'model': 'digits', 'version': 'v1', 'registry': 'http://127.0.0.1:8000',\n"
          "       'data': '/data/cam', 'finetune': {'profile': 'generic-x86', 'sensors': 'none',\n"
          "       'steps': 30, 'effective_batch': 16, 'budget_mb': 450},\n"
          "       'export': {'gates': {'latency_iters': 10}, 'calibration': {'samples': 128}}}\n"
          "for _ in range({n}):\n"
          "    DeviceJob.model_validate(raw)")
CASES: dict[str, str] = {
    "pure Python (JSON round trips)": PURE,
    "job models (import, validations)": MODELS,
    "a process that trained (torch, AdamW)": SKIP + TRAIN,
    "a process that exported twice (dynamo)": SKIP + EXPORT,
}
QUICK_CASES = ("pure Python (JSON round trips)", "job models (import, validations)")
"""What --quick runs (no torch process): the same code path, seconds."""
TARGET = 0.9


def describe(python: str) -> dict[str, str]:
    """An interpreter's version, its real executable and whether it loads libpython as a
    shared library (``ldd``) or has it linked in."""
    code = "import sys, os; print(sys.version.split()[0]); print(os.path.realpath(sys.executable))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    version, real = out.stdout.split()[:2]
    shared = shutil.which("ldd") is not None and "libpython" in subprocess.run(
        ["ldd", real], capture_output=True, text=True).stdout
    return {"version": version, "real": real,
            "build": "libpython as a shared library" if shared else "libpython linked in"}


def find_other() -> str | None:
    """Another build of this interpreter's version, on PATH or in /usr/bin."""
    name = f"python{sys.version_info.major}.{sys.version_info.minor}"
    mine = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    seen = {mine}
    dirs = [*os.environ.get("PATH", "").split(os.pathsep), "/usr/bin"]
    for d in dirs:
        path = Path(d) / name
        if not (path.is_file() and os.access(path, os.X_OK)):
            continue
        try:
            real = describe(str(path))["real"]
        except (subprocess.CalledProcessError, OSError):
            continue
        if real not in seen:
            return real
        seen.add(real)
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", default=None,
                    help="the interpreter to compare with (the same Python version; default: "
                         "another build found on PATH or in /usr/bin)")
    ap.add_argument("--repeats", type=int, default=5, help="fresh processes per case and "
                    "interpreter (median)")
    ap.add_argument("--loops", type=int, default=20000,
                    help="JSON round trips of the pure-Python case (validations: a tenth)")
    a = parse_args(ap, {"repeats": 1, "loops": 2000})
    if a.repeats < 1 or a.loops < 1:
        ap.error("--repeats and --loops must be at least 1")
    mine = sys.executable
    other = a.other or find_other() or mine
    me, them = describe(mine), describe(other)
    if me["version"].rsplit(".", 1)[0] != them["version"].rsplit(".", 1)[0]:
        ap.error(f"--other {other} is Python {them['version']}, this one {me['version']}: "
                 "the packages here are built for one version; give an interpreter of it")
    # The other interpreter reads this environment's packages: only the interpreter differs.
    prelude = f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r}); "
    print(f"host: {cpu_line()}")
    print(f"this environment: Python {me['version']} {me['real']} ({me['build']})")
    print(f"the other:        Python {them['version']} {them['real']} ({them['build']})"
          + (" - no other build found: compared with itself" if other == mine else ""))
    print(f"command: python benchmarks/interpreter.py --other {other} --repeats {a.repeats}"
          f"{' --quick' if a.quick else ''}\n")
    cases = {k: v for k, v in CASES.items() if not a.quick or k in QUICK_CASES}
    pure_n, models_n = a.loops, max(1, a.loops // 10)
    print(f"{'case':<44} {'this, CPU s':>12} {'other, CPU s':>13} {'ratio':>7}")
    ratios = []
    for name, template in cases.items():
        code = template.replace("{n}", str(pure_n if template is PURE else models_n))
        runs: dict[str, list[float]] = {mine: [], other: []}
        for i in range(a.repeats):  # alternate which one goes first: caches warm for both
            for python in ((mine, other) if i % 2 == 0 else (other, mine)):
                runs[python].append(cpu_of(prelude + code, python))
        this, that = statistics.median(runs[mine]), statistics.median(runs[other])
        ratios.append(this / that)
        print(f"{name:<44} {fmt(this):>12} {fmt(that):>13} {fmt(this / that):>7}")
    gmean = math.exp(statistics.fmean(math.log(r) for r in ratios))
    verdict("this environment's interpreter / the other build's CPU (geometric mean)", gmean,
            "<=", TARGET, note=f"{len(ratios)} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
