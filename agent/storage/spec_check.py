"""Check a verified manifest against its model spec, before any chunk moves.

A registered model (``mlp``, ``resnet``, ...) is checked here, torch-free: the tensors its spec
builds come from ``hpc_core.model_layout``, which tests hold equal to torch's ``state_dict()``.
Importing torch costs a process ~200 MB it never gives back, on a device where the application
may have 1-2 GB: a pull of a registered model never pays it.

A custom factory (``package.module:function``, allowed only with --allow-custom-model) is code:
only building it tells its tensors. That part runs in ``python -m hpc_core.model_spec check``,
a short-lived torch child whose verdict alone comes back (~250 MB while it runs), so the daemon
and the job worker, which live for weeks, stay torch-free either way. The module is named by
string, never imported here (import-linter holds ``agent.storage`` torch-free).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hpc_core.model_layout import check_layout, custom_refused, is_custom
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


def check_model_spec(manifest: Manifest, manifest_bytes: bytes, *, allow_custom: bool = False,
                     timeout_s: float = CHECK_TIMEOUT_S) -> None:
    """Raise :class:`SpecMismatchError` unless the manifest's tensors are exactly those of the
    module its spec builds. A custom factory's child that fails in any other way refuses the
    version too: an unchecked spec is never installed. A custom factory's pass is never
    remembered: its code may change between two pulls."""
    if not is_custom(manifest.model.name):
        check_layout(manifest)
        return
    if not allow_custom:
        raise custom_refused(manifest.model.name)
    _check_in_child(manifest_bytes, manifest.ref, allow_custom, timeout_s)


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
