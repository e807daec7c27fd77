"""Check a verified manifest against its model spec in a short-lived child process.

The check builds the spec's module on torch's meta device, and importing torch costs a
process ~200 MB it never gives back. The daemon and the job worker live for weeks on a
device with a few GB: they must stay torch-free, so the torch part runs in
``python -m hpc_core.model_spec check`` and only its verdict comes back. The module is named
by string, never imported here (import-linter holds ``agent.storage`` torch-free).

A pass is remembered for the life of the process: the verdict depends only on the spec and
the tensors' names, dtypes and shapes, which a new version of the same model (a fine-tune, a
retrain) almost always keeps - so the daemon pays for torch once per model layout, not once
per version.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path

from registry.errors import SpecMismatchError
from registry.manifest import Manifest

log = logging.getLogger("agent.storage")

CHILD_MODULE = "hpc_core.model_spec"
CHECK_TIMEOUT_S = 600.0
"""Importing torch takes 10-20 s on a loaded Jetson; a child past this is stuck (a custom
factory that hangs), and the version is refused rather than waited on."""


def _child_env() -> dict[str, str]:
    """The child resolves imports as this process does: a custom model factory (allowed with
    --allow-custom-model) must be found on the same path."""
    env = dict(os.environ)
    path = [p or os.getcwd() for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
    return env


_PASSED: OrderedDict[str, None] = OrderedDict()
_PASSED_MAX = 64
_passed_lock = threading.Lock()


def layout_key(manifest: Manifest) -> str:
    """What the verdict depends on: the model spec and each tensor's name, dtype and shape."""
    doc = {"model": manifest.model.model_dump(mode="json"),
           "tensors": [[t.name, t.dtype, list(t.shape)] for t in manifest.tensors]}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def check_model_spec(manifest: Manifest, manifest_bytes: bytes, *, allow_custom: bool = False,
                     timeout_s: float = CHECK_TIMEOUT_S) -> None:
    """Raise :class:`SpecMismatchError` unless the manifest's tensors are exactly those of the
    module its spec builds. A child that fails in any other way refuses the version too: an
    unchecked spec is never installed."""
    # A custom factory is code that may change between two pulls: never remembered.
    key = None if ":" in manifest.model.name else layout_key(manifest)
    with _passed_lock:
        if key is not None and key in _PASSED:
            _PASSED.move_to_end(key)
            return
    _check_in_child(manifest_bytes, manifest.ref, allow_custom, timeout_s)
    if key is not None:
        with _passed_lock:
            _PASSED[key] = None
            while len(_PASSED) > _PASSED_MAX:
                _PASSED.popitem(last=False)


def _check_in_child(manifest_bytes: bytes, ref: str, allow_custom: bool,
                    timeout_s: float) -> None:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="edgetrain-spec-") as tmp:
        path = Path(tmp) / "manifest.json"
        path.write_bytes(manifest_bytes)
        cmd = [sys.executable, "-m", CHILD_MODULE, "check", "--manifest", str(path)]
        if allow_custom:
            cmd.append("--allow-custom-model")
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, env=_child_env(),
                                  timeout=timeout_s, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise SpecMismatchError(
                f"{ref}: the model spec check did not finish within {timeout_s:.0f} s; refused"
            ) from None
    seconds = time.perf_counter() - start
    # torch may warn on stderr before the verdict: the refusal is the last line.
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    if done.returncode == 3:
        raise SpecMismatchError(lines[-1] if lines else f"{ref} does not match its model spec")
    if done.returncode != 0:
        tail = " | ".join(lines[-3:]) or "no message"
        raise SpecMismatchError(
            f"{ref}: the model spec check failed (python -m {CHILD_MODULE} exit "
            f"{done.returncode}: {tail}); refused"
        )
    peak = _reported_peak(done.stdout)
    log.info(
        "model spec of %s checked in a child process (%.1f s, peak RSS %s MB)", ref, seconds,
        "?" if peak is None else f"{peak / 1e6:.0f}",
        extra={"fields": {"event": "spec_check", "ref": ref, "seconds": round(seconds, 3),
                          "peak_rss_bytes": peak}},
    )


def _reported_peak(stdout: str) -> int | None:
    try:
        peak = json.loads(stdout.strip().splitlines()[-1])["peak_rss_bytes"]
    except (IndexError, KeyError, TypeError, ValueError):
        return None
    return peak if isinstance(peak, int) else None
