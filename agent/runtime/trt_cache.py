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

An engine is valid only for the software that built it: ONNX Runtime's TensorRT EP and the
TensorRT it links, and on a Jetson the L4T release (JetPack) with its driver. The folder name
carries a hash of that platform (:func:`engine_platform`) and holds it as ``platform.json``,
so after a JetPack upgrade the next session builds a fresh engine instead of loading one the
new TensorRT cannot run; the old folder ages out with the bound.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

from exporters.jetpack import l4t_release
from registry.atomic import write_json_atomic

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


@functools.lru_cache(maxsize=1)
def engine_platform() -> dict[str, str]:
    """What this host's TensorRT engines are valid for: ONNX Runtime's version, TensorRT's
    (where its Python package imports) and the L4T release (on a Jetson)."""
    import onnxruntime

    out = {"onnxruntime": onnxruntime.__version__}
    try:
        import tensorrt  # type: ignore[import-not-found]

        out["tensorrt"] = str(tensorrt.__version__)
    except ImportError:
        pass
    release = l4t_release()
    if release is not None:
        out["l4t"] = release
    return out


def engine_cache_dir(slot_path: Path, onnx: Path,
                     platform: dict[str, str] | None = None) -> Path:
    """This ONNX file's engine folder on this platform (created with its ``platform.json``,
    marked as just used), older ones pruned."""
    platform = engine_platform() if platform is None else platform
    tag = hashlib.sha256(json.dumps(platform, sort_keys=True).encode()).hexdigest()[:8]
    root = Path(slot_path).resolve().parent / CACHE_DIR
    path = root / f"{onnx_digest(onnx)[:32]}-{tag}"
    path.mkdir(parents=True, exist_ok=True)
    if not (path / "platform.json").is_file():
        write_json_atomic(path / "platform.json", platform)
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
