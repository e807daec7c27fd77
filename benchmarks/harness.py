"""What every script in benchmarks/ shares: the ``--quick`` flag and the final verdict line.

Not a benchmark itself (tests/benchmarks lists it as a helper). A script imports it after
putting the repository first on ``sys.path``::

    REPO = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(REPO))  # before benchmarks/ itself: benchmarks/agent.py and
                                   # benchmarks/fleet.py would shadow the packages
    from benchmarks.harness import parse_args, verdict

``parse_args(ap, quick={...})`` adds ``--quick``: tiny sizes and few repeats, the same code
path as the full run (only sizes, repeats and rounds shrink): seconds for most scripts, about
a minute for those that chain fresh torch processes (a whole device job, an ONNX export). A
flag given on the command line still wins over a quick default. The quick run proves the
script runs end to end; its figures mean nothing.

``verdict(...)`` prints the script's last line, one format for every script::

    verdict: <what> <value><unit> (target <op> <target><unit>): met|MISSED[; ...]

e.g. ``verdict: Trainer / plain loop median step time ratio 1.017x (target <= 1.030x): met``.
:data:`VERDICT` matches it.
"""

from __future__ import annotations

import argparse
import math
import operator
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt, "==": operator.eq,
}
VERDICT = re.compile(
    r"^verdict: (?P<what>.+) (?P<value>-?(?:[\d.]+|nan|inf))(?P<unit>[^\s()]*) "
    r"\(target (?P<op><=|>=|<|>|==) (?P<target>-?[\d.]+(?:e[-+]?\d+)?)(?P=unit)\): "
    r"(?P<met>met|MISSED)(?:; .*)?$")
"""The verdict line; a script prints exactly one, last."""
QUICK_HELP = ("tiny sizes and few repeats: the same code path as the full run, ending with "
              "the same verdict line; it proves the script runs (its figures mean nothing)")


def parse_args(ap: argparse.ArgumentParser, quick: dict[str, Any],
               argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``ap``'s arguments plus ``--quick``, which sets the defaults in ``quick`` (dest ->
    value) before the command line is read."""
    ap.add_argument("--quick", action="store_true", help=QUICK_HELP)
    known, _ = ap.parse_known_args(argv)
    if known.quick:
        ap.set_defaults(**quick)
    return ap.parse_args(argv)


def fmt(v: float) -> str:
    """Three decimals below 10 (a 1.03 target needs them), fewer above."""
    if not math.isfinite(v):
        return str(v)
    a = abs(v)
    return f"{v:.0f}" if a >= 1000 else f"{v:.1f}" if a >= 10 else f"{v:.3f}"


def meets(value: float, op: str, target: float) -> bool:
    """``value op target``, and never for a NaN or infinite value."""
    if op not in OPS:
        raise ValueError(f"op {op!r}: one of {', '.join(OPS)}")
    return math.isfinite(value) and OPS[op](value, target)


def verdict(what: str, value: float, op: str, target: float, unit: str = "x", *,
            also: Sequence[tuple[str, bool]] = (), note: str = "") -> bool:
    """Print the verdict line: ``what``'s ``value`` beside its target (``value op target``),
    then ``note`` and, where the script has more targets (``also``: (name, met) each), how
    many of them all were met. Returns whether the headline target was met."""
    if any(c.isspace() or c in "()" for c in unit):
        raise ValueError(f"unit {unit!r}: no spaces or parentheses")
    met = meets(value, op, target)
    line = (f"verdict: {what} {fmt(value)}{unit} (target {op} {target:g}{unit}): "
            f"{'met' if met else 'MISSED'}")
    if note:
        line += f"; {note}"
    if also:
        missed = [name for name, ok in also if not ok]
        total = len(also) + 1
        n_met = total - len(missed) - (0 if met else 1)
        line += f"; {n_met}/{total} targets met"
        if missed:
            shown = ", ".join(missed[:4]) + (f" and {len(missed) - 4} more"
                                             if len(missed) > 4 else "")
            line += f" (also missed: {shown})"
    print(line, flush=True)
    return met


def cpu_line() -> str:
    """This host's CPU model and the flags INT8 and vector speed depend on, for a report."""
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    has = {"AVX2": "avx2" in flags, "AVX-512F": "avx512f" in flags,
           "AVX-512 VNNI": "avx512_vnni" in flags, "AVX-VNNI": "avx_vnni" in flags}
    shown = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in has.items())
    return f"CPU: {model} ({os.cpu_count()} logical CPUs visible); {shown}"
