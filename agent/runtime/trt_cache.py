"""Where ONNX Runtime's TensorRT execution provider keeps the engines it builds.

Without a cache the TensorRT EP builds its engine again for every session: on a Jetson that is
minutes for a resnet, paid by the health check of every staged version, by the runtime's swap
to it after the commit, and by every restart of the runtime, during which nothing serves. With
``trt_engine_cache_enable`` the first session writes the engine and the next ones load it.

One folder per ONNX file content (its SHA-256), under ``.tensorrt-cache`` beside the model's
slots, so the engine the health check built for the staged slot is the one the runtime loads
after the commit flips ``current`` to it. Never inside a slot: a slot holds the signed
version's files only. The timing cache (kernel timings, reusable across models) sits one level
up, shared. Bounded: the :data:`KEEP` most recently used folders stay (the active version, the
standby, and one being staged); older ones are removed when a session is set up.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger("agent.runtime")

TRT_PROVIDER = "TensorrtExecutionProvider"
CACHE_DIR = ".tensorrt-cache"
KEEP = 3
_CHUNK = 1 << 20

ProviderSpec = str | tuple[str, dict[str, str]]
"""An ONNX Runtime provider: its name, or its name and its options."""


def onnx_digest(onnx: Path) -> str:
    h = hashlib.sha256()
    with open(onnx, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def engine_cache_dir(slot_path: Path, onnx: Path) -> Path:
    """This ONNX file's engine folder (created, marked as just used), older ones pruned."""
    root = Path(slot_path).resolve().parent / CACHE_DIR
    path = root / onnx_digest(onnx)[:32]
    path.mkdir(parents=True, exist_ok=True)
    os.utime(path)  # used now: pruning goes by the folders' modification times
    _prune(root, keep=path)
    return path


def _prune(root: Path, keep: Path) -> None:
    dirs = sorted((d for d in root.iterdir() if d.is_dir()),
                  key=lambda d: d.stat().st_mtime, reverse=True)
    for old in dirs[KEEP:]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)
            log.info("tensorrt cache: removed %s (not used by the newest %d versions)", old, KEEP)


def with_engine_cache(providers: list[str], slot_path: Path, onnx: Path) -> list[ProviderSpec]:
    """``providers`` with the TensorRT EP's engine and timing caches switched on, when it is
    among them; the others as they are."""
    if TRT_PROVIDER not in providers:
        return list(providers)
    try:
        cache = engine_cache_dir(slot_path, onnx)
    except OSError as e:  # a read-only models folder (another user's): serve, build each time
        log.warning("tensorrt cache: none (%s): the engine is built for every session", e)
        return list(providers)
    options = {"trt_engine_cache_enable": "True", "trt_engine_cache_path": str(cache),
               "trt_timing_cache_enable": "True", "trt_timing_cache_path": str(cache.parent)}
    return [(p, options) if p == TRT_PROVIDER else p for p in providers]
